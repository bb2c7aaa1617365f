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
pseudo-gradients block-quantized on the wire. Then plain DiLoCo (float32,
one fragment) is trained too, on the same batches, for comparison.

``--model lm``: instead of the digits MLP, train_lm_fsdp.py's character
transformer (8 blocks; ``--dim``, ``--blocks``), the metric its loss on
held-out text (lower is better):

    torchrun --standalone --nproc_per_node=2 examples/train_diloco.py --model lm \
        --fragments 4 --overlap 1 --sync-dtype int8

The DiLoCo run writes a checkpoint every ``--checkpoint-every`` steps and
at its end: each worker's parameters and inner state are its own between
synchronisations, saved as ``fdp.PerRank``; ``--resume`` continues from the
newest, on as many workers (docs/checkpoints.md).

Its last line is one JSON object. On torchft replica groups (a worker may
die and heal): docs/fault_tolerance.md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from typing import Any, cast

import common
import optree
import torch
import torch.distributed as dist
import torch.nn.functional as F
import train_lm_fsdp
from train_digits import load_data, mlp

import fdp


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = common.parser(__doc__, "diloco")
    common.add_launch_args(parser)
    parser.add_argument("--model", choices=["digits", "lm"], default="digits", help="what to train")
    parser.add_argument("--steps", type=int, default=600, help="inner steps per worker")
    parser.add_argument("--sync-every", type=int, default=20, help="DiLoCo's H")
    parser.add_argument("--batch-size", type=int, default=64, help="per worker (lm: sequences)")
    parser.add_argument("--lr", type=float, default=2e-3, help="inner AdamW learning rate")
    parser.add_argument("--outer-lr", type=float, default=0.7, help="outer Nesterov SGD rate")
    parser.add_argument("--hidden", type=int, default=128, help="digits: hidden layer width")
    parser.add_argument("--dim", type=int, default=64, help="lm: model width")
    parser.add_argument("--blocks", type=int, default=8, help="lm: transformer blocks")
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
        "--min-accuracy", type=float, default=0.9, help="digits: exit 1 below this test accuracy"
    )
    parser.add_argument(
        "--max-loss", type=float, default=1.0, help="lm: exit 1 above this held-out loss"
    )
    common.add_checkpoint_args(parser, "diloco", every=200)
    return parser.parse_args(argv)


def init_params(args: argparse.Namespace) -> Any:
    """The digits MLP, He-initialised (train_fault_tolerant.py trains it too)."""
    g = torch.Generator().manual_seed(args.seed)
    sizes = [64, args.hidden, args.hidden, 10]
    layers = [
        {"w": torch.randn(i, o, generator=g) * (2.0 / i) ** 0.5, "b": torch.zeros(o)}
        for i, o in itertools.pairwise(sizes)
    ]
    return {"layers": layers}


def cross_entropy(params: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(mlp(params, x), y)


class Digits:
    """The digits MLP: batches from the training split, accuracy on the test split."""

    name, higher_is_better = "test accuracy (digits, held out)", True

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.x_train, self.y_train, self.x_test, self.y_test = load_data(args.seed)

    def init_params(self) -> Any:
        return init_params(self.args)

    def batch(self, step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        order = torch.randperm(len(self.x_train), generator=g)
        idx = order[: self.args.batch_size * world][rank::world]
        return self.x_train[idx], self.y_train[idx]

    def loss(self, params: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return cross_entropy(params, x, y)

    def metric(self, params: Any) -> float:
        with torch.no_grad():
            return float((mlp(params, self.x_test).argmax(1) == self.y_test).float().mean())


class Language:
    """train_lm_fsdp.py's character transformer, unsharded: its loss on held-out text."""

    name, higher_is_better, context, heads = "loss (character LM, held-out text)", False, 48, 4

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        text = train_lm_fsdp.make_text(4000, args.seed)
        held_out = train_lm_fsdp.make_text(300, args.seed + 1)
        self.chars = sorted(set(text) | set(held_out))
        self.data = torch.tensor([self.chars.index(c) for c in text])
        unseen = torch.tensor([self.chars.index(c) for c in held_out])
        starts = torch.arange(0, len(unseen) - self.context - 1, self.context)
        self.x_test, self.y_test = self._windows(unseen, starts)

    def _windows(self, data: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x = torch.stack([data[s : s + self.context] for s in starts])
        return x, torch.stack([data[s + 1 : s + self.context + 1] for s in starts])

    def init_params(self) -> Any:
        a = self.args
        return train_lm_fsdp.init_params(len(self.chars), a.dim, a.blocks, self.context, a.seed)

    def batch(self, step: int, rank: int, world: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(self.args.seed * 100_003 + step)
        n = self.args.batch_size
        starts = torch.randint(len(self.data) - self.context - 1, (n * world,), generator=g)
        return self._windows(self.data, starts[rank * n : (rank + 1) * n])

    def loss(self, params: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = params["embed"]["tokens"][x] + params["embed"]["positions"][: x.shape[1]]
        for block in params["blocks"]:
            h = train_lm_fsdp.attention_block(block, h, self.heads)
        head = params["head"]
        logits = F.rms_norm(h, (h.shape[-1],), head["norm"]) @ head["out"]
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    def metric(self, params: Any) -> float:
        with torch.no_grad():
            return float(self.loss(params, self.x_test, self.y_test))


Task = Digits | Language


def nbytes(tree: Any) -> int:
    leaves: list[torch.Tensor] = optree.tree_leaves(cast(Any, tree))
    return sum(t.numel() * t.element_size() for t in leaves)


def make_optimizer(args: argparse.Namespace, algorithm: str) -> Any:
    """AdamW (DDP); DiLoCo around it, as configured or plain (float32, one fragment)."""
    inner = fdp.optim.adamw(args.lr, weight_decay=1e-4)
    if algorithm == "ddp":
        return inner
    outer = fdp.optim.sgd(args.outer_lr, momentum=0.9, nesterov=True)
    if algorithm == "plain":
        return fdp.DiLoCo(inner, outer=outer, sync_every=args.sync_every)
    streaming = {"fragments": args.fragments, "overlap": args.overlap, "alpha": args.alpha}
    return fdp.DiLoCo(
        inner,
        outer=outer,
        sync_every=args.sync_every,
        sync_dtype=WIRES[args.sync_dtype],
        **(streaming if args.fragments > 1 or args.overlap else {}),
    )


def train(args: argparse.Namespace, task: Task, algorithm: str) -> tuple[Any, float, float]:
    """``--steps`` steps on this rank's batches; returns the parameters, bytes/step and peak."""
    rank, world = dist.get_rank(), dist.get_world_size()
    params, opt = task.init_params(), make_optimizer(args, algorithm)
    wire = "float32" if algorithm == "plain" else args.sync_dtype
    state, sent, peak = opt.init(params), 0.0, 0.0
    saving = algorithm == "diloco"  # the run the script checkpoints
    start, params, state = resumed(args, params, state) if saving else (0, params, state)
    progress = common.Progress(range(start, args.steps), unit=f"{algorithm} step")
    for step in progress:
        x, y = task.batch(step, rank, world)
        grads, loss = fdp.grad_and_value(task.loss)(params, x, y)
        now = 0.0
        if algorithm == "ddp":
            grads = fdp.all_reduce_grads(grads)
            now = nbytes(grads)
        else:
            now = wire_bytes(opt, state, params, wire)
        sent, peak = sent + now, max(peak, now)
        params, state = opt.update(grads, state, params)
        progress.step(len(x) * world)
        progress.show(loss=float(loss))
        if saving and (step + 1 == args.steps or (step + 1) % args.checkpoint_every == 0):
            save(args, step + 1, params, state)
    return params, sent / max(1, args.steps - start), peak


def save(args: argparse.Namespace, step: int, params: Any, state: Any) -> None:
    """Each worker's own parameters and DiLoCo state (``fdp.PerRank``), and the step."""
    path = args.checkpoint_dir / f"step_{step}"
    fdp.save_checkpoint(
        path, {"worker": fdp.PerRank({"params": params, "opt": state}), "step": step}
    )
    common.log(f"checkpoint written: {path}")


def resumed(args: argparse.Namespace, params: Any, state: Any) -> tuple[int, Any, Any]:
    """The step to start at, and this worker's parameters and state (``--resume``'s)."""
    found = common.resume_from(args)
    if found is None:
        return 0, params, state
    like: dict[str, Any] = {"worker": fdp.PerRank({"params": params, "opt": state}), "step": 0}
    loaded = fdp.load_checkpoint(found, like)
    worker = loaded["worker"].value
    return int(loaded["step"]), worker["params"], worker["opt"]


WIRES = {"float32": None, "bfloat16": torch.bfloat16, "int8": torch.int8}
WIRES["float8"] = torch.float8_e4m3fn


def per_value(wire: str) -> float:
    """Bytes per value on the wire: int8 and float8 carry a float32 scale per 256."""
    return {"float32": 4.0, "bfloat16": 2.0}.get(wire, 1 + 4 / 256)


def wire_bytes(opt: fdp.DiLoCo, state: dict[str, Any], params: Any, wire: str) -> float:
    """What the next update sends: the fragments it starts, and the 3-number check."""
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
                + 24
            )
    return sent


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    common.launch(args, __file__)
    try:
        task: Task = Language(args) if args.model == "lm" else Digits(args)
        diloco, diloco_bytes, diloco_peak = train(args, task, "diloco")
        streaming = args.fragments > 1 or args.overlap > 0 or args.sync_dtype != "float32"
        plain = train(args, task, "plain")[0] if streaming else diloco
        ddp, ddp_bytes, _ = train(args, task, "ddp")
        # Plain DiLoCo's peak: the whole tree at once, on the same wire.
        values = sum(t.numel() for t in optree.tree_leaves(cast(Any, diloco)))
        plain_peak = per_value(args.sync_dtype) * values + 24
        metric, metric_ddp, metric_diloco = (task.metric(p) for p in (diloco, ddp, plain))
        threshold = args.min_accuracy if task.higher_is_better else args.max_loss
        result = {
            "metric": metric,
            "metric_name": task.name,
            "threshold": threshold,
            "metric_ddp": metric_ddp,
            "metric_diloco": metric_diloco,  # plain DiLoCo's (float32, one fragment)
            "workers": dist.get_world_size(),
            "sync_every": args.sync_every,
            "bytes_vs_ddp": diloco_bytes / ddp_bytes,
            "peak_bytes_vs_diloco": diloco_peak / plain_peak,
            "fragments": args.fragments,
            "overlap": args.overlap,
            "sync_dtype": args.sync_dtype,
            "model": args.model,
        }
        common.log(
            f"DiLoCo (H={args.sync_every}, {args.sync_dtype} on the wire): {task.name} "
            f"{metric:.4f} with {diloco_bytes / ddp_bytes:.3f}x DDP's bytes; DDP "
            f"{metric_ddp:.4f}, plain DiLoCo {metric_diloco:.4f}"
        )
        common.log(json.dumps(result))
    finally:
        dist.destroy_process_group()
    passed = metric >= threshold if task.higher_is_better else metric <= threshold
    return 0 if passed and math.isfinite(metric) else 1


if __name__ == "__main__":
    sys.exit(main())
