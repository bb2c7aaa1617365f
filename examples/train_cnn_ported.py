"""A torch DDP training script ported to fdp: schedule, clipping, autocast, checkpoints.

What a torch script does with DistributedDataParallel, AdamW, a LinearLR
warm-up then CosineAnnealingLR, ``clip_grad_norm_``, CPU bfloat16 autocast
and save/resume, written with fdp's pieces (docs/porting.md):

- the conv net with BatchNorm of train_cnn_ddp.py, split by
  ``fdp.make_functional``; ``fdp.DistributedDataParallel`` averages its
  gradients and broadcasts rank 0's running statistics, as torch's does;
- ``fdp.optim.adamw`` with ``fdp.optim.warmup_cosine_decay_schedule`` as its
  learning rate: a function of the step the optimizer state holds, so the
  checkpoint carries the schedule and a resume takes the same rates;
- ``fdp.optim.clip_by_global_norm`` on the averaged gradients, then the
  update written into the module's own tensors (``donate=True``, as
  ``optimizer.step()`` does);
- ``fdp.save_checkpoint`` every ``--checkpoint-every`` steps (parameters,
  buffers, optimizer state, step and learning rate; each rank's RNG) and
  ``--resume`` from ``fdp.latest_checkpoint``: a run killed and restarted by
  torchrun ends bitwise where an uninterrupted one does.

    torchrun --standalone --nproc_per_node=2 examples/train_cnn_ported.py
    torchrun --standalone --nproc_per_node=2 --max-restarts=3 \\
        examples/train_cnn_ported.py --resume
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import common
import torch
import torch.distributed as dist
import torch.nn.functional as F
from train_cnn_ddp import conv_net
from train_digits import load_data

import fdp


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = common.parser(__doc__, "cnn_ported")
    parser.add_argument("--epochs", type=int, default=8, help="passes over the training set")
    parser.add_argument("--batch-size", type=int, default=64, help="global batch")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--warmup", type=int, default=20, help="warm-up steps")
    parser.add_argument("--max-norm", type=float, default=1.0, help="gradient clipping norm")
    parser.add_argument("--seed", type=int, default=0, help="data split, initialisation")
    common.add_checkpoint_args(parser, "cnn_ported", every=50)
    common.add_launch_args(parser)
    parser.add_argument(
        "--min-accuracy", type=float, default=0.9, help="exit 1 below this test accuracy"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = common.launch(args, __file__)
    try:
        return train(args, device)
    finally:
        dist.destroy_process_group()


def train(args: argparse.Namespace, device: torch.device) -> int:
    x_train, y_train, x_test, y_test = (t.to(device) for t in load_data(args.seed))
    x_train, x_test = x_train.view(-1, 1, 8, 8), x_test.view(-1, 1, 8, 8)
    torch.manual_seed(args.seed)  # the same model on every rank
    net = conv_net().to(device)
    fn, state = fdp.make_functional(net)
    ddp = fdp.DistributedDataParallel(state)
    params = {k: v for k, v in state.items() if v.requires_grad}
    per_epoch = -(-len(x_train) // args.batch_size)
    schedule = fdp.optim.warmup_cosine_decay_schedule(
        0.1 * args.lr, args.lr, args.warmup, args.epochs * per_epoch, end_value=0.01 * args.lr
    )
    opt = fdp.optim.adamw(schedule, weight_decay=0.01)
    saved: dict[str, Any] = {"state": state, "opt": opt.init(params), "step": 0, "lr": 0.0}
    found = common.resume_from(args)
    if found is not None:
        loaded = fdp.load_checkpoint(found, saved)
        with torch.no_grad():  # into the module's own tensors, as load_state_dict does
            for k, v in loaded["state"].items():
                state[k].copy_(v)
        saved = {**loaded, "state": state}
    common.log(
        f"digits: {dist.get_world_size()} ranks ({dist.get_backend()}), step {saved['step']}"
    )
    began = time.perf_counter()
    saved = run(args, (fn, ddp, opt, schedule), saved, (x_train, y_train), device)
    common.log(f"trained to step {saved['step']} in {time.perf_counter() - began:.1f} s")
    return report(args, net, fn, state, (x_test, y_test))


def run(
    args: argparse.Namespace,
    parts: tuple[Any, ...],
    saved: dict[str, Any],
    data: tuple[torch.Tensor, torch.Tensor],
    device: torch.device,
) -> dict[str, Any]:
    """Trains from ``saved["step"]`` to the last epoch; checkpoints every N steps."""
    fn, ddp, opt, schedule = parts
    rank, world = dist.get_rank(), dist.get_world_size()
    x_train, y_train = data
    state, opt_state, step, lr = saved["state"], saved["opt"], saved["step"], saved["lr"]
    loss = torch.zeros(())
    params = {k: v for k, v in state.items() if v.requires_grad}
    per_epoch = -(-len(x_train) // args.batch_size)
    progress = common.Progress(range(step // per_epoch, args.epochs), unit="epoch")
    for epoch in progress:
        order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(epoch))
        for i in range(step % per_epoch, per_epoch):  # the data position: resumed mid-epoch
            batch = order[i * args.batch_size : (i + 1) * args.batch_size]
            idx = batch[rank::world].to(device)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=device.type == "cpu"):
                logits = fn(ddp(state), x_train[idx])
            loss = F.cross_entropy(logits.float(), y_train[idx])
            torch.autograd.backward(loss)  # .grad: averaged over ranks
            grads = {k: p.grad for k, p in params.items()}
            grads, _norm = fdp.optim.clip_by_global_norm(grads, args.max_norm)
            lr = float(schedule(opt_state["step"][next(iter(params))]))
            with torch.no_grad():
                _, opt_state = opt.update(grads, opt_state, params, donate=True)
            for p in params.values():
                p.grad = None
            step += 1
            progress.step(len(batch))
            if step % args.checkpoint_every == 0:
                save(args, {"state": state, "opt": opt_state, "step": step, "lr": lr})
        progress.show(loss=float(loss))
    last = {"state": state, "opt": opt_state, "step": step, "lr": lr}
    if step % args.checkpoint_every != 0:  # the last steps, not lost on --resume
        save(args, last)
    return last


def save(args: argparse.Namespace, saved: dict[str, Any]) -> None:
    path = args.checkpoint_dir / f"step_{saved['step']}"
    fdp.save_checkpoint(path, saved)
    common.log(f"checkpoint written: {path} (learning rate {saved['lr']:.3e})")


def report(args: argparse.Namespace, net: Any, fn: Any, state: Any, test: Any) -> int:
    """Checks that every rank holds rank 0's parameters; prints the test accuracy.

    Buffers may differ: each rank's last forward updated its own running
    statistics (the next training call would broadcast rank 0's).
    """
    params = [t for t in state.values() if t.requires_grad]
    checksum = torch.stack([t.detach().double().sum() for t in params])
    reference = checksum.clone()
    dist.broadcast(reference, src=0)
    params_agree = bool(torch.equal(checksum, reference))
    net.eval()
    with torch.no_grad():
        test_acc = float((fn(state, test[0]).argmax(1) == test[1]).float().mean())
    common.log(f"test accuracy {test_acc:.4f}")
    if not params_agree:
        print(f"rank {dist.get_rank()}: parameters differ from rank 0's")
        return 1
    if test_acc < args.min_accuracy:
        common.log(f"test accuracy {test_acc:.4f} is below --min-accuracy {args.min_accuracy}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
