"""Train the digits MLP with DiLoCo (fdp.DiLoCo) and with DDP on the same data and budget.

DiLoCo lets each worker (rank) take ``--sync-every`` AdamW steps on its own
shard, then averages the distance they travelled (the pseudo-gradient) and
steps the shared parameters with Nesterov SGD: one all-reduce every H steps
instead of every step, for slow links between workers. The script trains
the same model twice on the same batches, DiLoCo then DDP-style averaging
every step (``fdp.all_reduce_grads``), and compares test accuracy and the
bytes each all-reduces per step.

    torchrun --standalone --nproc_per_node=2 examples/train_diloco.py
    torchrun --standalone --nproc_per_node=2 examples/train_diloco.py --sync-dtype bfloat16

Its last line is one JSON object. On torchft replica groups (a worker may
die and heal): docs/fault_tolerance.md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from typing import Any, cast

import common
import optree
import torch
import torch.distributed as dist
import torch.nn.functional as F
from train_digits import Params, load_data, mlp

import fdp


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = common.parser(__doc__, "diloco")
    common.add_launch_args(parser)
    parser.add_argument("--steps", type=int, default=600, help="inner steps per worker")
    parser.add_argument("--sync-every", type=int, default=20, help="DiLoCo's H")
    parser.add_argument("--batch-size", type=int, default=64, help="per worker")
    parser.add_argument("--lr", type=float, default=2e-3, help="inner AdamW learning rate")
    parser.add_argument("--outer-lr", type=float, default=0.7, help="outer Nesterov SGD rate")
    parser.add_argument("--hidden", type=int, default=128, help="hidden layer width")
    parser.add_argument("--seed", type=int, default=0, help="data split, initialisation")
    parser.add_argument(
        "--sync-dtype", choices=["float32", "bfloat16"], default="float32", help="on the wire"
    )
    parser.add_argument(
        "--min-accuracy", type=float, default=0.9, help="exit 1 below this test accuracy"
    )
    return parser.parse_args(argv)


def init_params(args: argparse.Namespace) -> Params:
    g = torch.Generator().manual_seed(args.seed)
    sizes = [64, args.hidden, args.hidden, 10]
    layers = [
        {"w": torch.randn(i, o, generator=g) * (2.0 / i) ** 0.5, "b": torch.zeros(o)}
        for i, o in itertools.pairwise(sizes)
    ]
    return {"layers": layers}


def cross_entropy(params: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(mlp(params, x), y)


def nbytes(tree: Any) -> int:
    leaves: list[torch.Tensor] = optree.tree_leaves(cast(Any, tree))
    return sum(t.numel() * t.element_size() for t in leaves)


def train(args: argparse.Namespace, algorithm: str) -> tuple[Params, float]:
    """``--steps`` steps on this rank's shard; returns the parameters and bytes all-reduced/step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x_train, y_train, _, _ = load_data(args.seed)
    params = init_params(args)
    dtype = torch.bfloat16 if args.sync_dtype == "bfloat16" else None
    inner = fdp.optim.adamw(args.lr, weight_decay=1e-4)
    outer = fdp.optim.sgd(args.outer_lr, momentum=0.9, nesterov=True)
    opt: Any = (
        fdp.DiLoCo(inner, outer=outer, sync_every=args.sync_every, sync_dtype=dtype)
        if algorithm == "diloco"
        else inner
    )
    state, sent = opt.init(params), 0
    progress = common.Progress(range(args.steps), unit=f"{algorithm} step")
    for step in progress:
        order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(step))
        idx = order[: args.batch_size * world][rank::world]
        grads, loss = fdp.grad_and_value(cross_entropy)(params, x_train[idx], y_train[idx])
        if algorithm == "ddp":
            grads = fdp.all_reduce_grads(grads)
            sent += nbytes(grads)
        elif opt.syncs(state):
            # the pseudo-gradient in the wire dtype, and DiLoCo's 2-number count check
            sent += nbytes(params) // (2 if dtype is not None else 1) + 16
        params, state = opt.update(grads, state, params)
        progress.step(len(idx) * world)
        progress.show(loss=float(loss))
    return params, sent / args.steps


def accuracy(params: Params, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((mlp(params, x).argmax(1) == y).float().mean())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    common.launch(args, __file__)
    try:
        _, _, x_test, y_test = load_data(args.seed)
        diloco, diloco_bytes = train(args, "diloco")
        ddp, ddp_bytes = train(args, "ddp")
        metric, metric_ddp = accuracy(diloco, x_test, y_test), accuracy(ddp, x_test, y_test)
        result = {
            "metric": metric,
            "metric_name": "test accuracy (digits, held out)",
            "threshold": args.min_accuracy,
            "metric_ddp": metric_ddp,
            "workers": dist.get_world_size(),
            "sync_every": args.sync_every,
            "bytes_vs_ddp": diloco_bytes / ddp_bytes,
        }
        common.log(
            f"DiLoCo (H={args.sync_every}, {args.sync_dtype} on the wire): test accuracy "
            f"{metric:.4f} with {diloco_bytes / ddp_bytes:.3f}x DDP's bytes; DDP {metric_ddp:.4f}"
        )
        common.log(json.dumps(result))
    finally:
        dist.destroy_process_group()
    return 0 if metric >= args.min_accuracy else 1


if __name__ == "__main__":
    sys.exit(main())
