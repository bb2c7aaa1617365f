"""DDP, DiLoCo and Streaming DiLoCo over a simulated wide-area link, 2 ranks.

Each rank trains the same MLP (``--width`` 512, 8 hidden layers, 2.0M
parameters) on its own batches of a teacher network's classes, AdamW inside,
over ``benchmarks/slow_link.py``'s link (50 ms, 1 Gbit/s by default):

- no communication at all (each rank alone): the floor;
- DDP: ``fdp.all_reduce_grads`` every step;
- DiLoCo, H = 20: the whole pseudo-gradient every 20 steps, blocking;
- Streaming DiLoCo, H = 20, P = 4 fragments, tau = 1 step of overlap,
  alpha = 0.5;
each DiLoCo with float32, bfloat16 and int8 pseudo-gradients.

Each row: the mean wall time of an inner step and its ratio to no
communication, the most bytes this rank sent in one step, the bytes per
step over the run and their ratio to DDP's, and the loss on held-out
teacher data at the end against DDP's. The variants run in the same
processes, interleaved in rounds of H steps (each round's order rotated; a
round ends where no reduction is in flight); the step time is the mean over
the run (past two warm-up steps), so the steps that wait for the link count,
on the slower rank: the job's wall time per step. (Rank 0's alone would
compare a floor where each rank runs at its own pace with variants where
rank 0 also waits for rank 1 at every synchronisation; both are in the
rows, ``step_ms`` the slower rank's and ``rank_step_ms`` each rank's.)

    python benchmarks/bench_diloco.py [--quick]

The last line is one JSON object: ``{"rows": [...]}``.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import results
import torch
import torch.distributed as dist
import torch.nn.functional as F
from slow_link import SlowLink
from timing import run_ranks

import fdp

IN, CLASSES, DEPTH, H = 256, 10, 8, 20


def make_params(width: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    sizes = [IN] + [width] * DEPTH + [CLASSES]
    return [
        {"w": torch.randn(o, i, generator=g) / i**0.5, "b": torch.zeros(o)}
        for i, o in itertools.pairwise(sizes)
    ]


def mlp(params: list[dict[str, torch.Tensor]], x: torch.Tensor) -> torch.Tensor:
    for layer in params[:-1]:
        x = torch.relu(F.linear(x, layer["w"], layer["b"]))
    return F.linear(x, params[-1]["w"], params[-1]["b"])


def data(step: int, rank: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(batch, IN, generator=g)
    with torch.no_grad():
        y = mlp(TEACHER, x).argmax(1)
    return x, y


TEACHER = make_params(64, seed=1)


def loss(params: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(mlp(params, x), y)


def variants() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {"no communication": {}, "DDP": {"ddp": True}}
    for name, dtype in (("float32", None), ("bf16", torch.bfloat16), ("int8", torch.int8)):
        out[f"DiLoCo {name}"] = {"sync_dtype": dtype}
        out[f"Streaming DiLoCo {name}"] = {
            "sync_dtype": dtype,
            "fragments": 4,
            "overlap": 1,
            "alpha": 0.5,
        }
    out["Streaming DiLoCo int8, tau 2"] = {**out["Streaming DiLoCo int8"], "overlap": 2}
    return out


class Variant:
    """One way of training, its state kept between the rounds it runs in."""

    def __init__(self, name: str, opts: dict[str, Any], args: argparse.Namespace) -> None:
        self.name, self.args = name, args
        self.params: Any = make_params(args.width, seed=0)
        inner = fdp.optim.adamw(1e-3)
        self.ddp, local = opts.pop("ddp", False), not opts
        self.opt: Any = inner if self.ddp or local else fdp.DiLoCo(inner, sync_every=H, **opts)
        self.state, self.step = self.opt.init(self.params), 0
        self.times: list[float] = []
        self.sent: list[int] = []

    def run(self, steps: int, link: SlowLink) -> None:
        """``steps`` inner steps, each timed with whatever of the link it waits for."""
        rank = dist.get_rank()
        dist.barrier()
        for _ in range(steps):
            x, y = data(self.step, rank, self.args.batch)
            start, before = time.perf_counter(), link.sent
            grads = torch.func.grad(loss)(self.params, x, y)
            if self.ddp:
                grads = fdp.all_reduce_grads(grads)
            self.params, self.state = self.opt.update(grads, self.state, self.params)
            self.times.append(time.perf_counter() - start)
            self.sent.append(link.sent - before)
            self.step += 1

    def row(self) -> dict[str, Any]:
        x, y = data(-1, 0, 2048)
        with torch.no_grad():
            final = float(loss(self.params, x, y))
        times = self.times[2:]
        return {
            "name": self.name,
            "step_ms": 1e3 * statistics.mean(times),  # the slow syncs count
            "median_step_ms": 1e3 * statistics.median(times),
            "peak_bytes": max(self.sent),
            "bytes_per_step": sum(self.sent) / len(self.sent),
            "loss": final,
        }


def worker(rank: int, size: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=size, timeout=datetime.timedelta(seconds=300)
    )
    runs = [Variant(name, dict(opts), args) for name, opts in variants().items()]
    with SlowLink(latency_s=args.latency_ms / 1e3, gbit_s=args.gbit) as link:
        # Interleaved in rounds that end after a step c = 1 (mod H): no fragment's
        # reduction is in flight there (sent at c = 0, 5, 10, 15, landed by 3 steps).
        rounds = [H + 1] + [H] * ((args.steps - H - 1) // H)
        for i, steps in enumerate(rounds):
            for v in runs[i % len(runs) :] + runs[: i % len(runs)]:
                v.run(steps, link)
    rows = [v.row() for v in runs]
    everyone: list[Any] = [None] * size
    dist.all_gather_object(everyone, rows)
    for i, row in enumerate(rows):  # the job's step time: the slower rank's
        mine = [ranks_rows[i] for ranks_rows in everyone]
        row["rank_step_ms"] = [r["step_ms"] for r in mine]
        row["rank_median_step_ms"] = [r["median_step_ms"] for r in mine]
        row["step_ms"] = max(row["rank_step_ms"])
        row["median_step_ms"] = max(row["rank_median_step_ms"])
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="81 steps (under 5 minutes)")
    parser.add_argument("--steps", type=int, default=None, help="inner steps (default 201)")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=768, help="per rank")
    parser.add_argument("--latency-ms", type=float, default=50.0)
    parser.add_argument("--gbit", type=float, default=1.0, help="link bandwidth, Gbit/s")
    args = parser.parse_args()
    args.steps = args.steps or (81 if args.quick else 201)
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rows.json")
        run_ranks(worker, 2, args, out)
        rows = json.loads(Path(out).read_text())
    by = {r["name"]: r for r in rows}
    floor, ddp = by["no communication"], by["DDP"]
    print(f"{args.steps} steps, link {args.latency_ms:g} ms + {args.gbit:g} Gbit/s, 2 ranks")
    heads = ("step ms", "vs none", "peak MB", "MB/step", "vs DDP", "loss")
    print(f"{'':30}" + " ".join(f"{h:>8}" for h in heads))
    for r in rows:
        r["vs_no_comm"] = r["step_ms"] / floor["step_ms"]
        r["bytes_vs_ddp"] = r["bytes_per_step"] / ddp["bytes_per_step"]
        print(
            f"{r['name']:29} {r['step_ms']:8.1f} {r['vs_no_comm']:7.2f}x "
            f"{r['peak_bytes'] / 1e6:8.2f} {r['bytes_per_step'] / 1e6:8.3f} "
            f"{r['bytes_vs_ddp']:6.3f}x {r['loss']:7.4f}"
        )
    figures = {}
    for r in rows:
        key = results.slug(r["name"])
        figures[f"{key}.vs_no_comm"] = r["vs_no_comm"]
        figures[f"{key}.bytes_vs_ddp"] = r["bytes_vs_ddp"]
        figures[f"{key}.loss"] = r["loss"]
    stream, whole = by["Streaming DiLoCo float32"], by["DiLoCo float32"]
    figures["streaming_peak_vs_diloco"] = stream["peak_bytes"] / whole["peak_bytes"]
    figures["int8_bytes_vs_float32"] = (
        by["Streaming DiLoCo int8"]["bytes_per_step"] / stream["bytes_per_step"]
    )
    results.record("bench_diloco", figures)
    print(json.dumps({"rows": rows, **figures}))


if __name__ == "__main__":
    main()
