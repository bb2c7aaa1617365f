"""Draws the docs' timelines: a DDP step's bucket all-reduces, an FSDP step's units.

    python benchmarks/figures.py      # also: nox -s figures

docs/figures/ddp_timeline.png:
Two gloo ranks on 127.0.0.1 (1 intra-op thread each) take a warm-up step
and then one measured step of an 8-layer 512-wide tanh MLP with
``fdp.DistributedDataParallel(bucket_cap_mb=2)``. Rank 0 records, on one
clock: when backward starts and ends, when each parameter's gradient is
produced (a hook on the tensor ``ddp(params)`` returns), and when each
bucket's all-reduce is launched and done (a comm hook around
``fdp.allreduce_hook``). The figure shows the overlap DDP is for: the
buckets of the last layers are reduced while backward still computes the
first layers' gradients.

docs/figures/fsdp_lifecycle.png: one fully sharded step of a 4-unit MLP
(``fsdp.apply`` per unit, ``reshard_after_forward``, prefetch) on the same
two ranks, from torch's profiler on rank 0: each unit's forward, the
backward, and gloo's all-gathers and reduce-scatters (gloo runs the latter
as all-reduces): each unit's all-gather starts while the unit before it
computes (prefetch), and backward gathers each unit again and
reduce-scatters its gradient.
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

FIGURES = Path(__file__).resolve().parent.parent / "docs" / "figures"
OUT = FIGURES / "ddp_timeline.png"
UNITS = 4
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


def _fsdp_step(rank: int) -> list[tuple[str, float, float]]:
    """One fully sharded step under torch's profiler: (what, start, end) in ms, rank 0."""
    g = torch.Generator().manual_seed(0)
    params = {f"unit{i}": {"w": (torch.randn(WIDTH, WIDTH, generator=g) / WIDTH**0.5)
                           .requires_grad_()} for i in range(UNITS)}  # fmt: skip
    fsdp = fdp.FullyShardedDataParallel(params)
    shards = fsdp.shard(params)
    x = torch.randn(8 * BATCH, WIDTH, generator=torch.Generator().manual_seed(1 + rank))

    def step() -> None:
        h = x
        for i in range(UNITS):

            def layer(u: Any, h: torch.Tensor, i: int = i) -> torch.Tensor:
                with torch.profiler.record_function(f"unit{i} forward"):
                    out: torch.Tensor = torch.tanh(h @ u["w"])
                return out

            h = fsdp.apply(shards, f"unit{i}", layer, h)
        with torch.profiler.record_function("backward"):
            torch.autograd.backward(h.square().mean())
        for ts in shards.values():
            for t in ts:
                t.grad = None

    step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        dist.barrier()  # both ranks profiling: no wait for the other's start in the figure
        with torch.profiler.record_function("step"):
            step()
    return _fsdp_events(prof.events())


def _fsdp_events(raw: Any) -> list[tuple[str, float, float]]:
    """Rows from the profiler's events: each unit's forward, backward, and gloo's collectives."""
    begun = next(e.time_range.start for e in raw if e.name == "step")  # microseconds
    names = {"gloo:all_gather": "all-gathers", "gloo:all_reduce": "reduce-scatters (gloo)"}
    events: list[tuple[str, float, float]] = []
    for e in raw:
        if e.time_range.start < begun:
            continue
        row = names.get(e.name, e.name if e.name.endswith(" forward") else None)
        if e.name == "backward":
            row = "backward"
        if row is not None:
            a, b = (e.time_range.start - begun) / 1e6, (e.time_range.end - begun) / 1e6
            events.append((row, a, b))
    return events


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
        dist.barrier()
        lifecycle = _fsdp_step(rank)
        if rank == 0:
            out.put((events, lifecycle))
    finally:
        dist.destroy_process_group()


def draw(
    events: list[tuple[str, float, float]],
    path: Path,
    *,
    title: str = "fdp.DistributedDataParallel: buckets reduced while backward runs",
    order: Any = None,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted({what for what, _, _ in events}, key=order or _order)
    fig: Any
    fig, ax = plt.subplots(figsize=(7.5, 0.32 * len(rows) + 1.2))
    for y, row in enumerate(rows):
        for what, a, b in events:
            if what != row:
                continue
            if b > a:
                comm = ("all-reduce", "all-gather", "reduce-scatter")
                color = "tab:orange" if any(c in row for c in comm) else "tab:gray"
                ax.barh(y, (b - a) * 1e3, left=a * 1e3, height=0.6, color=color)
            else:
                ax.plot([a * 1e3], [y], marker="|", markersize=12, color="tab:blue")
    ax.set_yticks(range(len(rows)), rows, fontsize=8)
    ax.invert_yaxis()
    since = "backward started" if order is None else "the step started"
    ax.set_xlabel(f"ms since {since} (rank 0)")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _unit_order(row: str) -> tuple[int, int]:
    if row.startswith("unit"):
        return (0, int(row[4:].split()[0]))
    return (1, ["backward", "all-gathers", "reduce-scatters (gloo)"].index(row))


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
    events, lifecycle = out.get(timeout=180)
    for p in procs:
        p.join(timeout=60)
    draw(events, OUT)
    title = "fdp.FullyShardedDataParallel: units gathered ahead of use, again in backward"
    draw(lifecycle, FIGURES / "fsdp_lifecycle.png", title=title, order=_unit_order)
    print(f"wrote {OUT} and {FIGURES / 'fsdp_lifecycle.png'}")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":
    main()
