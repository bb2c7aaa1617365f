"""Train the digits MLP on several processes with fdp.DistributedDataParallel.

The same model and data as train_digits.py, launched with torchrun: every
process (rank) takes its share of each global batch, and
``fdp.DistributedDataParallel`` averages the gradients across ranks during
backward, bucket by bucket, so every rank takes the same optimiser step.

    torchrun --standalone --nproc_per_node=2 examples/train_digits_ddp.py
    torchrun --standalone --nproc_per_node=2 examples/train_digits_ddp.py --compile
    torchrun --standalone --nproc_per_node=2 examples/train_digits_ddp.py --powersgd

With ``--backend nccl`` each rank drives the GPU ``LOCAL_RANK``. Several
machines, SLURM and restarts after a lost worker: docs/launch.md.
"""

from __future__ import annotations

import argparse
import sys
import time

import common
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD
from train_digits import Params, init_params, load_data, mlp

import fdp


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = common.parser(__doc__, "digits_ddp")
    common.add_digits_args(parser, batch="global batch, split over the ranks")
    common.add_launch_args(parser)
    parser.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the loss with the reduction (inductor, fullgraph)",
    )
    parser.add_argument(
        "--powersgd",
        action="store_true",
        help="reduce gradients with torch's PowerSGD hook (rank-1 compression after 10 steps)",
    )
    parser.add_argument(
        "--min-accuracy", type=float, default=0.9, help="exit 1 below this test accuracy"
    )
    return parser.parse_args(argv)


def accuracy(params: Params, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((mlp(params, x).argmax(1) == y).float().mean())


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
    # Each rank may start from different values; rank 0's win.
    params = init_params(
        [64, args.hidden, args.hidden, 10],
        device=str(device),
        generator=torch.Generator().manual_seed(args.seed + rank),
    )
    fdp.broadcast_params(params)
    ddp = fdp.DistributedDataParallel(params)
    if args.powersgd:  # torch's hook, unmodified: fdp speaks torch's comm-hook protocol
        state = powerSGD.PowerSGDState(
            process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=10
        )
        ddp.register_comm_hook(state, powerSGD.powerSGD_hook)
    leaves = [t for layer in params["layers"] for t in layer.values()]
    optimizer = torch.optim.Adam(leaves, lr=args.lr)
    common.log(
        f"digits: {len(x_train)} train / {len(x_test)} test images, {world} ranks "
        f"({dist.get_backend()}, {device}), {len(ddp.buckets)} gradient buckets"
    )

    def ddp_loss(p: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(mlp(ddp(p), x), y)

    # Compiled, the whole loss is one graph (fullgraph=True: no graph break),
    # and the bucketed all-reduce is part of the compiled backward.
    # overlap_options() lets inductor issue each bucket as soon as its
    # gradients exist and wait for it as late as possible.
    options = fdp.overlap_options()
    loss_fn = torch.compile(ddp_loss, fullgraph=True, options=options) if args.compile else ddp_loss
    start = time.perf_counter()
    progress = common.Progress(range(args.epochs), unit="epoch")
    loss_sum = torch.zeros((), device=device)
    losses: list[float] = []
    for epoch in progress:
        # Every rank draws the same order and takes every world-th sample of each batch.
        order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(epoch))
        loss_sum.zero_()
        for i in range(0, len(order), args.batch_size):
            idx = order[i : i + args.batch_size][rank::world].to(device)
            loss = loss_fn(params, x_train[idx], y_train[idx])
            optimizer.zero_grad(set_to_none=True)
            torch.autograd.backward(loss)  # grads averaged over ranks here
            optimizer.step()
            loss_sum += loss.detach() * len(idx)
            progress.step(len(order[i : i + args.batch_size]))  # the global batch
        dist.all_reduce(loss_sum)
        losses.append(float(loss_sum) / len(order))
        progress.show(loss=losses[-1])
    elapsed = time.perf_counter() - start

    # Every rank took the same steps: check that the parameters agree.
    checksum = torch.stack([t.detach().double().sum() for t in leaves])
    reference = checksum.clone()
    dist.broadcast(reference, src=0)
    in_sync = bool(torch.equal(checksum, reference))
    test_acc = accuracy(params, x_test, y_test)
    train_acc = accuracy(params, x_train, y_train)
    common.log(
        f"trained {args.epochs} epochs in {elapsed:.1f} s ({progress.rate:.0f} samples/s); "
        f"final epoch's mean loss {losses[-1]:.4f}"
    )
    common.log(f"train accuracy {train_acc:.4f}")
    common.log(f"test accuracy {test_acc:.4f}")
    if args.plot and rank == 0:
        common.save_plot(losses, args.plot, title=f"fdp.DistributedDataParallel, {world} ranks")
    if not in_sync:
        print(f"rank {rank}: parameters differ from rank 0's")
        return 1
    if test_acc < args.min_accuracy:
        common.log(f"test accuracy {test_acc:.4f} is below --min-accuracy {args.min_accuracy}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
