"""The DDP training step: fdp against torch's DDP and the machine's bounds, each in its own ranks.

    python benchmarks/bench_ddp_step.py             # eager: fdp, torch DDP, the bounds
    python benchmarks/bench_ddp_step.py --compiled  # also the compiled variants
    python benchmarks/bench_ddp_step.py --quick --ranks 1   # fewer rounds; no communication

A training step (forward, backward, SGD) of an 8-layer 1024-wide tanh MLP
plus a 10-way head, batch 64 per rank on 2 gloo ranks (1 intra-op thread
each): fdp.DistributedDataParallel eager (its parameters' check across
ranks at the default every 100 steps, off, and at every step); with
``--compiled`` also ``ddp(params)`` inside a ``fullgraph=True`` inductor-compiled loss, with and
without ``fdp.overlap_options()``, and torch's DDP compiled (DDPOptimizer, its
graph count printed); torch's DDP eager; and the machine's bounds: the local
step without communication, followed by one flat all-reduce of all gradient
bytes, and with that all-reduce started in the background with the step (the
most overlap possible). Targets: fdp eager <= 0.9x torch DDP and <= 1.1x
that last bound; fdp compiled <= 0.9x eager torch DDP.

Each variant runs in its own group of rank processes, as a training job
does, and the parent times them one at a time, round by round in rotating
order (medians over rounds). Models sharing one process share its heap, and
one model's allocations then fragment the others' (measured:
docs/performance.md).

The allocator is held steady. With glibc's defaults a process gives the
4 MB blocks of a step (activations, gradients) back to the kernel and
faults them in again the next step: 8,160 minor page faults (32 MB) and
about 9 ms per local step here, but how many depends on what the heap
held before (a process that ran another model first faulted less), so
the same step measured 25% apart in two harnesses (issue 39). The ranks
therefore run with a fixed mmap threshold and no trimming (glibc's
``MALLOC_MMAP_THRESHOLD_``/``MALLOC_TRIM_THRESHOLD_``): steady state is
then free of page faults, as under a caching allocator (CUDA's, or
jemalloc/tcmalloc). ``--glibc-defaults`` measures with the defaults; the
faults per step are printed for every variant either way.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import multiprocessing as mp
import os
import resource
import socket
import statistics
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

import results
import torch
import torch.distributed as dist
import torch.nn.functional as F
from timing import STEADY_ALLOCATOR  # see the docstring
from torch._dynamo.testing import CompileCounterWithBackend

import fdp

WIDTH, DEPTH, BATCH, CLASSES = 1024, 8, 64, 10
BOUNDS = (
    "bound: local step, no communication",
    "bound: local step, then one flat all-reduce",
    "bound: one flat all-reduce started with the step",
)
TORCH, FDP = "torch DDP (eager)", "fdp DDP (eager)"
# The replicas' check (issue 45): the default is every 100 reduced backwards.
CHECKS = {"fdp DDP (eager), check_replicas_every=0": 0, "fdp DDP (eager), every=1": 1}
COMPILED = (
    "fdp DDP compiled",
    "fdp DDP compiled, overlap_options()",
    "torch DDP compiled (DDPOptimizer)",
)


def make_params(seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    sizes = [WIDTH] * (DEPTH + 1) + [CLASSES]
    return [
        {
            "w": (torch.randn(n_out, n_in, generator=g) / n_in**0.5).requires_grad_(),
            "b": torch.zeros(n_out, requires_grad=True),
        }
        for n_in, n_out in itertools.pairwise(sizes)
    ]


def mlp(params: list[dict[str, torch.Tensor]], x: torch.Tensor) -> torch.Tensor:
    *hidden, head = params
    for layer in hidden:
        x = torch.tanh(F.linear(x, layer["w"], layer["b"]))
    return F.linear(x, head["w"], head["b"])


def data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(BATCH, WIDTH, generator=g)
    return x, torch.randint(0, CLASSES, (BATCH,), generator=g)


def torch_ddp_step(x: torch.Tensor, y: torch.Tensor, cap_mb: float, *, backend: Any = None) -> Any:
    """An SGD step of the same MLP as a module under torch's DDP, compiled if ``backend``."""
    layers: list[torch.nn.Module] = []
    for _ in range(DEPTH):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
    layers.append(torch.nn.Linear(WIDTH, CLASSES))
    torch_ddp = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(*layers), bucket_cap_mb=cap_mb
    )
    model = torch_ddp if backend is None else torch.compile(torch_ddp, backend=backend)
    torch_opt = torch.optim.SGD(torch_ddp.parameters(), lr=1e-3)

    def torch_step() -> None:
        torch_opt.zero_grad()
        torch.autograd.backward(F.cross_entropy(model(x), y))
        torch_opt.step()

    return torch_step


def sgd(params: list[dict[str, torch.Tensor]], loss_fn: Any) -> Any:
    optimizer = torch.optim.SGD([t for layer in params for t in layer.values()], lr=1e-3)

    def step() -> None:
        optimizer.zero_grad()
        torch.autograd.backward(loss_fn(params))
        optimizer.step()

    return step


def wall_and_cpu(fn: Any, calls: int = 5) -> tuple[float, float]:
    """Milliseconds per call of wall time, and of this process's CPU time (all its threads)."""
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        fn()
    return 1e3 * (time.perf_counter() - wall) / calls, 1e3 * (time.process_time() - cpu) / calls


def variant(name: str, rank: int, cap_mb: float) -> tuple[Any, dict[str, Any]]:
    """One variant's step on this rank, and the facts it can tell."""
    x, y = data(rank)
    params = make_params(0)
    facts: dict[str, Any] = {}
    if name in (TORCH, COMPILED[2]):
        counter = CompileCounterWithBackend("inductor") if name == COMPILED[2] else None
        step = torch_ddp_step(x, y, cap_mb, backend=counter)
        step()
        if counter is not None:
            facts["torch_graphs"] = counter.frame_count
        return step, facts
    if name in BOUNDS:
        local = sgd(params, lambda p: F.cross_entropy(mlp(p, x), y))
        flat = torch.cat([t.detach().reshape(-1) for layer in params for t in layer.values()])
        facts["grad_mb"] = flat.numel() * 4 / 1e6
        facts["comm_wall_ms"], facts["comm_cpu_ms"] = wall_and_cpu(lambda: dist.all_reduce(flat))

        def then_comm() -> None:
            local()
            dist.all_reduce(flat)

        def comm_from_start() -> None:
            work = dist.all_reduce(flat, async_op=True)
            local()
            assert work is not None
            work.wait()

        return dict(zip(BOUNDS, (local, then_comm, comm_from_start), strict=True))[name], facts
    every = CHECKS.get(name, 100)
    ddp = fdp.DistributedDataParallel(params, bucket_cap_mb=cap_mb, check_replicas_every=every)
    facts["buckets"] = len(ddp.buckets)

    def ddp_loss(p: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        return F.cross_entropy(mlp(ddp(p), x), y)

    if name == FDP or name in CHECKS:
        return sgd(params, ddp_loss), facts
    options = fdp.overlap_options() if name == COMPILED[1] else None
    return sgd(params, torch.compile(ddp_loss, fullgraph=True, options=options)), facts


def worker(name: str, rank: int, size: int, port: int, cap_mb: float, conn: Connection) -> None:
    """Runs ``name`` on this rank: ``n`` steps between barriers per request, until None."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=600),
    )
    step, facts = variant(name, rank, cap_mb)
    for _ in range(3):  # warm-up: pools, allocator, compiled graphs
        step()
    dist.barrier()
    conn.send(facts)
    while (n := conn.recv()) is not None:
        dist.barrier()
        start, faults = time.perf_counter(), _minor_faults()
        for _ in range(n):
            step()
        dist.barrier()
        conn.send(((time.perf_counter() - start) / n, (_minor_faults() - faults) / n))
    dist.destroy_process_group()


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


Ranks = tuple[list[Any], list[Connection]]


def start(name: str, size: int, cap_mb: float) -> tuple[Ranks, dict[str, Any]]:
    """``name``'s rank processes, once warm; their pipes; and rank 0's facts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    for rank in range(size):
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=worker, args=(name, rank, size, port, cap_mb, theirs))
        proc.start()
        procs.append(proc)
        conns.append(ours)
    facts = [conn.recv() for conn in conns]
    return (procs, conns), facts[0]


def report(
    ms: dict[str, float],
    faults: dict[str, float],
    facts: dict[str, Any],
    cap_mb: float,
    size: int,
    allocator: str,
) -> None:
    print(f"torch {torch.__version__}, {size} gloo ranks on 127.0.0.1, 1 intra-op thread each")
    print(f"allocator: {allocator}")
    print(
        f"DDP step, {DEPTH}x{WIDTH} tanh MLP + {CLASSES}-way head, batch {BATCH}/rank, "
        f"{facts['grad_mb']:.1f} MB of grads in {facts['buckets']} buckets of <= {cap_mb} MiB "
        "(medians; each variant in its own ranks, timed in turn):"
    )
    best, torch_eager = ms[BOUNDS[2]], ms[TORCH]
    for name, t in ms.items():
        ratios = f"{t / best:5.2f}x bound  {t / torch_eager:5.2f}x torch DDP"
        print(f"  {name:<50} {t:6.1f} ms  {ratios}  {faults[name]:6.0f} page faults/step")
    if "torch_graphs" in facts:
        graphs = facts["torch_graphs"]
        why = "none of the model: pytorch/pytorch#140416" if graphs == 0 else "DDPOptimizer"
        print("  graphs per step: fdp compiled 1 (fullgraph=True);", end=" ")
        print(f"torch DDP compiled {graphs} ({why})")
    print(
        f"  one flat all-reduce of the gradients alone: {facts['comm_wall_ms']:.1f} ms, "
        f"{facts['comm_cpu_ms']:.1f} ms of it CPU time in each process (gloo's threads)"
    )
    print("  targets: fdp eager <= 0.9x torch DDP and <= 1.1x bound;", end=" ")
    print("fdp compiled <= 0.9x torch DDP")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--compiled", action="store_true", help="also the compiled variants")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0, help="fdp and torch alike")
    parser.add_argument("--ranks", type=int, default=2, help="1: each DDP's own cost alone")
    parser.add_argument(
        "--glibc-defaults", action="store_true", help="glibc's allocator as is: page faults"
    )
    args = parser.parse_args()
    if args.glibc_defaults:
        allocator = "glibc defaults (freed blocks go back to the kernel)"
    else:  # read by glibc when each rank process starts
        os.environ.update(STEADY_ALLOCATOR)
        allocator = ", ".join(f"{k}={v}" for k, v in STEADY_ALLOCATOR.items())
    names = [*BOUNDS, TORCH, FDP, *CHECKS, *(COMPILED if args.compiled else ())]
    running: dict[str, Ranks] = {}
    facts: dict[str, Any] = {}
    try:
        for name in names:  # one at a time: warm-ups and compiles do not overlap
            running[name], told = start(name, args.ranks, args.bucket_cap_mb)
            facts |= told
        times: dict[str, list[float]] = {name: [] for name in names}
        faults: dict[str, list[float]] = {name: [] for name in names}
        for r in range(5 if args.quick else 11):
            k = r % len(names)
            for name in names[k:] + names[:k]:
                conns = running[name][1]
                for conn in conns:
                    conn.send(3)
                took, faulted = conns[0].recv()
                times[name].append(took)
                faults[name].append(faulted)
                for conn in conns[1:]:
                    conn.recv()
        for _, conns in running.values():
            for conn in conns:
                conn.send(None)
    finally:
        for procs, _ in running.values():
            for proc in procs:
                proc.join(60)
                if proc.is_alive():
                    proc.kill()
    failed = [p.exitcode for procs, _ in running.values() for p in procs if p.exitcode != 0]
    if failed:
        sys.exit(f"a rank failed: exit codes {failed}")
    ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    per_step = {name: statistics.median(f) for name, f in faults.items()}
    report(ms, per_step, facts, args.bucket_cap_mb, args.ranks, allocator)
    results.record("bench_ddp_step", figures(ms))


def figures(ms: dict[str, float]) -> dict[str, float]:
    """The ratios the pages quote, by name."""
    check_off, every_step = CHECKS
    got = {
        "eager_vs_torch": ms[FDP] / ms[TORCH],
        "eager_vs_bound": ms[FDP] / ms[BOUNDS[2]],
        "torch_vs_bound": ms[TORCH] / ms[BOUNDS[2]],
        "check_default_vs_off": ms[FDP] / ms[check_off],
        "check_every_step_vs_off": ms[every_step] / ms[check_off],
    }
    if COMPILED[0] in ms:
        got["compiled_vs_torch"] = ms[COMPILED[0]] / ms[TORCH]
        got["compiled_overlap_vs_torch"] = ms[COMPILED[1]] / ms[TORCH]
    return got


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
