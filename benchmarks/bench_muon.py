"""Muon on shards: owner-based against every rank orthogonalizing every matrix, 2 and 4 ranks.

An MLP of 8 hidden layers (``--width``, 512; 256 with ``--quick``) and a
10-class head, batch 256 per rank, gloo. Muon steps the weight matrices,
AdamW the biases (``fdp.optim.param_groups``). One training step each
(forward, backward, optimizer), interleaved round by round in the same
processes:

- fully sharded AdamW (``fsdp.optimizer(adamw)``): the baseline Muon must
  stay near (target: owner-based within 1.3x);
- fully sharded Muon, owner-based (``fsdp.optimizer(param_groups(muon,
  adamw))``): each matrix's pieces to one owner, orthogonalized once;
- fully sharded Muon, the redundant way (as Moonlight's distributed Muon):
  every rank gathers every gradient (``fsdp.full``), runs the whole step and
  keeps its shards (target: owner-based <= 0.75x of it at 4 ranks);
- ZeRO-2 Muon (``ZeroRedundancy``), owner-based;
- DDP Muon: every rank steps every matrix of the averaged gradients; and
  with ``fdp.optim.split_transforms`` (each rank its share, one all-gather).

Then ``examples/train_lm_fsdp.py`` on 2 ranks (150 steps; 60 with
``--quick``) with AdamW and with ``--optimizer muon``: both final losses.

Each row: the step's median time, its ratio to fully sharded AdamW, the
matrices the busiest rank orthogonalized per step, and the bytes per rank
the whole-leaf step adds (computed from the layout: owner-based sends each
piece not on its owner there and back; the redundant way gathers every
gradient).

    python benchmarks/bench_muon.py [--quick]

The last line is one JSON object: ``{"rows": [...]}``.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import multiprocessing as mp
import os
import queue
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import results
import torch
import torch.distributed as dist
import torch.nn.functional as F
from timing import interleaved

import fdp

DEPTH, CLASSES, BATCH = 8, 10, 256
Step = Callable[[], Any]


class Counting(fdp.optim.Muon):
    """Muon counting the matrices this rank orthogonalizes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.count = 0

    def transform(self, directions: torch.Tensor) -> torch.Tensor:
        self.count += directions.shape[0]
        return super().transform(directions)


def make_params(width: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    sizes = [width] * (DEPTH + 1) + [CLASSES]
    return [
        {"w": torch.randn(o, i, generator=g) / i**0.5, "b": torch.zeros(o)}
        for i, o in itertools.pairwise(sizes)
    ]


def groups(muon: fdp.optim.Muon) -> fdp.optim.ParamGroups:
    split = lambda name, t: "muon" if t.ndim >= 2 else "adamw"  # noqa: E731
    return fdp.optim.param_groups(split, {"muon": muon, "adamw": fdp.optim.adamw(3e-4)})


def layer(unit: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    return torch.tanh(F.linear(h, unit["w"], unit["b"]))


def fsdp_step(width: int, x: torch.Tensor, y: torch.Tensor, how: str) -> tuple[Step, Any]:
    params = make_params(width)
    fsdp = fdp.FullyShardedDataParallel(params)
    muon = Counting(0.02)
    opt = fsdp.optimizer(fdp.optim.adamw(3e-4) if how == "adamw" else groups(muon))
    full_opt = groups(muon)  # the redundant way: the whole tree on every rank
    box: list[Any] = [fsdp.shard(params)]
    box.append(full_opt.init(params) if how == "redundant" else opt.init(box[0]))

    def loss(s: Any) -> torch.Tensor:
        h = x
        for i in range(DEPTH):
            h = fsdp.apply(s, str(i), layer, h)
        head = lambda u, h: F.cross_entropy(F.linear(h, u["w"], u["b"]), y)  # noqa: E731
        out: torch.Tensor = fsdp.apply(s, str(DEPTH), head, h)
        return out

    def step() -> None:
        grads = fdp.grad(loss)(box[0])
        if how == "redundant":
            full, _ = full_opt.update(fsdp.full(grads), box[1], fsdp.full(box[0]))
            box[0] = fsdp.shard(full)
        else:
            box[0], box[1] = opt.update(grads, box[1], box[0])

    return step, muon


def zero_step(width: int, x: torch.Tensor, y: torch.Tensor) -> tuple[Step, Any]:
    params = make_params(width)
    muon = Counting(0.02)
    zero = fdp.ZeroRedundancy(groups(muon), params)
    box: list[Any] = [params, zero.init(params)]

    def step() -> None:
        grads = fdp.grad(lambda p: F.cross_entropy(mlp(p, x), y))(box[0])
        box[0], box[1] = zero.step(grads, box[1], box[0])

    return step, muon


def ddp_step(
    width: int, x: torch.Tensor, y: torch.Tensor, *, split: bool = False
) -> tuple[Step, Any]:
    params = make_params(width)
    ddp = fdp.DistributedDataParallel(params)
    muon = Counting(0.02)
    opt: Any = groups(muon)
    if split:  # each rank orthogonalizes its share; one all-gather
        opt = fdp.optim.split_transforms(opt)
    box: list[Any] = [params, opt.init(params)]

    def step() -> None:
        grads = fdp.grad(lambda p: F.cross_entropy(mlp(ddp(p), x), y))(box[0])
        box[0], box[1] = opt.update(grads, box[1], box[0])

    return step, muon


def mlp(params: list[dict[str, torch.Tensor]], h: torch.Tensor) -> torch.Tensor:
    *hidden, head = params
    for unit in hidden:
        h = layer(unit, h)
    return F.linear(h, head["w"], head["b"])


METHODS: dict[str, Callable[[int, torch.Tensor, torch.Tensor], tuple[Step, Any]]] = {
    "fsdp adamw": lambda w, x, y: fsdp_step(w, x, y, "adamw"),
    "fsdp muon owner-based": lambda w, x, y: fsdp_step(w, x, y, "owners"),
    "fsdp muon redundant": lambda w, x, y: fsdp_step(w, x, y, "redundant"),
    "zero muon": zero_step,
    "ddp muon": ddp_step,
    "ddp muon split": lambda w, x, y: ddp_step(w, x, y, split=True),
}


def added_bytes(method: str, width: int, world: int) -> float:
    """Bytes per rank the whole-leaf step adds to the step's collectives (from the layout)."""
    matrices = [width * width] * DEPTH + [CLASSES * width]
    if method == "fsdp muon redundant":  # every gradient gathered: all but this rank's share
        return 4.0 * sum(matrices) * (world - 1) / world
    if "owner" in method or method == "zero muon":  # pieces off their owner, there and back
        return 2 * 4.0 * sum(matrices) * (world - 1) / world / world
    if method == "ddp muon split":  # every update gathered from its owner
        return 4.0 * sum(matrices) * (world - 1) / world
    return 0.0


def measure(rank: int, size: int, width: int, rounds: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(BATCH, width, generator=g)
    y = torch.randint(0, CLASSES, (BATCH,), generator=g)
    steps, counts = {}, {}
    for name, make in METHODS.items():
        steps[name], counter = make(width, x, y)
        steps[name]()  # one step: the matrices it orthogonalized here; and warm
        counts[name] = counter.count
    times = interleaved(steps, rounds=rounds, repeats=2, sync=dist.barrier)
    return {"times": times, "counts": counts}


def serve(rank: int, size: int, port: int, args: Any, out: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
        timeout=datetime.timedelta(seconds=600),
    )  # fmt: skip
    try:
        got = measure(rank, size, args.width, args.rounds)
        out.put((rank, got))
    finally:
        dist.destroy_process_group()


def run(size: int, args: Any) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = 29500 + (os.getpid() + size) % 1000
    procs = [ctx.Process(target=serve, args=(r, size, port, args, out)) for r in range(size)]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    try:
        while len(got) < size:
            rank, value = out.get(timeout=1200)
            got[rank] = value
    except queue.Empty:
        for p in procs:
            p.kill()
        sys.exit(f"a rank failed or timed out: exit codes {[p.exitcode for p in procs]}")
    for p in procs:
        p.join(60)
    times = got[0]["times"]
    rows = []
    for method, seconds in times.items():
        busiest = max(got[r]["counts"][method] for r in range(size))
        rows.append({
            "ranks": size, "method": method, "ms": round(seconds * 1e3, 2),
            "vs_fsdp_adamw": round(seconds / times["fsdp adamw"], 3),
            "vs_redundant": round(seconds / times["fsdp muon redundant"], 3),
            "matrices_busiest_rank": busiest,
            "matrices_all_ranks": sum(got[r]["counts"][method] for r in range(size)),
            "added_mb_per_rank": round(added_bytes(method, args.width, size) / 2**20, 3),
        })  # fmt: skip
    return rows


SLUGS = {
    "fsdp adamw": "fsdp_adamw",
    "fsdp muon owner-based": "fsdp_owner",
    "fsdp muon redundant": "fsdp_redundant",
    "zero muon": "zero",
    "ddp muon": "ddp",
    "ddp muon split": "ddp_split",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="width 256, fewer rounds")
    parser.add_argument("--width", type=int, default=None)
    args, _ = parser.parse_known_args()  # nox -s bench passes every script the same flags
    args.width = args.width or (256 if args.quick else 512)
    args.rounds = 3 if args.quick else 7
    args.lm_steps = 60 if args.quick else 150
    rows = run(2, args) + run(4, args)
    losses = lm_losses(args.lm_steps)
    figures: dict[str, float] = {}
    for row in rows:
        print(f"{row['ranks']} ranks {row['method']:>22}: {row['ms']:8.1f} ms "
              f"({row['vs_fsdp_adamw']:.2f}x fsdp adamw, {row['vs_redundant']:.2f}x redundant), "
              f"busiest rank {row['matrices_busiest_rank']:.0f} matrices, "
              f"+{row['added_mb_per_rank']} MB", file=sys.stderr)  # fmt: skip
        prefix = f"r{row['ranks']}.{SLUGS[row['method']]}"
        figures |= {f"{prefix}.vs_fsdp_adamw": row["vs_fsdp_adamw"],
                    f"{prefix}.vs_redundant": row["vs_redundant"],
                    f"{prefix}.matrices_busiest_rank": row["matrices_busiest_rank"]}  # fmt: skip
    for optimizer, loss in losses.items():
        print(f"train_lm_fsdp.py --optimizer {optimizer}, {args.lm_steps} steps on 2 ranks: "
              f"final loss {loss}", file=sys.stderr)  # fmt: skip
        rows.append({"ranks": 2, "method": f"lm {optimizer}", "steps": args.lm_steps,
                     "final_loss": loss})  # fmt: skip
        figures[f"lm.{optimizer}_final_loss"] = loss
    print(json.dumps({"rows": rows}))
    results.record("bench_muon", figures)


def lm_losses(steps: int) -> dict[str, float]:
    """``examples/train_lm_fsdp.py``'s final loss with AdamW and with Muon: same data, steps."""
    root = Path(__file__).resolve().parent.parent
    losses = {}
    for optimizer in ("adamw", "muon"):
        with tempfile.TemporaryDirectory() as tmp:
            done = subprocess.run(
                [sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc_per_node=2", str(root / "examples" / "train_lm_fsdp.py"),
                 "--optimizer", optimizer, "--steps", str(steps), "--checkpoint-dir", tmp,
                 "--loss-threshold", "100"],
                capture_output=True, text=True, timeout=900, check=True,
            )  # fmt: skip
        last = [line for line in done.stdout.splitlines() + done.stderr.splitlines() if
                line.startswith("{")][-1]  # fmt: skip
        losses[optimizer] = float(json.loads(last)["final_loss"])
    return losses


if __name__ == "__main__":
    main()
