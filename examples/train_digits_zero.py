"""Train the digits MLP with AdamW sharded across ranks (fdp.ZeroRedundancy), with checkpoints.

The model and data of train_digits.py, launched with torchrun. Each step
takes ``torch.func.grad`` of this rank's share of the batch;
``fdp.ZeroRedundancy`` averages the gradients across ranks, updates this
rank's slice of the parameters with AdamW (each rank keeps the AdamW state
of its slice only) and gathers the new parameters. Every
``--checkpoint-every`` steps the training state (parameters, the sharded
AdamW state, the step, each rank's RNG) is saved with
``fdp.save_checkpoint`` (torch.distributed.checkpoint); ``--resume``
continues from the newest complete checkpoint, on any number of ranks.

    torchrun --standalone --nproc_per_node=2 examples/train_digits_zero.py
    torchrun --standalone --nproc_per_node=2 examples/train_digits_zero.py --resume --epochs 60

To survive a lost rank, let torchrun restart the group; the restarted ranks
resume from the last checkpoint (gloo needs the environment variable, see
docs/zero.md):

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc_per_node=2 --max-restarts=3 \\
        --rdzv-backend=c10d --rdzv-endpoint=localhost:29500 examples/train_digits_zero.py --resume
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path
from typing import Any

import optree
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm
from train_digits import Params, init_params, load_data, mlp, save_plot

import fdp


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=128, help="global, over all ranks")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stage", type=int, default=2, choices=[1, 2])
    parser.add_argument("--checkpoint-dir", type=Path, default=Path("checkpoints/digits_zero"))
    parser.add_argument("--checkpoint-every", type=int, default=100, help="steps")
    parser.add_argument("--resume", action="store_true", help="from the newest checkpoint")
    parser.add_argument("--plot", default=None, help="write the loss curve to this PNG")
    parser.add_argument(
        "--min-accuracy", type=float, default=0.9, help="exit 1 below this test accuracy"
    )
    return parser.parse_args(argv)


def latest(directory: Path) -> Path | None:
    """The newest complete checkpoint: DCP writes ``.metadata`` last."""
    done = [p for p in directory.glob("step_*") if (p / ".metadata").exists()]
    return max(done, key=lambda p: int(p.name.removeprefix("step_")), default=None)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if "RANK" not in os.environ:
        sys.exit("launch with torchrun, e.g. torchrun --standalone --nproc_per_node=2 " + __file__)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=120))
    try:
        return train(args, device)
    finally:
        dist.destroy_process_group()


def train(args: argparse.Namespace, device: torch.device) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    x_train, y_train, x_test, y_test = (t.to(device) for t in load_data(args.seed))
    torch.manual_seed(args.seed)
    params = init_params(
        [64, args.hidden, args.hidden, 10],
        device=str(device),
        generator=torch.Generator().manual_seed(args.seed),
    )
    params = optree.tree_map(torch.Tensor.detach, params)  # type: ignore[arg-type,assignment]
    zero = fdp.ZeroRedundancy(fdp.optim.adamw(args.lr), params, stage=args.stage)
    state: dict[str, Any] = {"params": params, "opt": zero.init(params), "step": 0}
    found = latest(args.checkpoint_dir) if args.resume else None
    if found is not None:
        state = fdp.load_checkpoint(found, state)
    if rank == 0:
        opt = state["opt"]
        mine = sum(t.numel() * t.element_size() for v in opt.slots.values() for b in v for t in b)
        leaves: list[torch.Tensor] = optree.tree_leaves(params)  # type: ignore[arg-type]
        total = 2 * sum(t.numel() * t.element_size() for t in leaves)
        print(
            f"digits: {world} ranks ({dist.get_backend()}), ZeRO-{args.stage}; AdamW state "
            f"on rank 0: {mine / 1e3:.0f} kB of {total / 1e3:.0f} kB"
            + (f"; resumed from {found} (step {state['step']})" if found else "")
        )
        if args.resume and found is None:
            print(f"--resume: no complete checkpoint in {args.checkpoint_dir}; starting at step 0")
    data = (x_train, y_train, x_test, y_test)
    start = time.perf_counter()
    first_epoch = state["step"] // -(-len(x_train) // args.batch_size) + 1
    state, losses = run(args, zero, state, data, device)
    elapsed = time.perf_counter() - start
    if args.plot and rank == 0 and losses:
        title = f"fdp.ZeroRedundancy (ZeRO-{args.stage}), {world} ranks"
        save_plot(losses, args.plot, title=title, first_epoch=first_epoch)
        print(f"loss curve written to {args.plot}")
    return report(state["params"], args, data, elapsed)


def run(
    args: argparse.Namespace,
    zero: fdp.ZeroRedundancy,
    state: dict[str, Any],
    data: tuple[torch.Tensor, ...],
    device: torch.device,
) -> tuple[dict[str, Any], list[float]]:
    """Trains from ``state["step"]`` to the last epoch; checkpoints every N steps and at the end."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x_train, y_train = data[0], data[1]
    params, opt, step = state["params"], state["opt"], state["step"]
    steps_per_epoch = -(-len(x_train) // args.batch_size)

    def loss(p: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(mlp(p, x), y)

    grad_and_loss = torch.func.grad_and_value(loss)
    losses: list[float] = []
    bar: tqdm[int] = tqdm(
        range(step // steps_per_epoch, args.epochs),
        desc="training",
        unit="epoch",
        disable=rank != 0,
    )
    for epoch in bar:
        order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(epoch))
        loss_sum = torch.zeros((), device=device)
        for i in range(step % steps_per_epoch, steps_per_epoch):
            batch = order[i * args.batch_size : (i + 1) * args.batch_size]
            idx = batch[rank::world].to(device)
            grads, value = grad_and_loss(params, x_train[idx], y_train[idx])
            params, opt = zero.step(grads, opt, params)
            loss_sum += value.detach() * len(idx)
            step += 1
            if step % args.checkpoint_every == 0:
                checkpoint = {"params": params, "opt": opt, "step": step}
                fdp.save_checkpoint(args.checkpoint_dir / f"step_{step}", checkpoint)
        dist.all_reduce(loss_sum)
        losses.append(float(loss_sum) / len(x_train))
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
    state = {"params": params, "opt": opt, "step": step}
    if losses and step % args.checkpoint_every != 0:  # the last steps, not lost on --resume
        fdp.save_checkpoint(args.checkpoint_dir / f"step_{step}", state)
    return state, losses


def report(params: Params, args: argparse.Namespace, data: Any, elapsed: float) -> int:
    x_train, y_train, x_test, y_test = data
    with torch.no_grad():
        train_acc = float((mlp(params, x_train).argmax(1) == y_train).float().mean())
        test_acc = float((mlp(params, x_test).argmax(1) == y_test).float().mean())
    leaves: list[torch.Tensor] = optree.tree_leaves(params)  # type: ignore[arg-type]
    checksum = torch.stack([t.double().sum() for t in leaves])
    reference = checksum.clone()
    dist.broadcast(reference, src=0)
    if dist.get_rank() == 0:
        print(f"trained to epoch {args.epochs} in {elapsed:.1f} s")
        print(f"train accuracy {train_acc:.4f}")
        print(f"test accuracy {test_acc:.4f}")
    if not torch.equal(checksum, reference):
        print(f"rank {dist.get_rank()}: parameters differ from rank 0's")
        return 1
    if test_acc < args.min_accuracy:
        print(f"test accuracy {test_acc:.4f} is below --min-accuracy {args.min_accuracy}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
