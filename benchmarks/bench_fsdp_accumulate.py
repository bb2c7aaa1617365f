"""Gradient accumulation with FullyShardedDataParallel: 4 micro-batches, synced or no_sync.

On 2 gloo ranks (1 intra-op thread each), the MLP of ``bench_ddp_step.py``
(8 layers 1024 wide, one unit per layer) takes 4 micro-batches of 16 rows
per rank with ``loss.backward()`` per micro-batch; interleaved round by round
(median):

- synced: every backward reduce-scatters every unit (4 per unit per step);
- no_sync: the first 3 inside ``fsdp.no_sync()``, one reduce-scatter per
  unit at the last.

Printed: the reduce-scattered bytes per step (counted at fdp's collective)
and the step time, with their ratios. Both give the same gradients
(tests/test_fsdp_accumulate.py).

    python benchmarks/bench_fsdp_accumulate.py [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
from typing import Any

import results
import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_ddp_step import BATCH, data, make_params, mlp
from timing import interleaved, run_ranks

import fdp
from fdp._comm import _raw

MICRO = 4


def steps(rank: int) -> dict[str, Any]:
    params = make_params(0)
    fsdp = fdp.FullyShardedDataParallel({str(i): p for i, p in enumerate(params)})
    shards = fsdp.shard({str(i): p for i, p in enumerate(params)})
    x, y = data(rank)
    rows = BATCH // MICRO

    def step(accumulate: bool) -> None:
        for ts in shards.values():
            for t in ts:
                t.grad = None
        for m in range(MICRO):
            held = accumulate and m < MICRO - 1
            with fsdp.no_sync() if held else contextlib.nullcontext():
                tree = fsdp(shards)
                layers = [tree[str(i)] for i in range(len(params))]
                part = slice(m * rows, (m + 1) * rows)
                torch.autograd.backward(F.cross_entropy(mlp(layers, x[part]), y[part]) / MICRO)

    return {"synced": lambda: step(False), "no_sync": lambda: step(True)}


def run(rank: int, size: int, port: int, quick: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
        timeout=datetime.timedelta(seconds=300),
    )  # fmt: skip
    counted: list[int] = []
    real = _raw.reduce_scatter

    def counting(t: torch.Tensor, **kw: Any) -> torch.Tensor:
        counted.append(t.numel() * t.element_size())
        return real(t, **kw)

    _raw.reduce_scatter = counting
    fns = steps(rank)
    sent = {}
    for name, fn in fns.items():
        counted.clear()
        fn()
        sent[name] = sum(counted)
    times = interleaved(fns, rounds=3 if quick else 8, repeats=2, sync=dist.barrier)
    if rank == 0:
        print(f"FSDP, {MICRO} micro-batches of {BATCH // MICRO} rows per rank, {size} gloo ranks")
        base_t, base_b = times["synced"], sent["synced"]
        for name in fns:
            print(
                f"  {name:8} reduce-scattered {sent[name] / 2**20:7.1f} MiB per step "
                f"({sent[name] / base_b:.2f}x), step {1e3 * times[name]:7.1f} ms "
                f"({times[name] / base_t:.2f}x)"
            )
        figures = {f"{n}.bytes_vs_synced": sent[n] / base_b for n in fns}
        figures |= {f"{n}.step_vs_synced": times[n] / base_t for n in fns}
        figures |= {f"{n}.reduce_scattered_mib": sent[n] / 2**20 for n in fns}
        figures |= {f"{n}.step_ms": 1e3 * times[n] for n in fns}
        results.record("bench_fsdp_accumulate", figures)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    args, _ = parser.parse_known_args()
    run_ranks(run, 2, args.quick)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
