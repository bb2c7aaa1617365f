"""The first compiled step: torch's compiled DDP against fdp DDP, fdp's pure loop and fdp FSDP.

GPT-2 and Llama from configs (``bench_models_step.py``'s models), 2 gloo
ranks, one forward + backward + AdamW step, the first of a fresh pair of
processes, which is the compile. Each method runs twice, each time in new
processes:

- cold: inductor's on-disk cache (``TORCHINDUCTOR_CACHE_DIR``) an empty
  directory of its own, what a new model or a new torch costs;
- warm: the same directory again, what a restarted job costs.

The methods, each as ``bench_models_step.py`` compiles it (its functions):

- torch DDP: ``torch.compile(DistributedDataParallel(model))``, torch AdamW;
- fdp DDP: the loss ``fn(ddp(state))`` compiled, torch AdamW;
- fdp pure: ``fdp.grad`` of the compiled loss, ``fdp.optim.adamw``'s update
  compiled (``fullgraph=True``);
- fdp FSDP: ``fsdp.wrap(fn)``'s loss compiled (``fullgraph=True``), every
  unit's gather in the graph, ``fdp.optim.adamw`` eagerly.

    python benchmarks/bench_compile_time.py [--quick] [--models gpt2,llama]

``--quick``: GPT-2 only. The last line is one JSON object: ``{"rows": [...]}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import results
import torch
import torch.distributed as dist
from bench_models_step import batch, build, fdp_ddp_torch_optim, fdp_pure, join_group, torch_ddp
from timing import run_ranks

import fdp

SIZE = 2
SLUGS = {"torch DDP": "torch_ddp", "fdp DDP": "fdp_ddp", "fdp pure": "fdp_pure",
         "fdp FSDP": "fdp_fsdp"}  # fmt: skip


def fdp_fsdp(name: str, ids: torch.Tensor) -> Callable[[], None]:
    fn, state = fdp.make_functional(build(name))
    fsdp = fdp.FullyShardedDataParallel(state)
    shards = fsdp.shard(state)
    run = fsdp.wrap(fn)
    opt = fdp.optim.adamw(1e-4)
    box = [shards, opt.init(shards)]

    def loss(s: Any) -> torch.Tensor:
        out: torch.Tensor = run(s, input_ids=ids, labels=ids).loss
        return out

    compiled = torch.compile(loss, fullgraph=True)

    def step() -> None:
        s = {k: tuple(t.detach().requires_grad_() for t in ts) for k, ts in box[0].items()}
        torch.autograd.backward(compiled(s))
        grads = {k: tuple(t.grad for t in ts) for k, ts in s.items()}
        box[0], box[1] = opt.update(grads, box[1], box[0])

    return step


MAKERS: dict[str, Callable[[str, torch.Tensor], Callable[[], None]]] = {
    "torch DDP": lambda name, ids: torch_ddp(name, ids, compiled=True),
    "fdp DDP": lambda name, ids: fdp_ddp_torch_optim(name, ids, compiled=True),
    "fdp pure": lambda name, ids: fdp_pure(name, ids, grad=fdp.grad, compiled=True),
    "fdp FSDP": fdp_fsdp,
}


def first_step(rank: int, size: int, port: int, name: str, method: str, out: str) -> None:
    """Rank ``rank``'s first step of ``method``: the slower rank's seconds go to ``out``."""
    join_group(rank, size, port)
    try:
        step = MAKERS[method](name, batch(rank))
        dist.barrier()
        start = time.perf_counter()
        step()
        seconds = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        if rank == 0:
            Path(out).write_text(json.dumps(seconds.item()))
    finally:
        dist.destroy_process_group()


def timed(name: str, method: str, cache: str) -> float:
    """Seconds of the first step in new processes whose inductor cache is ``cache``."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # the spawned ranks inherit it
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "seconds.json")
        run_ranks(first_step, SIZE, name, method, out, timeout_s=1200)
        seconds: float = json.loads(Path(out).read_text())
    return seconds


def measure(name: str, root: str) -> list[dict[str, Any]]:
    got: dict[str, dict[str, float]] = {}
    for method in MAKERS:
        cache = os.path.join(root, f"{name}-{SLUGS[method]}")
        got[method] = {"cold_s": timed(name, method, cache), "warm_s": timed(name, method, cache)}
    base = got["torch DDP"]
    rows = []
    for method, t in got.items():
        row: dict[str, Any] = {"model": name, "ranks": SIZE, "method": method}
        row |= {k: round(v, 2) for k, v in t.items()}
        row["cold_vs_torch"] = round(t["cold_s"] / base["cold_s"], 3)
        row["warm_vs_torch"] = round(t["warm_s"] / base["warm_s"], 3)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="GPT-2 only")
    parser.add_argument("--models", default="gpt2,llama", type=lambda s: s.split(","))
    args, _ = parser.parse_known_args()  # nox -s bench passes every script the same flags
    models = ["gpt2"] if args.quick else args.models
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as root:
        for name in models:
            rows += measure(name, root)
    for row in rows:
        print(f"{row['model']} {row['method']:>10}: cold {row['cold_s']:6.2f} s "
              f"({row['cold_vs_torch']:.2f}x), warm {row['warm_s']:6.2f} s "
              f"({row['warm_vs_torch']:.2f}x)", file=sys.stderr)  # fmt: skip
    print(json.dumps({"rows": rows}))
    figures = {
        f"{row['model']}.{SLUGS[row['method']]}.{key}": row[key]
        for row in rows
        for key in ("cold_s", "warm_s", "cold_vs_torch", "warm_vs_torch")
    }
    results.record("bench_compile_time", figures)


if __name__ == "__main__":
    main()
