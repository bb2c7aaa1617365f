"""fdp.distributed benchmarks on 2 gloo ranks (1 intra-op thread each), ratios from one run.

The script spawns the ranks itself (127.0.0.1); rank 0 prints. Every figure
compares two timings interleaved round by round (median over rounds).

    python benchmarks/bench_distributed.py            # both benchmarks
    python benchmarks/bench_distributed.py --quick    # fewer rounds
    python benchmarks/bench_distributed.py --only step --ranks 1   # DDP cost, no communication

1. all_reduce_grads over 200 leaves of 32768 float32 (25.6 MB) vs one flat
   ``dist.all_reduce`` of the same bytes (target <= 1.2x), vs the least any
   all_reduce_grads must do (the leaves divided into a flat buffer in one
   pass, then that flat all-reduce: the inputs stay untouched, so one copy
   is the floor), and vs one ``dist.all_reduce`` per leaf (target: fdp at
   least 5x faster).
2. A DDP training step (forward, backward, SGD) on an 8-layer 1024-wide tanh
   MLP plus a 10-way head, batch 64 per rank, every variant interleaved in
   one run: fdp.DistributedDataParallel eager; with ``--only compiled`` (or
   all) also ``ddp(params)`` inside a ``fullgraph=True`` inductor-compiled
   loss, with and without ``fdp.overlap_options()``; torch's DDP eager and
   compiled (DDPOptimizer, its graph count printed); and the machine's
   bounds: the local step without communication, followed by one flat
   all-reduce of all gradient bytes, and with that all-reduce started in
   the background with the step (the most overlap possible). Targets: fdp
   eager <= 0.9x torch DDP and <= 1.1x that last bound; fdp compiled <=
   0.9x eager torch DDP.
3. A fully compiled functional step (``torch.func.grad``, ``all_reduce_grads``
   on functional collectives, an SGD update with ``optree.tree_map``) vs eager.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import itertools
import multiprocessing as mp
import os
import socket
import sys
import time
from typing import Any

import optree
import torch
import torch.distributed as dist
import torch.nn.functional as F
from timing import interleaved, side_by_side
from torch._dynamo.testing import CompileCounterWithBackend

import fdp

WIDTH, DEPTH, BATCH, CLASSES = 1024, 8, 64, 10


def bench_all_reduce(rounds: int) -> dict[str, float]:
    leaves = [torch.randn(32768) for _ in range(200)]
    flat = torch.cat(leaves)
    packed = torch.empty_like(flat)
    slots = packed.split_with_sizes([t.numel() for t in leaves])
    world = dist.get_world_size()

    def ours() -> None:
        fdp.all_reduce_grads(leaves)

    def one_flat() -> None:
        dist.all_reduce(flat)

    def floor() -> None:
        for slot, t in zip(slots, leaves, strict=True):
            torch.div(t, world, out=slot)
        dist.all_reduce(packed)

    def per_leaf() -> None:
        for t in leaves:
            dist.all_reduce(t)

    fns = {"ours": ours, "flat": one_flat, "floor": floor}
    t = interleaved(fns, rounds=rounds, repeats=5, sync=dist.barrier)
    t_ours, t_flat = t["ours"], t["flat"]
    t_ours2, t_leaf = side_by_side(ours, per_leaf, rounds=max(3, rounds // 3), repeats=2,
                                   sync=dist.barrier)  # fmt: skip
    return {
        "fdp_ms": 1e3 * t_ours,
        "flat_ms": 1e3 * t_flat,
        "ratio_flat": t_ours / t_flat,
        "floor_ms": 1e3 * t["floor"],
        "per_leaf_ms": 1e3 * t_leaf,
        "speedup_leaf": t_leaf / t_ours2,
    }


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


def torch_ddp_step(x: torch.Tensor, y: torch.Tensor, cap_mb: float, *, backend: Any = None) -> Any:
    """An SGD step of the same MLP as a module under torch's DDP, compiled if ``backend``."""
    layers: list[torch.nn.Module] = []
    for _ in range(DEPTH):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
    layers.append(torch.nn.Linear(WIDTH, CLASSES))
    module = torch.nn.Sequential(*layers)
    torch_ddp = torch.nn.parallel.DistributedDataParallel(module, bucket_cap_mb=cap_mb)
    model = torch_ddp if backend is None else torch.compile(torch_ddp, backend=backend)
    torch_opt = torch.optim.SGD(torch_ddp.parameters(), lr=1e-3)

    def torch_step() -> None:
        torch_opt.zero_grad()
        torch.autograd.backward(F.cross_entropy(model(x), y))
        torch_opt.step()

    return torch_step


def data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(BATCH, WIDTH, generator=g)
    return x, torch.randint(0, CLASSES, (BATCH,), generator=g)


def step_fns(rank: int, cap_mb: float, *, compiled: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """The DDP steps to compare, the machine's bounds among them, and facts to print."""
    x, y = data(rank)
    params = make_params(0)
    leaves = [t for layer in params for t in layer.values()]
    ddp = fdp.DistributedDataParallel(params, bucket_cap_mb=cap_mb)
    opt = torch.optim.SGD(leaves, lr=1e-3)
    flat = torch.cat([t.detach().reshape(-1) for t in leaves])

    # The bounds step a copy: between two ddp(params) calls, a backward into
    # ddp's params that no ddp(params) prepared is refused.
    own = make_params(0)
    own_opt = torch.optim.SGD([t for layer in own for t in layer.values()], lr=1e-3)

    def sgd(loss_fn: Any, *, local: bool = False) -> Any:
        tree, optimizer = (own, own_opt) if local else (params, opt)

        def step() -> None:
            optimizer.zero_grad()
            torch.autograd.backward(loss_fn(tree))
            optimizer.step()

        return step

    def ddp_loss(p: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        return F.cross_entropy(mlp(ddp(p), x), y)

    local = sgd(lambda p: F.cross_entropy(mlp(p, x), y), local=True)

    def then_comm() -> None:
        local()
        dist.all_reduce(flat)

    def comm_from_start() -> None:
        work = dist.all_reduce(flat, async_op=True)
        local()
        assert work is not None
        work.wait()

    fns = {
        BOUNDS[0]: local,
        BOUNDS[1]: then_comm,
        BOUNDS[2]: comm_from_start,
        "torch DDP (eager)": torch_ddp_step(x, y, cap_mb),
        "fdp DDP (eager)": sgd(ddp_loss),
    }
    facts: dict[str, Any] = {"grad_mb": flat.numel() * 4 / 1e6, "buckets": len(ddp.buckets)}
    facts["comm_wall_ms"], facts["comm_cpu_ms"] = wall_and_cpu(lambda: dist.all_reduce(flat))
    if compiled:
        fns["fdp DDP compiled"] = sgd(torch.compile(ddp_loss, fullgraph=True))
        options = fdp.overlap_options()
        fns["fdp DDP compiled, overlap_options()"] = sgd(
            torch.compile(ddp_loss, fullgraph=True, options=options)
        )
        counter = CompileCounterWithBackend("inductor")
        fns["torch DDP compiled (DDPOptimizer)"] = torch_ddp_step(x, y, cap_mb, backend=counter)
        fns["torch DDP compiled (DDPOptimizer)"]()
        facts["torch_graphs"] = counter.frame_count
    return fns, facts


def wall_and_cpu(fn: Any, calls: int = 5) -> tuple[float, float]:
    """Milliseconds per call of wall time, and of this process's CPU time (all its threads)."""
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        fn()
    return 1e3 * (time.perf_counter() - wall) / calls, 1e3 * (time.process_time() - cpu) / calls


BOUNDS = (
    "bound: local step, no communication",
    "bound: local step, then one flat all-reduce",
    "bound: one flat all-reduce started with the step",
)


def bench_step(rounds: int, rank: int, cap_mb: float, *, compiled: bool) -> dict[str, Any]:
    fns, facts = step_fns(rank, cap_mb, compiled=compiled)
    facts["ms"] = {k: 1e3 * t for k, t in interleaved(fns, rounds=rounds, repeats=3,
                                                      sync=dist.barrier).items()}  # fmt: skip
    return facts


def bench_functional(rounds: int, rank: int) -> dict[str, float]:
    """A fully compiled functional step (func.grad, all_reduce_grads, tree_map update) vs eager."""
    x, y = data(rank)
    params = make_params(0)

    def functional(p: Any) -> Any:
        grads = torch.func.grad(lambda p: F.cross_entropy(mlp(p, x), y))(p)
        grads = fdp.all_reduce_grads(grads)
        return optree.tree_map(lambda a, b: a - 1e-3 * b, p, grads)

    compiled_functional = torch.compile(functional, fullgraph=True)
    detached: Any = [{k: t.detach() for k, t in layer.items()} for layer in params]
    state = {"eager": detached, "compiled": detached}

    def functional_step(fn: Any, key: str) -> Any:
        def step() -> None:
            state[key] = fn(state[key])

        return step

    f_eager, f_comp = side_by_side(functional_step(functional, "eager"),
                                   functional_step(compiled_functional, "compiled"),
                                   rounds=rounds, repeats=5, sync=dist.barrier)  # fmt: skip
    return {"eager_ms": 1e3 * f_eager, "compiled_ms": 1e3 * f_comp, "ratio": f_comp / f_eager}


def bench_timeline(rank: int) -> list[str]:
    """One compiled step's backward, profiled: when each bucket's all-reduce is issued, waited."""
    x, y = data(rank)
    params = make_params(0)
    ddp = fdp.DistributedDataParallel(params)

    def ddp_loss(p: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        return F.cross_entropy(mlp(ddp(p), x), y)

    loss = torch.compile(ddp_loss, fullgraph=True, options=fdp.overlap_options())
    for _ in range(3):
        torch.autograd.backward(loss(params))
    dist.barrier()
    with torch.profiler.profile(record_shapes=True) as prof:
        torch.autograd.backward(loss(params))
    events = list(prof.events())
    (backward,) = [e for e in events if e.name == "CompiledFunctionBackward"]
    t0 = backward.time_range.start

    def at(e: Any, end: bool = False) -> float:
        return float((e.time_range.end if end else e.time_range.start) - t0) / 1e3

    def numel(e: Any) -> int:
        return int(torch.Size(e.input_shapes[0]).numel())

    issues = [e for e in events if e.name == "_c10d_functional::all_reduce_"]
    waits = [e for e in events if e.name == "_c10d_functional::wait_tensor"]
    mms = [e for e in events if e.name == "aten::mm"]
    lines = [
        f"backward ends at {at(backward, True):.1f} ms; its {len(mms)} matmuls run "
        f"{at(mms[0]):.1f}-{at(mms[-1], True):.1f} ms"
    ]
    for k, issue in enumerate(issues):
        # Waits come in any order; a bucket's is the first one left of its size.
        wait = next(w for w in waits if numel(w) == numel(issue))
        waits.remove(wait)
        paths = ddp.buckets[k]
        lines.append(
            f"bucket {k} ({4 * numel(issue) / 1e6:.1f} MB, {paths[0]} .. {paths[-1]}): "
            f"issued at {at(issue):.1f} ms, waited {at(wait):.1f}-{at(wait, True):.1f} ms"
        )
    return lines


def bench_buffers(rounds: int, rank: int) -> dict[str, float]:
    """The cost of broadcast_buffers per step on a BatchNorm MLP, fdp against torch DDP."""
    x, y = data(rank)
    layers: list[torch.nn.Module] = []
    for _ in range(DEPTH):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.BatchNorm1d(WIDTH), torch.nn.Tanh()]
    net = torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, CLASSES))
    fns: dict[str, Any] = {}
    for flag in (True, False):
        state = {k: v.detach().clone().requires_grad_() for k, v in net.named_parameters()}
        state |= {k: v.clone() for k, v in net.named_buffers()}
        ddp = fdp.DistributedDataParallel(state, broadcast_buffers=flag)
        opt = torch.optim.SGD([v for v in state.values() if v.requires_grad], lr=1e-3)

        def fdp_step(ddp: Any = ddp, state: Any = state, opt: Any = opt) -> None:
            opt.zero_grad()
            out = torch.func.functional_call(net, ddp(state), x)
            torch.autograd.backward(F.cross_entropy(out, y))
            opt.step()

        module = copy.deepcopy(net)
        torch_ddp = torch.nn.parallel.DistributedDataParallel(module, broadcast_buffers=flag)
        torch_opt = torch.optim.SGD(torch_ddp.parameters(), lr=1e-3)

        def torch_step(model: Any = torch_ddp, opt: Any = torch_opt) -> None:
            opt.zero_grad()
            torch.autograd.backward(F.cross_entropy(model(x), y))
            opt.step()

        fns[f"fdp {flag}"], fns[f"torch {flag}"] = fdp_step, torch_step
    ms = {k: 1e3 * t for k, t in interleaved(fns, rounds=rounds, repeats=3,
                                             sync=dist.barrier).items()}  # fmt: skip
    return {
        "fdp_ms": ms["fdp True"],
        "fdp_cost": ms["fdp True"] - ms["fdp False"],
        "torch_ms": ms["torch True"],
        "torch_cost": ms["torch True"] - ms["torch False"],
    }


def bench_sync_bn(rounds: int, rank: int) -> dict[str, Any]:
    """fdp.sync_batch_norm forward+backward against local batch norm and torch.nn.SyncBatchNorm."""
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(32, 64, 16, 16, generator=g, requires_grad=True)
    bn = torch.nn.BatchNorm2d(64)

    def fdp_bn() -> None:
        out = fdp.sync_batch_norm(x, bn.running_mean, bn.running_var, bn.weight, bn.bias)
        torch.autograd.backward(out.square().mean())

    def local_bn() -> None:
        torch.autograd.backward(bn(x).square().mean())

    sync = torch.nn.SyncBatchNorm(64)
    try:
        sync(x)
        refused = ""
    except ValueError as e:  # torch 2.13: GPU, XPU, HPU or privateuse1 only
        refused = str(e).split(",")[0]
    t_fdp, t_local = side_by_side(fdp_bn, local_bn, rounds=rounds, repeats=10, sync=dist.barrier)
    return {"fdp_ms": 1e3 * t_fdp, "local_ms": 1e3 * t_local, "refused": refused}


def report_step(s: dict[str, Any], cap_mb: float, say: Any) -> None:
    ms = s["ms"]
    say(
        f"DDP step, 8x{WIDTH} tanh MLP + {CLASSES}-way head, batch {BATCH}/rank, "
        f"{s['grad_mb']:.1f} MB of grads in {s['buckets']} buckets of <= {cap_mb} MiB "
        "(medians, all interleaved in one run):"
    )
    best, torch_eager = ms[BOUNDS[2]], ms["torch DDP (eager)"]
    for name, t in ms.items():
        say(f"  {name:<50} {t:6.1f} ms  {t / best:5.2f}x bound  {t / torch_eager:5.2f}x torch DDP")
    if "torch_graphs" in s:
        why = (
            "none of the model: pytorch/pytorch#140416"
            if s["torch_graphs"] == 0
            else "DDPOptimizer"
        )
        say(
            "  graphs per step: fdp compiled 1 (fullgraph=True); torch DDP compiled "
            f"{s['torch_graphs']} ({why})"
        )
    say(
        f"  one flat all-reduce of the gradients alone: {s['comm_wall_ms']:.1f} ms, "
        f"{s['comm_cpu_ms']:.1f} ms of it CPU time in each process (gloo's threads)"
    )
    say("  targets: fdp eager <= 0.9x torch DDP and <= 1.1x bound; fdp compiled <= 0.9x torch DDP")


def run(rank: int, size: int, port: int, quick: bool, which: str, cap_mb: float) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=600),
    )
    rounds = 5 if quick else 11
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"torch {torch.__version__}, {size} gloo ranks on 127.0.0.1, 1 intra-op thread each")
    if which in ("all", "all_reduce"):
        r = bench_all_reduce(rounds)
        say(
            f"all_reduce_grads 200 x 32768 f32 (25.6 MB): fdp {r['fdp_ms']:.1f} ms, one flat "
            f"all_reduce {r['flat_ms']:.1f} ms -> {r['ratio_flat']:.3f}x (target <= 1.2x)"
        )
        say(
            f"                 one pass dividing into a flat buffer, then that all_reduce "
            f"{r['floor_ms']:.1f} ms ({r['floor_ms'] / r['flat_ms']:.3f}x flat): fdp / it "
            f"{r['fdp_ms'] / r['floor_ms']:.3f}x"
        )
        say(
            f"                 one all_reduce per leaf {r['per_leaf_ms']:.1f} ms -> fdp "
            f"{r['speedup_leaf']:.1f}x faster (target >= 5x)"
        )
    if which in ("all", "step", "compiled"):
        report_step(bench_step(rounds, rank, cap_mb, compiled=which != "step"), cap_mb, say)
    if which in ("all", "buffers"):
        b = bench_buffers(rounds, rank)
        say(
            f"broadcast_buffers on a BatchNorm MLP ({DEPTH} BatchNorm1d({WIDTH})): fdp step "
            f"{b['fdp_ms']:.1f} ms, of which {b['fdp_cost']:.1f} ms for the buffers; torch DDP "
            f"{b['torch_ms']:.1f} ms, of which {b['torch_cost']:.1f} ms (target fdp <= torch)"
        )
    if which in ("all", "sync_bn"):
        n = bench_sync_bn(rounds, rank)
        say(
            f"sync_batch_norm forward+backward, 32x64x16x16 per rank: fdp {n['fdp_ms']:.2f} ms, "
            f"local batch norm (no sync) {n['local_ms']:.2f} ms -> "
            f"{n['fdp_ms'] / n['local_ms']:.2f}x; torch.nn.SyncBatchNorm: "
            + (f"refused ({n['refused']})" if n["refused"] else "runs")
        )
    if which in ("all", "compiled", "timeline"):
        say("one compiled step with fdp.overlap_options(), profiled on this rank:")
        for line in bench_timeline(rank):
            say("  " + line)
    if which in ("all", "compiled"):
        f = bench_functional(rounds, rank)
        say(
            "compiled functional step (func.grad, all_reduce_grads, tree_map update, fullgraph): "
            f"{f['compiled_ms']:.1f} ms vs eager {f['eager_ms']:.1f} ms -> {f['ratio']:.3f}x"
        )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument(
        "--only",
        choices=["all", "all_reduce", "step", "buffers", "sync_bn", "compiled", "timeline"],
        default="all",
    )
    parser.add_argument(
        "--bucket-cap-mb", type=float, default=25.0, help="DDP bucket size, fdp and torch alike"
    )
    parser.add_argument(
        "--ranks",
        type=int,
        default=2,
        help="gloo ranks; 1 leaves each DDP only its own cost (an all-reduce of one rank is free)",
    )
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(
            target=run, args=(rank, args.ranks, port, args.quick, args.only, args.bucket_cap_mb)
        )
        for rank in range(args.ranks)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(1800)
    failed = [p.exitcode for p in procs if p.exitcode != 0]
    if failed:
        for p in procs:
            if p.is_alive():
                p.kill()
        sys.exit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
