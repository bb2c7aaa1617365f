"""Draws docs/figures/ddp_timeline.png: one DDP step's backward and its bucket all-reduces.

    python benchmarks/figures.py      # also: nox -s figures

Two gloo ranks on 127.0.0.1 (1 intra-op thread each) take a warm-up step
and then one measured step of an 8-layer 512-wide tanh MLP with
``fdp.DistributedDataParallel(bucket_cap_mb=2)``. Rank 0 records, on one
clock: when backward starts and ends, when each parameter's gradient is
produced (a hook on the tensor ``ddp(params)`` returns), and when each
bucket's all-reduce is launched and done (a comm hook around
``fdp.allreduce_hook``). The figure shows the overlap DDP is for: the
buckets of the last layers are reduced while backward still computes the
first layers' gradients.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fdp

OUT = Path(__file__).resolve().parent.parent / "docs" / "figures" / "ddp_timeline.png"
WIDTH, DEPTH, BATCH = 512, 8, 64


def _params() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    layers = [
        {"w": (torch.randn(WIDTH, WIDTH, generator=g) / WIDTH**0.5).requires_grad_(),
         "b": torch.zeros(WIDTH, requires_grad=True)}
        for _ in range(DEPTH)
    ]  # fmt: skip
    return {"layers": layers, "head": torch.randn(WIDTH, 10, generator=g).requires_grad_()}


def _step(rank: int, events: list[tuple[str, float, float]]) -> None:
    """One DDP step, recording (what, start, end) on rank 0's clock (seconds)."""
    params = _params()
    launched: dict[int, float] = {}

    def timed_hook(state: Any, bucket: fdp.GradBucket) -> torch.futures.Future[torch.Tensor]:
        k, start = bucket.index(), time.perf_counter()
        launched[k] = start
        fut = fdp.allreduce_hook(state, bucket)

        def done(f: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            events.append((f"all-reduce, bucket {k}", start, time.perf_counter()))
            return f.value()

        return fut.then(done)

    ddp = fdp.DistributedDataParallel(params, bucket_cap_mb=2, comm_hook=timed_hook)
    g = torch.Generator().manual_seed(1 + rank)
    x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randint(0, 10, (BATCH,), generator=g)
    for measured in (False, True):
        events.clear()
        synced = ddp(params)
        for j, layer in enumerate(synced["layers"]):
            layer["w"].register_hook(_ready(events, f"gradient, layer {j}"))
        h = x
        for layer in synced["layers"]:
            h = torch.tanh(h @ layer["w"] + layer["b"])
        loss = F.cross_entropy(h @ synced["head"], y)
        dist.barrier()
        start = time.perf_counter()
        torch.autograd.backward(loss)
        events.append(("backward (with the reduction's end)", start, time.perf_counter()))
        for t in [*(v for layer in params["layers"] for v in layer.values()), params["head"]]:
            t.grad = None
        if measured:
            base = start
            events[:] = [(what, a - base, b - base) for what, a, b in events]


def _ready(events: list[tuple[str, float, float]], what: str) -> Any:
    def hook(grad: torch.Tensor) -> None:
        now = time.perf_counter()
        events.append((what, now, now))

    return hook


def _rank(rank: int, port: int, out: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        events: list[tuple[str, float, float]] = []
        _step(rank, events)
        if rank == 0:
            out.put(events)
    finally:
        dist.destroy_process_group()


def draw(events: list[tuple[str, float, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted({what for what, _, _ in events}, key=_order)
    fig: Any
    fig, ax = plt.subplots(figsize=(7.5, 0.32 * len(rows) + 1.2))
    for y, row in enumerate(rows):
        for what, a, b in events:
            if what != row:
                continue
            if b > a:
                color = "tab:orange" if row.startswith("all-reduce") else "tab:gray"
                ax.barh(y, (b - a) * 1e3, left=a * 1e3, height=0.6, color=color)
            else:
                ax.plot([a * 1e3], [y], marker="|", markersize=12, color="tab:blue")
    ax.set_yticks(range(len(rows)), rows, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms since backward started (rank 0)")
    ax.set_title("fdp.DistributedDataParallel: buckets reduced while backward runs", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _order(row: str) -> tuple[int, int]:
    if row.startswith("backward"):
        return (0, 0)
    number = int(row.rsplit(" ", 1)[1])
    return (1, -number) if row.startswith("gradient") else (2, number)


def main() -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = int(os.environ.get("FIGURES_PORT", "0")) or _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    events = out.get(timeout=120)
    for p in procs:
        p.join(timeout=60)
    draw(events, OUT)
    print(f"wrote {OUT.relative_to(Path.cwd()) if OUT.is_relative_to(Path.cwd()) else OUT}")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":
    main()
