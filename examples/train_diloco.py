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
    torchrun --standalone --nproc_per_node=2 examples/train_diloco.py \
        --fragments 4 --overlap 1 --sync-dtype int8

Streaming DiLoCo (``--fragments P``): the model's layers in ``P`` fragments
that synchronise at staggered steps, each ``--overlap`` steps after it is
sent (``--alpha`` of the local fragment kept); ``--sync-dtype int8``: the
pseudo-gradients block-quantized on the wire.

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
        "--sync-dtype",
        choices=["float32", "bfloat16", "int8", "float8"],
        default="float32",
        help="the pseudo-gradient on the wire",
    )
    parser.add_argument("--fragments", type=int, default=1, help="Streaming DiLoCo's P")
    parser.add_argument("--overlap", type=int, default=0, help="steps a fragment's sync overlaps")
    parser.add_argument("--alpha", type=float, default=0.5, help="local weight when one lands")
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


def train(args: argparse.Namespace, algorithm: str) -> tuple[Params, float, float]:
    """``--steps`` steps on this rank's shard; returns the parameters and bytes all-reduced/step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x_train, y_train, _, _ = load_data(args.seed)
    params = init_params(args)
    inner = fdp.optim.adamw(args.lr, weight_decay=1e-4)
    outer = fdp.optim.sgd(args.outer_lr, momentum=0.9, nesterov=True)
    streaming = {"fragments": args.fragments, "overlap": args.overlap, "alpha": args.alpha}
    opt: Any = (
        fdp.DiLoCo(
            inner,
            outer=outer,
            sync_every=args.sync_every,
            sync_dtype=WIRES[args.sync_dtype],
            **(streaming if args.fragments > 1 or args.overlap else {}),
        )
        if algorithm == "diloco"
        else inner
    )
    state, sent, peak = opt.init(params), 0.0, 0.0
    progress = common.Progress(range(args.steps), unit=f"{algorithm} step")
    for step in progress:
        order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(step))
        idx = order[: args.batch_size * world][rank::world]
        grads, loss = fdp.grad_and_value(cross_entropy)(params, x_train[idx], y_train[idx])
        now = 0.0
        if algorithm == "ddp":
            grads = fdp.all_reduce_grads(grads)
            now = nbytes(grads)
        else:
            now = wire_bytes(opt, state, params, args.sync_dtype)
        sent, peak = sent + now, max(peak, now)
        params, state = opt.update(grads, state, params)
        progress.step(len(idx) * world)
        progress.show(loss=float(loss))
    return params, sent / args.steps, peak


WIRES = {"float32": None, "bfloat16": torch.bfloat16, "int8": torch.int8}
WIRES["float8"] = torch.float8_e4m3fn


def per_value(wire: str) -> float:
    """Bytes per value on the wire: int8 and float8 carry a float32 scale per 256."""
    return {"float32": 4.0, "bfloat16": 2.0}.get(wire, 1 + 4 / 256)


def wire_bytes(opt: fdp.DiLoCo, state: dict[str, Any], params: Params, wire: str) -> float:
    """What the next update sends: the fragments it starts, and the 2-number count check."""
    count = int(state["count"]) + 1
    labels = state["fragments"].tolist()
    total = max(labels) + 1
    leaves = optree.tree_leaves(cast(Any, params))
    sent = 0.0
    for i in range(total):
        if count % opt.sync_every == i * opt.sync_every // total:
            sent += (
                per_value(wire)
                * sum(t.numel() for t, f in zip(leaves, labels, strict=True) if f == i)
                + 16
            )
    return sent


def accuracy(params: Params, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((mlp(params, x).argmax(1) == y).float().mean())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    common.launch(args, __file__)
    try:
        _, _, x_test, y_test = load_data(args.seed)
        diloco, diloco_bytes, diloco_peak = train(args, "diloco")
        ddp, ddp_bytes, _ = train(args, "ddp")
        # Plain DiLoCo's peak: the whole tree at once, on the same wire.
        values = sum(t.numel() for t in optree.tree_leaves(cast(Any, diloco)))
        plain_peak = per_value(args.sync_dtype) * values + 16
        metric, metric_ddp = accuracy(diloco, x_test, y_test), accuracy(ddp, x_test, y_test)
        result = {
            "metric": metric,
            "metric_name": "test accuracy (digits, held out)",
            "threshold": args.min_accuracy,
            "metric_ddp": metric_ddp,
            "workers": dist.get_world_size(),
            "sync_every": args.sync_every,
            "bytes_vs_ddp": diloco_bytes / ddp_bytes,
            "peak_bytes_vs_diloco": diloco_peak / plain_peak,
            "fragments": args.fragments,
            "overlap": args.overlap,
            "sync_dtype": args.sync_dtype,
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
