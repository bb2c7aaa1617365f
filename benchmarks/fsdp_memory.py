"""Per-rank peak memory of one AdamW step: DDP, ZeRO-2 and fully sharded, at 2 and 4 gloo ranks.

The MLP of ``bench_distributed.py`` (8 hidden 1024-wide layers and a head:
9 units, 8.4 M float32 parameters, 33.6 MB), batch 64 per rank. Measured,
not computed: glibc's ``mallinfo2`` (the bytes the allocator has handed
out, which is where CPU tensors live) is read after every op of the step
(a ``TorchDispatchMode``) and at its ends; each figure is the peak minus
the bytes in use before the method's tensors existed, on rank 0:

- held between steps: parameters (or shards) and optimizer state;
- peak during the step: everything, activations included (the same batch
  and model for every method, so differences are parameters, gradients,
  state and buffers);
- a local step (no parallelism) gives the activations' share: its peak
  minus its parameters, gradients and state.

Every optimizer step writes in place (``donate=True``), as torch's do, so
no method's peak holds a second copy of the parameters and state.

The goal (issue 23): fully sharded parameters + gradients + state per rank
<= (parameters + gradients + state) / world + two units. Fully sharded
runs with prefetching (the default: the next unit's all-gather overlaps
this one's compute, one more unit in flight) and without. Step times, as a
multiple of DDP's, are measured in the same run (median of interleaved
rounds). torch's own ``fully_shard`` runs the same model as modules where
it can (said otherwise).

    python benchmarks/fsdp_memory.py [--quick]
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import multiprocessing as mp
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import optree
import results
import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_ddp_step import data, make_params, mlp
from timing import interleaved
from torch.utils._python_dispatch import TorchDispatchMode

import fdp

MB = 2**20


class _Mallinfo(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd",
            "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


_LIBC = ctypes.CDLL("libc.so.6")
_LIBC.mallinfo2.restype = _Mallinfo


def in_use() -> int:
    info = _LIBC.mallinfo2()
    return int(info.uordblks + info.hblkhd)


class Peak(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """The allocator's peak in-use bytes, sampled after every op."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.peak = in_use()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, in_use())
        return out


def peak_of(step: Callable[[], None]) -> int:
    """Peak in-use bytes of ``step`` (dispatch-sampled, and at collectives' ends)."""
    gc.collect()
    with Peak() as mode:
        step()
    return max(int(mode.peak), in_use())


def sampled_rise_of(step: Callable[[], None]) -> int:
    """How far the in-use bytes rise during ``step`` over its start, read by a thread
    polling the allocator.

    For compiled steps, which no dispatch mode can watch: the thread reads
    whenever it holds the GIL (ops release it, the switch interval is cut to
    10 us), so it sees a little more than the dispatch reading (collectives'
    and kernels' own buffers) and both eager and compiled steps alike. Over
    the step's start, not over a base taken before the model: compiling
    allocates (graphs, generated code) from the same heap.
    """
    gc.collect()
    start = in_use()
    peak, running = [start], [True]

    def poll() -> None:
        while running[0]:
            peak[0] = max(peak[0], in_use())
            time.sleep(0)

    thread, interval = threading.Thread(target=poll), sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    thread.start()
    try:
        step()
    finally:
        running[0] = False
        thread.join()
        sys.setswitchinterval(interval)
    return max(peak[0], in_use()) - start


def held(*trees: Any) -> int:
    seen: dict[int, int] = {}
    leaves: list[Any] = optree.tree_leaves(trees, none_is_leaf=False)  # type: ignore[arg-type]
    for t in leaves:
        if isinstance(t, torch.Tensor):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def params_of(seed: int = 0) -> Any:
    return optree.tree_map(torch.Tensor.detach, make_params(seed))  # type: ignore[arg-type]


def measure(rank: int, size: int, rounds: int) -> dict[str, Any]:
    x, y = data(rank)
    opt = fdp.optim.adamw(1e-3)
    out: dict[str, Any] = {}
    steps: dict[str, Callable[[], None]] = {}

    base = in_use()
    box: list[Any] = [params_of(), None]
    box[1] = opt.init(box[0])
    local = lambda p: F.cross_entropy(mlp(p, x), y)  # noqa: E731

    def local_step() -> None:
        box[0], box[1] = opt.update(torch.func.grad(local)(box[0]), box[1], box[0], donate=True)

    local_step()  # the state exists from here on, as in training
    before = held(box)
    out["local (no parallelism)"] = (before, peak_of(local_step) - base)
    box.clear()
    gc.collect()

    base = in_use()
    ddp_box: list[Any] = [params_of(), None]
    ddp_box[1] = opt.init(ddp_box[0])
    ddp = fdp.DistributedDataParallel(ddp_box[0])

    def ddp_step() -> None:
        grads = torch.func.grad(lambda p: F.cross_entropy(mlp(ddp(p), x), y))(ddp_box[0])
        ddp_box[0], ddp_box[1] = opt.update(grads, ddp_box[1], ddp_box[0], donate=True)

    ddp_step()
    out["fdp DDP"] = (held(ddp_box), peak_of(ddp_step) - base)
    steps["fdp DDP"] = ddp_step

    base = in_use()
    zparams = params_of()
    zero = fdp.ZeroRedundancy(opt, zparams)
    zbox: list[Any] = [zparams, zero.init(zparams)]
    del zparams

    def zero_step() -> None:
        grads = torch.func.grad(local)(zbox[0])
        zbox[0], zbox[1] = zero.step(grads, zbox[1], zbox[0], donate=True)

    zero_step()
    out["fdp ZeRO-2"] = (held(zbox[0], zbox[1].slots), peak_of(zero_step) - base)

    for name, prefetch in (("fdp fully sharded", True), ("fdp fully sharded, no prefetch", False)):
        held_bytes, peak, step = fully_sharded(x, y, opt, prefetch=prefetch)
        out[name] = (held_bytes, peak)
        steps[name] = step
    out["units"] = len(make_params(0))
    fs = torch_fully_shard(x, y)
    out["torch fully_shard"] = fs if isinstance(fs, str) else fs[:2]
    if not isinstance(fs, str):
        steps["torch fully_shard"] = fs[2]
    out["sampled"] = sampled_rows(x, y, opt, steps)
    out["time"] = interleaved(steps, rounds=rounds, repeats=2)
    return out


def sampled_rows(
    x: torch.Tensor, y: torch.Tensor, opt: Any, steps: dict[str, Callable[[], None]]
) -> dict[str, Any]:
    """Eager against compiled, every peak read by the sampling thread (issue 39)."""
    rows: dict[str, Any] = {}
    for name, compiled in (("fdp fully sharded", False), ("fdp fully sharded, compiled", True)):
        held_bytes, peak, step = fully_sharded(
            x, y, opt, prefetch=True, sampled=True, compiled=compiled
        )
        rows[name] = (held_bytes, peak)
        if compiled:
            steps[name] = step
    for name, compiled in (("torch fully_shard", False), ("torch fully_shard, compiled", True)):
        fs = torch_fully_shard(x, y, sampled=True, compiled=compiled)
        rows[name] = fs if isinstance(fs, str) else fs[:2]
        if compiled and not isinstance(fs, str):
            steps[name] = fs[2]
    return rows


def fully_sharded(
    x: torch.Tensor,
    y: torch.Tensor,
    opt: Any,
    *,
    prefetch: bool,
    compiled: bool = False,
    sampled: bool = False,
) -> tuple[int, int, Callable[[], None]]:
    """fdp's fully sharded step, each unit through apply: (held, peak, step).

    ``compiled``: the loss (every unit's gather, forward and the loss) in one
    ``fullgraph=True`` inductor graph. ``sampled``: the peak read by the
    sampling thread (always, compiled).
    """
    gc.collect()
    base = in_use()
    full = params_of()
    fsdp = fdp.FullyShardedDataParallel(full, prefetch=prefetch)
    shards = {k: tuple(t.requires_grad_() for t in ts) for k, ts in fsdp.shard(full).items()}
    del full  # a rank keeps its shards only
    gc.collect()
    fbox: list[Any] = [shards, opt.init(shards)]

    def layer(unit: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(F.linear(h, unit["w"], unit["b"]))

    def head(unit: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(F.linear(h, unit["w"], unit["b"]), y)

    # Each unit through apply: gathered for its function, freed until backward.
    def loss_of(s: Any) -> torch.Tensor:
        h = x
        for i in range(len(fsdp.units) - 1):
            h = fsdp.apply(s, str(i), layer, h)
        out: torch.Tensor = fsdp.apply(s, str(len(fsdp.units) - 1), head, h)
        return out

    loss_fn = torch.compile(loss_of, fullgraph=True) if compiled else loss_of

    def step() -> None:
        s = fbox[0]
        torch.autograd.backward(loss_fn(s))
        grads = {k: tuple(t.grad for t in ts) for k, ts in s.items()}
        plain = {k: tuple(t.detach() for t in ts) for k, ts in s.items()}
        opt.update(grads, fbox[1], plain, donate=True)  # in place: the shards themselves
        for ts in s.values():
            for t in ts:
                t.grad = None

    step()
    step()  # compiled: the backward graph too
    if compiled or sampled:  # what the step holds, plus how far it rises
        return held(fbox), held(fbox) + sampled_rise_of(step), step
    return held(fbox), peak_of(step) - base, step


def torch_fully_shard(
    x: torch.Tensor, y: torch.Tensor, *, compiled: bool = False, sampled: bool = False
) -> Any:
    """torch's FSDP2 on the same model as modules: (held, peak, step), or why it does not run.

    ``compiled``: the model under ``torch.compile`` (graph breaks allowed:
    torch's own hooks decide what it traces); the peak is then the sampled one.
    """
    try:
        from torch.distributed.fsdp import fully_shard

        gc.collect()
        base = in_use()  # before the modules: their full parameters are freed by sharding
        layers = [torch.nn.Linear(p["w"].shape[1], p["w"].shape[0]) for p in make_params(0)]
        body = [m for lin in layers[:-1] for m in (lin, torch.nn.Tanh())]
        model = torch.nn.Sequential(*body, layers[-1])
        for lin in layers:
            fully_shard(lin)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        forward = torch.compile(model) if compiled else model

        def step() -> None:
            torch.autograd.backward(F.cross_entropy(forward(x), y))
            opt.step()
            opt.zero_grad()

        step()
        step()
        gc.collect()
        if compiled or sampled:
            local = [getattr(p, "_local_tensor", p) for p in model.parameters()]
            state = [t for s in opt.state.values() for t in s.values()]
            state = [getattr(t, "_local_tensor", t) for t in state]
            kept = held(local, state)
            return (kept, kept + sampled_rise_of(step), step)
        return (in_use() - base, peak_of(step) - base, step)
    except Exception as e:
        return f"refused: {type(e).__name__}: {str(e).splitlines()[0][:120]}"


def run(rank: int, size: int, port: int, rounds: int, queue: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
        timeout=datetime.timedelta(seconds=600),
    )  # fmt: skip
    measured = measure(rank, size, rounds)
    if rank == 0:
        queue.put(measured)
    dist.destroy_process_group()


def report(size: int, m: dict[str, Any]) -> None:
    params_bytes = held(params_of())
    unit = params_bytes / m["units"]
    goal = (params_bytes * 4) / size + 2 * unit * 2  # (p + g + 2 moments) / W + two units (p + g)
    local_held, local_peak = m["local (no parallelism)"]
    activations = local_peak - local_held - params_bytes  # the local step's grads: one tree
    print(f"world {size}: {m['units']} units, parameters {params_bytes / MB:.1f} MiB")
    print("| method | held between steps (MiB) | peak in a step (MiB) | peak - activations (MiB) |")
    print("| --- | ---: | ---: | ---: |")
    methods = ("local (no parallelism)", "fdp DDP", "fdp ZeRO-2", "fdp fully sharded")
    for name in (*methods, "fdp fully sharded, no prefetch"):
        h, p = m[name]
        print(f"| {name} | {h / MB:.1f} | {p / MB:.1f} | {(p - activations) / MB:.1f} |")
    fs = m["torch fully_shard"]
    if isinstance(fs, tuple):
        h, p = fs
        cells = f"{h / MB:.1f} | {p / MB:.1f} | {(p - activations) / MB:.1f}"
        print(f"| torch fully_shard (modules) | {cells} |")
    else:
        print(f"| torch fully_shard (modules) | {fs} | | |")
    sharded = m["fdp fully sharded"][1] - activations
    print(
        f"goal: fully sharded params + grads + state <= (p + g + state) / {size} + two units "
        f"= {goal / MB:.1f} MiB; measured {sharded / MB:.1f} MiB (activations and "
        f"temporaries, from the local step: {activations / MB:.1f} MiB)"
    )
    print(
        "Eager and compiled, every peak sampled (a thread polling the allocator): what a "
        "step holds (trees) plus how far it rises"
    )
    print(
        "| method | held between steps (MiB) | sampled peak in a step (MiB) | peak - activations |"
    )
    print("| --- | ---: | ---: | ---: |")
    for name, row in m["sampled"].items():
        if isinstance(row, str):
            print(f"| {name} | {row} | | |")
        else:
            h, p = row
            print(f"| {name} | {h / MB:.1f} | {p / MB:.1f} | {(p - activations) / MB:.1f} |")
    t = m["time"]
    ddp = t["fdp DDP"]
    cells = ", ".join(f"{k} {v * 1e3:.1f} ms ({v / ddp:.2f}x)" for k, v in t.items())
    print(f"step time (x DDP): {cells}\n")


SLUGS = {
    "fdp DDP": "ddp",
    "fdp ZeRO-2": "zero2",
    "fdp fully sharded": "sharded",
    "fdp fully sharded, no prefetch": "sharded_no_prefetch",
    "torch fully_shard": "torch",
    "fdp fully sharded, compiled": "sharded_compiled",
    "torch fully_shard, compiled": "torch_compiled",
}


def figures(size: int, m: dict[str, Any]) -> list[tuple[str, float]]:
    """One world's figures the pages quote: MiB, and step times / fdp DDP's and torch's."""
    w, t = f"w{size}", m["time"]
    params_bytes = held(params_of())
    activations = m["local (no parallelism)"][1] - m["local (no parallelism)"][0] - params_bytes
    got = [(f"{w}.activations_mib", activations / MB)]
    got.append((f"{w}.goal_mib", (params_bytes * 4 / size + 4 * params_bytes / m["units"]) / MB))
    for name, slug in SLUGS.items():
        if isinstance(m.get(name), tuple):
            got += [(f"{w}.{slug}.held_mib", m[name][0] / MB)]
            got += [(f"{w}.{slug}.peak_mib", m[name][1] / MB)]
            got += [(f"{w}.{slug}.peak_less_activations_mib", (m[name][1] - activations) / MB)]
        if isinstance(m["sampled"].get(name), tuple):
            got += [(f"{w}.{slug}.sampled_peak_mib", m["sampled"][name][1] / MB)]
        if name in t:
            got += [(f"{w}.{slug}.step_vs_ddp", t[name] / t["fdp DDP"])]
            got += [(f"{w}.{slug}.step_vs_sharded", t[name] / t["fdp fully sharded"])]
    if isinstance(m["torch fully_shard"], tuple):
        got += [(f"{w}.peak_vs_torch", m["fdp fully sharded"][1] / m["torch fully_shard"][1])]
        got += [(f"{w}.step_vs_torch", t["fdp fully sharded"] / t["torch fully_shard"])]
    compiled, eager = m["sampled"]["fdp fully sharded, compiled"], m["sampled"]["fdp fully sharded"]
    got += [(f"{w}.compiled_peak_vs_eager", compiled[1] / eager[1])]
    return got


PLOTTED = ("fdp DDP", "fdp ZeRO-2", "fdp fully sharded", "torch fully_shard")


def plot(measured: dict[int, dict[str, Any]], path: str) -> None:
    """Peak memory per rank and step time of DDP, ZeRO-2, fully sharded and torch's, per world."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig: Any
    fig, (mem, steps) = plt.subplots(1, 2, figsize=(9, 3.4))
    width = 0.8 / len(PLOTTED)
    for j, name in enumerate(PLOTTED):
        xs = [i + j * width for i in range(len(measured))]
        peaks = [_peak(m.get(name)) for m in measured.values()]
        times = [
            m["time"].get(name, float("nan")) / m["time"]["fdp DDP"] for m in measured.values()
        ]
        mem.bar(xs, peaks, width, label=name)
        steps.bar(xs, times, width, label=name)
    for ax, label in (
        (mem, "peak memory per rank in a step (MiB)"),
        (steps, "step time / fdp DDP"),
    ):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(measured))])
        ax.set_xticklabels([f"{size} ranks" for size in measured])
        ax.set_ylabel(label, fontsize=8)
    mem.legend(fontsize=7)
    fig.suptitle("8x1024 MLP + head, AdamW, gloo on CPU (benchmarks/fsdp_memory.py)", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}")


def _relative(times: dict[str, float], name: str) -> float:
    return times.get(name, float("nan")) / times["fdp DDP"]


def _peak(row: Any) -> float:
    return row[1] / MB if isinstance(row, tuple) else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--plot", default=None, metavar="PNG", help="also draw the figures here")
    args = parser.parse_args()
    rounds = 3 if args.quick else 5
    ctx = mp.get_context("spawn")
    print(f"torch {torch.__version__}, gloo on 127.0.0.1, 1 intra-op thread per rank\n")
    measured: dict[int, dict[str, Any]] = {}
    for size in (2, 4):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        queue = ctx.Queue()
        procs = [ctx.Process(target=run, args=(r, size, port, rounds, queue)) for r in range(size)]
        for p in procs:
            p.start()
        measured[size] = queue.get(timeout=900)
        report(size, measured[size])
        for p in procs:
            p.join(60)
    results.record("fsdp_memory", {k: v for s, m in measured.items() for k, v in figures(s, m)})
    if args.plot:
        plot(measured, args.plot)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
