"""Train the digits MLP with AdamW sharded across ranks (fdp.ZeroRedundancy), with checkpoints.

The model and data of train_digits.py, launched with torchrun. Each step
takes ``fdp.grad`` of this rank's share of the batch;
``fdp.ZeroRedundancy`` averages the gradients across ranks, updates this
rank's slice of the parameters with AdamW (each rank keeps the AdamW state
of its slice only) and gathers the new parameters. Every
``--checkpoint-every`` steps the training state (parameters, the sharded
AdamW state, the step, each rank's RNG) is saved with
``fdp.save_checkpoint`` (torch.distributed.checkpoint); ``--resume``
continues from the newest complete checkpoint, on any number of ranks.

    torchrun --standalone --nproc_per_node=2 examples/train_digits_zero.py
    torchrun --standalone --nproc_per_node=2 examples/train_digits_zero.py --resume --epochs 60

To survive a lost worker, let torchrun restart the group; the restarted
ranks resume from the last checkpoint (docs/launch.md):

    torchrun --standalone --nproc_per_node=2 --max-restarts=3 \\
        examples/train_digits_zero.py --resume
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import common
import optree
import torch
import torch.distributed as dist
import torch.nn.functional as F
from train_digits import Params, init_params, load_data, mlp

import fdp


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = common.parser(__doc__, "digits_zero")
    common.add_digits_args(parser, batch="global batch, split over the ranks")
    parser.add_argument(
        "--stage", type=int, default=2, choices=[1, 2], help="ZeRO stage (2: sharded gradients)"
    )
    common.add_checkpoint_args(parser, "digits_zero", every=100)
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
    found = common.resume_from(args)
    if found is not None:
        state = fdp.load_checkpoint(found, state)
    opt = state["opt"]
    mine = sum(t.numel() * t.element_size() for v in opt.slots.values() for b in v for t in b)
    leaves: list[torch.Tensor] = optree.tree_leaves(params)  # type: ignore[arg-type]
    total = 2 * sum(t.numel() * t.element_size() for t in leaves)
    common.log(
        f"digits: {world} ranks ({dist.get_backend()}, {device}), ZeRO-{args.stage}; AdamW "
        f"state on rank 0: {mine / 1e3:.0f} kB of {total / 1e3:.0f} kB; step {state['step']}"
    )
    data = (x_train, y_train, x_test, y_test)
    start = time.perf_counter()
    first_epoch = state["step"] // -(-len(x_train) // args.batch_size) + 1
    state, losses = run(args, zero, state, data, device)
    elapsed = time.perf_counter() - start
    if args.plot and rank == 0 and losses:
        title = f"fdp.ZeroRedundancy (ZeRO-{args.stage}), {world} ranks"
        common.save_plot(losses, args.plot, title=title, first=first_epoch)
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

    grad_and_loss = fdp.grad_and_value(loss)
    losses: list[float] = []
    progress = common.Progress(range(step // steps_per_epoch, args.epochs), unit="epoch")
    for epoch in progress:
        order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(epoch))
        loss_sum = torch.zeros((), device=device)
        for i in range(step % steps_per_epoch, steps_per_epoch):
            batch = order[i * args.batch_size : (i + 1) * args.batch_size]
            idx = batch[rank::world].to(device)
            grads, value = grad_and_loss(params, x_train[idx], y_train[idx])
            params, opt = zero.step(grads, opt, params)
            loss_sum += value.detach() * len(idx)
            progress.step(len(batch))  # the global batch
            step += 1
            if step % args.checkpoint_every == 0:
                save({"params": params, "opt": opt, "step": step}, args)
        dist.all_reduce(loss_sum)
        losses.append(float(loss_sum) / len(x_train))
        progress.show(loss=losses[-1])
    state = {"params": params, "opt": opt, "step": step}
    if losses and step % args.checkpoint_every != 0:  # the last steps, not lost on --resume
        save(state, args)
    return state, losses


def save(state: dict[str, Any], args: argparse.Namespace) -> None:
    """Every rank writes its part (DCP); rank 0 says where."""
    path = args.checkpoint_dir / f"step_{state['step']}"
    fdp.save_checkpoint(path, state)
    common.log(f"checkpoint written: {path}")


def report(params: Params, args: argparse.Namespace, data: Any, elapsed: float) -> int:
    x_train, y_train, x_test, y_test = data
    with torch.no_grad():
        train_acc = float((mlp(params, x_train).argmax(1) == y_train).float().mean())
        test_acc = float((mlp(params, x_test).argmax(1) == y_test).float().mean())
    leaves: list[torch.Tensor] = optree.tree_leaves(params)  # type: ignore[arg-type]
    checksum = torch.stack([t.double().sum() for t in leaves])
    reference = checksum.clone()
    dist.broadcast(reference, src=0)
    common.log(f"trained to epoch {args.epochs} in {elapsed:.1f} s")
    common.log(f"train accuracy {train_acc:.4f}")
    common.log(f"test accuracy {test_acc:.4f}")
    if not torch.equal(checksum, reference):
        print(f"rank {dist.get_rank()}: parameters differ from rank 0's")
        return 1
    if test_acc < args.min_accuracy:
        common.log(f"test accuracy {test_acc:.4f} is below --min-accuracy {args.min_accuracy}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
