"""Per-rank memory of DDP + AdamW vs ZeRO-1 vs ZeRO-2, measured at 2 and 4 gloo ranks.

One AdamW step of the MLP of ``bench_distributed.py`` (8.4 M float32
parameters), then, on rank 0, the bytes of the distinct storages each part
holds (summed tensor sizes, views counted once):

- params: the parameter tree after the step;
- local grads: ``torch.func.grad``'s result, the step's input;
- reduction buffers: what fdp allocated to reduce the gradients (the
  packed buckets, kept for reuse; ZeRO-2 on NCCL also each rank's reduced
  slice), measured after the step from the buffers fdp holds;
- optimizer state: AdamW's moments and steps.

ZeRO-2 runs twice: with the collectives fdp uses on gloo (the packed buffer
all-reduced in place) and with those it uses on NCCL (reduce-scatter into a
slice), the latter on gloo too, by patching the backend test.

    python benchmarks/zero_memory.py     # prints a markdown table
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import socket
import unittest.mock
from typing import Any

import optree
import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_ddp_step import data, make_params, mlp

import fdp
from fdp._sharding import _zero_comm

MB = 2**20


def storage_bytes(tree: Any) -> int:
    seen: dict[int, int] = {}
    for t in optree.tree_leaves(tree, none_is_leaf=False):
        if isinstance(t, torch.Tensor):
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def measure(rank: int) -> dict[str, dict[str, int]]:
    x, y = data(rank)
    grad = torch.func.grad(lambda p: F.cross_entropy(mlp(p, x), y))
    params = optree.tree_map(torch.Tensor.detach, make_params(0))  # type: ignore[arg-type]
    grads = grad(params)
    out: dict[str, dict[str, int]] = {}
    opt = fdp.optim.adamw(1e-3)
    reduced = fdp.all_reduce_grads(grads)
    new, state = opt.update(reduced, opt.init(params), params)
    out["DDP + AdamW"] = row(new, grads, storage_bytes(reduced), state)
    for name, stage, nccl in (
        ("ZeRO-1", 1, False),
        ("ZeRO-2 (gloo collectives)", 2, False),
        ("ZeRO-2 (NCCL collectives)", 2, True),
    ):
        with unittest.mock.patch.object(_zero_comm, "is_gloo", return_value=not nccl):
            zero = fdp.ZeroRedundancy(fdp.optim.adamw(1e-3), params, stage=stage)
            new, zstate = zero.step(grads, zero.init(params), params)
        kept = zero._pool._kept
        buffers = [b for key, bs in kept.items() if key[0] != "params" for b in bs]
        out[name] = row(new, grads, storage_bytes(buffers), zstate.slots)
    return out


def row(params: Any, grads: Any, buffers: int, state: Any) -> dict[str, int]:
    return {
        "params": storage_bytes(params),
        "local grads": storage_bytes(grads),
        "reduction buffers": buffers,
        "optimizer state": storage_bytes(state),
    }


def run(rank: int, size: int, port: int, results: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
        timeout=datetime.timedelta(seconds=300),
    )  # fmt: skip
    measured = measure(rank)
    if rank == 0:
        results.put(measured)
    dist.destroy_process_group()


def main() -> None:
    ctx = mp.get_context("spawn")
    tables = {}
    for size in (2, 4):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        results = ctx.Queue()
        procs = [ctx.Process(target=run, args=(r, size, port, results)) for r in range(size)]
        for p in procs:
            p.start()
        tables[size] = results.get(timeout=600)
        for p in procs:
            p.join(60)
    names = list(tables[2])
    print("| world | part | " + " | ".join(names) + " |")
    print("| --- | --- | " + " | ".join("---:" for _ in names) + " |")
    for size, table in tables.items():
        for part in table[names[0]]:
            cells = " | ".join(f"{table[n][part] / MB:.1f}" for n in names)
            print(f"| {size} | {part} (MiB) | {cells} |")
        totals = " | ".join(f"{sum(table[n].values()) / MB:.1f}" for n in names)
        print(f"| {size} | **total** | {totals} |")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
