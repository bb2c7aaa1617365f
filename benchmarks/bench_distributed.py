"""fdp.distributed benchmarks on 2 gloo ranks (1 intra-op thread each), ratios from one run.

The script spawns the ranks itself (127.0.0.1); rank 0 prints. Every figure
compares timings interleaved round by round (median over rounds). The DDP
training step has its own script, ``bench_ddp_step.py``, which runs each
variant in its own ranks.

    python benchmarks/bench_distributed.py            # all of them
    python benchmarks/bench_distributed.py --quick    # fewer rounds
    python benchmarks/bench_distributed.py --only all_reduce

1. all_reduce_grads over 200 leaves of 32768 float32 (25.6 MB) vs one flat
   ``dist.all_reduce`` of the same bytes (target <= 1.2x), vs the least any
   all_reduce_grads must do (the leaves divided into a flat buffer in one
   pass, then that flat all-reduce: the inputs stay untouched, so one copy
   is the floor), and vs one ``dist.all_reduce`` per leaf (target: fdp at
   least 5x faster).
2. ``broadcast_buffers`` on a BatchNorm MLP, fdp against torch's DDP, and
   ``fdp.sync_batch_norm`` against local batch norm.
3. One compiled DDP step with ``fdp.overlap_options()``, profiled: when each
   bucket's all-reduce is issued and waited (``--only timeline``).
4. A fully compiled functional step (``torch.func.grad``, ``all_reduce_grads``
   on functional collectives, an SGD update with ``optree.tree_map``) vs eager.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import multiprocessing as mp
import os
import socket
import sys
from typing import Any

import optree
import results
import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_ddp_step import CLASSES, DEPTH, WIDTH, data, make_params, mlp
from timing import interleaved, side_by_side

import fdp


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
    got = {
        "fdp_ms": 1e3 * t_ours,
        "flat_ms": 1e3 * t_flat,
        "ratio_flat": t_ours / t_flat,
        "floor_ms": 1e3 * t["floor"],
        "per_leaf_ms": 1e3 * t_leaf,
        "speedup_leaf": t_leaf / t_ours2,
    }
    if dist.get_rank() == 0:
        results.record("bench_distributed", got | {"vs_floor": t_ours / t["floor"]})
    return got


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


def run(rank: int, size: int, port: int, quick: bool, which: str) -> None:
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
        choices=["all", "all_reduce", "buffers", "sync_bn", "compiled", "timeline"],
        default="all",
    )
    parser.add_argument(
        "--ranks",
        type=int,
        default=2,
        help="gloo ranks",
    )
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=run, args=(rank, args.ranks, port, args.quick, args.only))
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
