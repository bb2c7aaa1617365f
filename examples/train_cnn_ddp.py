"""Train a small conv net with BatchNorm on several processes, on shards of different sizes.

A torch.nn module with BatchNorm layers is split into a pure function and
its state (``fdp.make_functional``); with ``sync_batch_norm=True`` its
batch norms take their statistics over the batches of every rank, as
torch's ``SyncBatchNorm`` does, and they also run on CPU.
``fdp.DistributedDataParallel`` averages the gradients and broadcasts the
buffers (the running statistics) from rank 0 at every call, so every rank
evaluates the same model.

The ranks hold shards of different sizes (rank 0 a larger one), so they
run out of batches at different steps. ``ddp.join()`` lets them train
together anyway: a rank that has finished its epoch mirrors the others'
collectives until every rank has, and while it waits the batch norms take
their statistics over the ranks still training.

    torchrun --standalone --nproc_per_node=2 examples/train_cnn_ddp.py
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
from torch import nn
from train_digits import load_data

import fdp


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = common.parser(__doc__, "cnn_ddp")
    parser.add_argument("--epochs", type=int, default=15, help="passes over the training set")
    parser.add_argument(
        "--batch-size", type=int, default=64, help="global batch; each rank takes 1/world of it"
    )
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
    parser.add_argument(
        "--skew", type=float, default=0.7, help="rank 0's share of the training set (2 ranks)"
    )
    parser.add_argument("--seed", type=int, default=0, help="data split, initialisation")
    common.add_launch_args(parser)
    parser.add_argument(
        "--min-accuracy", type=float, default=0.9, help="exit 1 below this test accuracy"
    )
    return parser.parse_args(argv)


def conv_net() -> nn.Module:
    """Two 3x3 conv layers and a hidden linear layer on 8x8 images, each with BatchNorm."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 64),
        nn.BatchNorm1d(64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


def shard_bounds(n: int, rank: int, world: int, skew: float) -> tuple[int, int]:
    """Rank ``rank``'s slice of ``n`` examples: rank 0 takes ``skew``, the rest share the rest."""
    first = int(n * skew) if world > 1 else n
    if rank == 0:
        return 0, first
    rest = (n - first) // (world - 1)
    return first + (rank - 1) * rest, first + rank * rest


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
    x_train, x_test = x_train.view(-1, 1, 8, 8), x_test.view(-1, 1, 8, 8)
    start, stop = shard_bounds(len(x_train), rank, world, args.skew)
    x_mine, y_mine = x_train[start:stop], y_train[start:stop]

    torch.manual_seed(args.seed + rank)  # different starting values; rank 0's win
    net = conv_net().to(device)
    fn, state = fdp.make_functional(net, sync_batch_norm=True)
    fdp.broadcast_params(state)
    ddp = fdp.DistributedDataParallel(state)  # broadcast_buffers=True: rank 0's statistics
    params = [t for t in state.values() if t.requires_grad]
    optimizer = torch.optim.Adam(params, lr=args.lr)
    local = max(1, args.batch_size // world)  # this rank's part of the global batch
    batches = [len(range(0, len(x), local)) for x in _all_shards(x_train, world, args)]
    common.log(
        f"digits: {len(x_train)} train / {len(x_test)} test images, {world} ranks "
        f"({dist.get_backend()}, {device}); batches per epoch by rank: {batches}"
    )

    began = time.perf_counter()
    progress = common.Progress(range(args.epochs), unit="epoch")
    losses: list[float] = []
    for epoch in progress:
        net.train()
        order = torch.randperm(len(x_mine), generator=torch.Generator().manual_seed(epoch))
        loss_sum = torch.zeros((), device=device)
        with ddp.join():  # this rank's number of batches differs from the others'
            for i in range(0, len(order), local):
                idx = order[i : i + local].to(device)
                loss = F.cross_entropy(fn(ddp(state), x_mine[idx]), y_mine[idx])
                optimizer.zero_grad(set_to_none=True)
                torch.autograd.backward(loss)
                optimizer.step()
                loss_sum += loss.detach() * len(idx)
        dist.all_reduce(loss_sum)
        losses.append(float(loss_sum) / len(x_train))
        progress.step(len(x_train))  # every rank's shard, once
        progress.show(loss=losses[-1])
    elapsed = time.perf_counter() - began
    if args.plot and rank == 0:
        title = f"conv net, sync batch norm, {world} ranks in join"
        common.save_plot(losses, args.plot, title=title)
    common.log(f"trained {args.epochs} epochs in {elapsed:.1f} s ({progress.rate:.0f} samples/s)")
    return report(args, net, fn, state, (x_test, y_test))


def _all_shards(x: torch.Tensor, world: int, args: argparse.Namespace) -> list[torch.Tensor]:
    return [x[slice(*shard_bounds(len(x), r, world, args.skew))] for r in range(world)]


def report(
    args: argparse.Namespace,
    net: nn.Module,
    fn: Any,
    state: dict[str, torch.Tensor],
    test: tuple[torch.Tensor, torch.Tensor],
) -> int:
    """Checks that every rank holds the same parameters and buffers; prints test accuracy."""
    rank = dist.get_rank()
    # Leaving join, every rank took the state of the last rank to leave.
    checksum = torch.stack([t.detach().double().sum() for t in state.values()])
    reference = checksum.clone()
    dist.broadcast(reference, src=0)
    in_sync = bool(torch.equal(checksum, reference))
    net.eval()  # running statistics from here on
    with torch.no_grad():
        test_acc = float((fn(state, test[0]).argmax(1) == test[1]).float().mean())
    common.log(f"test accuracy {test_acc:.4f}")
    if not in_sync:
        print(f"rank {rank}: parameters or buffers differ from rank 0's")
        return 1
    if test_acc < args.min_accuracy:
        common.log(f"test accuracy {test_acc:.4f} is below --min-accuracy {args.min_accuracy}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
