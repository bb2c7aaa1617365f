"""Contrastive learning with global negatives: fdp.all_gather inside an InfoNCE loss.

Each rank encodes two augmented views of its share of a batch of digits;
``fdp.all_gather`` gives every rank every rank's keys, so each query is told
apart from the whole global batch (SimCLR/CLIP-style negatives), and
``fdp.DistributedDataParallel`` averages the parameter gradients. The
first step checks that the gradients equal one process's on the global
batch. At the end, two new views of each held-out digit are matched by
nearest embedding: how often a view finds its own pair among all of
them (the metric; chance is 1 in 360), and, with no label used to train,
how often a digit's nearest training digit has its class.

    torchrun --standalone --nproc_per_node=2 examples/train_contrastive.py
    torchrun --standalone --nproc_per_node=2 examples/train_contrastive.py --compile

The last line is one JSON object: the metric, its threshold, the world
size and the first step's largest gradient difference from one process.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import common
import torch
import torch.distributed as dist
import torch.nn.functional as F
from train_digits import Params, init_params, load_data, mlp

import fdp


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = common.parser(__doc__, "contrastive")
    common.add_digits_args(parser, batch="global batch, split over the ranks")
    common.add_launch_args(parser)
    parser.add_argument("--embedding", type=int, default=32, help="embedding width")
    parser.add_argument("--temperature", type=float, default=0.1, help="InfoNCE temperature")
    parser.add_argument("--compile", action="store_true", help="torch.compile the loss")
    parser.add_argument(
        "--min-accuracy",
        type=float,
        default=0.25,
        help="exit 1 below this top-1 retrieval accuracy of held-out views",
    )
    parser.set_defaults(epochs=30, batch_size=256, lr=3e-3)
    return parser.parse_args(argv)


def augment(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A random view of the digits: a pixel in 4 dropped, and noise."""
    keep = (torch.rand(x.shape, generator=generator) > 0.25).float()
    return x * keep + 0.1 * torch.randn(x.shape, generator=generator)


def info_nce(
    params: Params, a: torch.Tensor, b: torch.Tensor, offset: int, temperature: float
) -> torch.Tensor:
    """Symmetric InfoNCE of this rank's rows against every rank's (``fdp.all_gather``)."""
    za = F.normalize(mlp(params, a), dim=1)
    zb = F.normalize(mlp(params, b), dim=1)
    all_a, all_b = fdp.all_gather(za), fdp.all_gather(zb)  # the global batch's embeddings
    positives = torch.arange(len(za), device=za.device) + offset
    return 0.5 * (
        F.cross_entropy(za @ all_b.T / temperature, positives)
        + F.cross_entropy(zb @ all_a.T / temperature, positives)
    )


def single_process_grads(
    params: Params, a: torch.Tensor, b: torch.Tensor, temperature: float
) -> list[torch.Tensor]:
    """One process's gradient of the same loss on the whole global batch."""
    leaves = [
        t.detach().clone().requires_grad_() for layer in params["layers"] for t in layer.values()
    ]
    it = iter(leaves)
    plain: Params = {"layers": [{k: next(it) for k in layer} for layer in params["layers"]]}
    za, zb = F.normalize(mlp(plain, a), dim=1), F.normalize(mlp(plain, b), dim=1)
    labels = torch.arange(len(za), device=za.device)
    loss = 0.5 * (
        F.cross_entropy(za @ zb.T / temperature, labels)
        + F.cross_entropy(zb @ za.T / temperature, labels)
    )
    return list(torch.autograd.grad(loss, leaves))


def retrieval_accuracy(params: Params, x: torch.Tensor, seed: int) -> float:
    """Held-out digits: how often a second view's nearest first view is its own (chance 1/N)."""
    views = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        a = F.normalize(mlp(params, augment(x, views)), dim=1)
        b = F.normalize(mlp(params, augment(x, views)), dim=1)
        return float(((b @ a.T).argmax(1) == torch.arange(len(x))).float().mean())


def knn_accuracy(
    params: Params,
    train: tuple[torch.Tensor, torch.Tensor],
    test: tuple[torch.Tensor, torch.Tensor],
) -> float:
    """The test digits classified by their nearest training digit in embedding space."""
    with torch.no_grad():
        bank = F.normalize(mlp(params, train[0]), dim=1)
        queries = F.normalize(mlp(params, test[0]), dim=1)
        nearest = (queries @ bank.T).argmax(1)
        return float((train[1][nearest] == test[1]).float().mean())


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
    generator = torch.Generator().manual_seed(args.seed)
    params = init_params([64, args.hidden, args.embedding], device=str(device), generator=generator)
    ddp = fdp.DistributedDataParallel(params)  # checks every rank starts from the same values
    leaves = [t for layer in params["layers"] for t in layer.values()]
    optimizer = torch.optim.Adam(leaves, lr=args.lr)

    def loss_fn(p: Params, a: torch.Tensor, b: torch.Tensor, offset: int) -> torch.Tensor:
        return info_nce(ddp(p), a, b, offset, args.temperature)

    step_fn = torch.compile(loss_fn, fullgraph=True) if args.compile else loss_fn
    before = retrieval_accuracy(params, x_test, args.seed)
    common.log(
        f"contrastive digits: {len(x_train)} unlabelled train images, {world} ranks, global "
        f"batch {args.batch_size} (every rank's keys are every query's negatives)"
    )
    progress = common.Progress(range(args.epochs), unit="epoch")
    diff, start, losses = float("nan"), time.perf_counter(), []
    for epoch in progress:
        # Every rank draws the same batches and views, and takes its share of the rows.
        views = torch.Generator().manual_seed(1000 + epoch)
        order = torch.randperm(len(x_train), generator=views)
        total, steps = torch.zeros((), device=device), 0
        for i in range(0, len(order) - world + 1, args.batch_size):
            batch = x_train[order[i : i + args.batch_size]]
            batch = batch[: len(batch) - len(batch) % world]
            a, b = augment(batch, views).to(device), augment(batch, views).to(device)
            share = len(batch) // world
            mine = slice(rank * share, (rank + 1) * share)
            loss = step_fn(params, a[mine], b[mine], rank * share)
            optimizer.zero_grad(set_to_none=True)
            torch.autograd.backward(loss)  # gradients averaged over ranks here
            if epoch == 0 and i == 0:  # the first step, against one process on the global batch
                want = single_process_grads(params, a, b, args.temperature)
                got = [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves]
                diff = max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True))
            optimizer.step()
            total, steps = total + loss.detach(), steps + 1
            progress.step(len(batch))
        losses.append(float(fdp.all_reduce(total, "mean")) / steps)
        progress.show(loss=losses[-1])
    accuracy = retrieval_accuracy(params, x_test, args.seed)
    knn = knn_accuracy(params, (x_train, y_train), (x_test, y_test))
    common.log(
        f"trained {args.epochs} epochs in {time.perf_counter() - start:.1f} s; "
        f"first step's gradients vs one process: max |diff| {diff:.2e}"
    )
    common.log(
        f"held-out digits: a view's nearest other view is its own pair {accuracy:.4f} of the "
        f"time ({before:.4f} before training, chance {1 / len(x_test):.4f}); each digit's "
        f"class by its nearest training digit's embedding: {knn:.4f} right"
    )
    if args.plot and rank == 0:
        common.save_plot(losses, args.plot, title=f"InfoNCE with global negatives, {world} ranks")
    result = {
        "metric": accuracy,
        "metric_name": "held-out view retrieval accuracy (top-1)",
        "threshold": args.min_accuracy,
        "world_size": world,
        "grad_max_abs_diff_vs_single_process": diff,
    }
    common.log(json.dumps(result))
    return 0 if accuracy >= args.min_accuracy and diff < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
