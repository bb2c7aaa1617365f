"""How long dynamo takes to trace a loss through ``ddp(params)``, by leaf count.

A compiled step's first call traces the Python of the step: dynamo reads
``ddp(params)``'s code and the reduction's backward for every leaf. This
times that alone (``backend="eager"``: no AOTAutograd, no inductor), one
process, a gloo group of one, a stack of ``Linear(16, 16)`` layers with
50, 200 and 400 leaves (``--quick``: 50 and 200):

- the module alone: ``torch.compile(model)``;
- fdp DDP: the loss ``fn(ddp(state), x)`` compiled (``make_functional``).

Each is traced twice, alternating, after ``torch._dynamo.reset()``; the
figure is the faster of the two, and the ratio fdp's against the module
alone's. Not torch DDP: ``torch.compile(DistributedDataParallel(model))``
here traces in 0.12-0.15 s at any leaf count, less than the module alone,
because dynamo does not trace the model inside it on this torch (the
"graphs per step" row of docs/performance.md).

    python benchmarks/bench_trace_time.py [--quick]

The last line is one JSON object: ``{"rows": [...]}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import results
import torch
import torch.distributed as dist

import fdp

WIDTH = 16


def build(leaves: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH) for _ in range(leaves // 2)))


def makers(leaves: int) -> dict[str, Callable[[], Callable[[], Any]]]:
    x = torch.randn(4, WIDTH)

    def module() -> Callable[[], Any]:
        run = torch.compile(build(leaves), backend="eager")
        return lambda: run(x).sum()

    def fdp_ddp() -> Callable[[], Any]:
        fn, state = fdp.make_functional(build(leaves))
        ddp = fdp.DistributedDataParallel(state)
        run = torch.compile(lambda s: fn(ddp(s), x).sum(), backend="eager")
        return lambda: run(state)

    return {"module alone": module, "fdp DDP": fdp_ddp}


def first_call(make: Callable[[], Callable[[], Any]]) -> float:
    torch._dynamo.reset()
    call = make()
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def measure(leaves: int, rounds: int = 2) -> dict[str, Any]:
    got: dict[str, list[float]] = {}
    for r in range(rounds):
        order = list(makers(leaves).items())
        for name, make in order if r % 2 == 0 else reversed(order):
            got.setdefault(name, []).append(first_call(make))
    best = {name: min(ts) for name, ts in got.items()}
    return {
        "leaves": leaves,
        **{f"{name}_s": round(t, 2) for name, t in best.items()},
        "fdp_vs_module": round(best["fdp DDP"] / best["module alone"], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="50 and 200 leaves")
    args, _ = parser.parse_known_args()  # nox -s bench passes every script the same flags
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        rows = [measure(n) for n in ((50, 200) if args.quick else (50, 200, 400))]
    finally:
        dist.destroy_process_group()
    for row in rows:
        print(f"{row['leaves']:4d} leaves: module {row['module alone_s']:6.2f} s, "
              f"fdp DDP {row['fdp DDP_s']:6.2f} s ({row['fdp_vs_module']:.1f}x)",
              file=sys.stderr)  # fmt: skip
    print(json.dumps({"rows": rows}))
    figures = {
        f"l{row['leaves']}.{key.replace(' ', '_')}": row[key]
        for row in rows
        for key in ("module alone_s", "fdp DDP_s", "fdp_vs_module")
    }
    results.record("bench_trace_time", figures)


if __name__ == "__main__":
    main()
