"""fdp.distributed benchmarks on 2 gloo ranks (1 intra-op thread each), ratios from one run.

The script spawns the ranks itself (127.0.0.1); rank 0 prints. Every figure
compares two timings interleaved round by round (median over rounds).

    python benchmarks/bench_distributed.py            # both benchmarks
    python benchmarks/bench_distributed.py --quick    # fewer rounds

1. all_reduce_grads over 200 leaves of 32768 float32 (25.6 MB) vs one flat
   ``dist.all_reduce`` of the same bytes (target <= 1.3x, aim 1.1x), and vs one
   ``dist.all_reduce`` per leaf (target: fdp at least 5x faster).
2. A DDP training step (forward, backward, SGD) on an 8-layer 1024-wide tanh
   MLP plus a 10-way head, batch 64 per rank: fdp.DistributedDataParallel vs
   torch.nn.parallel.DistributedDataParallel on the same model (target <=
   0.85x, aim 0.6x). Also the local step without communication and one flat
   all-reduce of all the gradients, from which the share of communication
   hidden behind backward follows: (local + comm - fdp) / comm.
3. The DDP step of 2 compiled (inductor) vs eager, two ways: the loss with
   ``ddp(params)`` inside compiled with ``fullgraph=True`` and ``.backward()``
   outside (also against eager torch DDP, target <= 0.9x); and a fully
   compiled functional step (``torch.func.grad``, ``all_reduce_grads`` on
   functional collectives, an SGD update with ``optree.tree_map``).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import multiprocessing as mp
import os
import socket
import sys
from typing import Any

import optree
import torch
import torch.distributed as dist
import torch.nn.functional as F
from timing import side_by_side

import fdp

WIDTH, DEPTH, BATCH, CLASSES = 1024, 8, 64, 10


def bench_all_reduce(rounds: int) -> dict[str, float]:
    leaves = [torch.randn(32768) for _ in range(200)]
    flat = torch.cat(leaves)

    def ours() -> None:
        fdp.all_reduce_grads(leaves)

    def one_flat() -> None:
        dist.all_reduce(flat)

    def per_leaf() -> None:
        for t in leaves:
            dist.all_reduce(t)

    t_ours, t_flat = side_by_side(ours, one_flat, rounds=rounds, repeats=5, sync=dist.barrier)
    t_ours2, t_leaf = side_by_side(ours, per_leaf, rounds=max(3, rounds // 3), repeats=2,
                                   sync=dist.barrier)  # fmt: skip
    return {
        "fdp_ms": 1e3 * t_ours,
        "flat_ms": 1e3 * t_flat,
        "ratio_flat": t_ours / t_flat,
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


def torch_ddp_step(x: torch.Tensor, y: torch.Tensor, cap_mb: float) -> Any:
    """One SGD step of the same MLP as an nn.Module under torch's own DDP."""
    layers: list[torch.nn.Module] = []
    for _ in range(DEPTH):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
    layers.append(torch.nn.Linear(WIDTH, CLASSES))
    module = torch.nn.Sequential(*layers)
    torch_ddp = torch.nn.parallel.DistributedDataParallel(module, bucket_cap_mb=cap_mb)
    torch_opt = torch.optim.SGD(torch_ddp.parameters(), lr=1e-3)

    def torch_step() -> None:
        torch_opt.zero_grad()
        torch.autograd.backward(F.cross_entropy(torch_ddp(x), y))
        torch_opt.step()

    return torch_step


def bench_step(rounds: int, rank: int, cap_mb: float) -> dict[str, float]:
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(BATCH, WIDTH, generator=g)
    y = torch.randint(0, CLASSES, (BATCH,), generator=g)

    params = make_params(0)
    leaves = [t for layer in params for t in layer.values()]
    ddp = fdp.DistributedDataParallel(params, bucket_cap_mb=cap_mb)
    opt = torch.optim.SGD(leaves, lr=1e-3)

    def fdp_step() -> None:
        opt.zero_grad()
        torch.autograd.backward(F.cross_entropy(mlp(ddp(params), x), y))
        opt.step()

    def local_step() -> None:
        opt.zero_grad()
        torch.autograd.backward(F.cross_entropy(mlp(params, x), y))
        opt.step()

    torch_step = torch_ddp_step(x, y, cap_mb)
    flat = torch.cat([t.detach().reshape(-1) for t in leaves])

    def comm() -> None:
        dist.all_reduce(flat)

    t_fdp, t_torch = side_by_side(fdp_step, torch_step, rounds=rounds, repeats=5,
                                  sync=dist.barrier)  # fmt: skip
    t_fdp2, t_local = side_by_side(fdp_step, local_step, rounds=rounds, repeats=5,
                                   sync=dist.barrier)  # fmt: skip
    t_comm = side_by_side(comm, comm, rounds=max(3, rounds // 3), repeats=5, sync=dist.barrier)[0]
    return {
        "fdp_ms": 1e3 * t_fdp,
        "torch_ms": 1e3 * t_torch,
        "ratio": t_fdp / t_torch,
        "local_ms": 1e3 * t_local,
        "fdp2_ms": 1e3 * t_fdp2,
        "comm_ms": 1e3 * t_comm,
        "hidden": (t_local + t_comm - t_fdp2) / t_comm,
        "grad_mb": flat.numel() * 4 / 1e6,
        "buckets": len(ddp.buckets),
    }


def bench_compiled(rounds: int, rank: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(BATCH, WIDTH, generator=g)
    y = torch.randint(0, CLASSES, (BATCH,), generator=g)
    params = make_params(0)
    leaves = [t for layer in params for t in layer.values()]
    ddp = fdp.DistributedDataParallel(params)
    opt = torch.optim.SGD(leaves, lr=1e-3)

    def ddp_loss(p: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        return F.cross_entropy(mlp(ddp(p), x), y)

    compiled_loss = torch.compile(ddp_loss, fullgraph=True)

    def ddp_step(loss_fn: Any) -> Any:
        def step() -> None:
            opt.zero_grad()
            torch.autograd.backward(loss_fn(params))
            opt.step()

        return step

    def functional(p: Any) -> Any:
        grads = torch.func.grad(lambda p: F.cross_entropy(mlp(p, x), y))(p)
        grads = fdp.all_reduce_grads(grads)
        return optree.tree_map(lambda a, b: a - 1e-3 * b, p, grads)

    compiled_functional = torch.compile(functional, fullgraph=True)
    detached: Any = [{k: t.detach() for k, t in layer.items()} for layer in params]
    state = {"eager": detached}
    state["compiled"] = state["eager"]

    def functional_step(fn: Any, key: str) -> Any:
        def step() -> None:
            state[key] = fn(state[key])

        return step

    t_eager, t_comp = side_by_side(ddp_step(ddp_loss), ddp_step(compiled_loss), rounds=rounds,
                                   repeats=5, sync=dist.barrier)  # fmt: skip
    t_torch, t_comp2 = side_by_side(torch_ddp_step(x, y, 25.0), ddp_step(compiled_loss),
                                    rounds=rounds, repeats=5, sync=dist.barrier)  # fmt: skip
    f_eager, f_comp = side_by_side(functional_step(functional, "eager"),
                                   functional_step(compiled_functional, "compiled"),
                                   rounds=rounds, repeats=5, sync=dist.barrier)  # fmt: skip
    return {
        "ddp_eager_ms": 1e3 * t_eager,
        "ddp_compiled_ms": 1e3 * t_comp,
        "ddp_ratio": t_comp / t_eager,
        "torch_ms": 1e3 * t_torch,
        "ddp_compiled2_ms": 1e3 * t_comp2,
        "torch_ratio": t_comp2 / t_torch,
        "fn_eager_ms": 1e3 * f_eager,
        "fn_compiled_ms": 1e3 * f_comp,
        "fn_ratio": f_comp / f_eager,
    }


def run(rank: int, size: int, port: int, quick: bool, which: str, cap_mb: float) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=120),
    )
    rounds = 5 if quick else 11
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"torch {torch.__version__}, {size} gloo ranks on 127.0.0.1, 1 intra-op thread each")
    if which in ("all", "all_reduce"):
        r = bench_all_reduce(rounds)
        say(
            f"all_reduce_grads 200 x 32768 f32 (25.6 MB): fdp {r['fdp_ms']:.1f} ms, one flat "
            f"all_reduce {r['flat_ms']:.1f} ms -> {r['ratio_flat']:.3f}x (target <= 1.3x)"
        )
        say(
            f"                 one all_reduce per leaf {r['per_leaf_ms']:.1f} ms -> fdp "
            f"{r['speedup_leaf']:.1f}x faster (target >= 5x)"
        )
    if which in ("all", "step"):
        s = bench_step(rounds, rank, cap_mb)
        say(
            f"DDP step 8x{WIDTH} tanh MLP + {CLASSES}-way head, batch {BATCH}/rank, "
            f"{s['grad_mb']:.1f} MB of grads, {s['buckets']} buckets of <= {cap_mb} MiB:"
        )
        say(
            f"                 fdp {s['fdp_ms']:.1f} ms, torch DDP {s['torch_ms']:.1f} ms -> "
            f"{s['ratio']:.3f}x (target <= 0.85x)"
        )
        say(
            f"                 local step {s['local_ms']:.1f} ms + flat all_reduce "
            f"{s['comm_ms']:.1f} ms vs fdp {s['fdp2_ms']:.1f} ms -> "
            f"{100 * s['hidden']:.0f}% of the communication hidden behind backward"
        )
    if which in ("all", "compiled"):
        c = bench_compiled(rounds, rank)
        say(
            f"compiled DDP step, ddp(params) in a fullgraph compiled loss: "
            f"{c['ddp_compiled_ms']:.1f} ms vs eager {c['ddp_eager_ms']:.1f} ms -> "
            f"{c['ddp_ratio']:.3f}x"
        )
        say(
            f"                 vs eager torch DDP {c['torch_ms']:.1f} ms (fdp compiled "
            f"{c['ddp_compiled2_ms']:.1f} ms) -> {c['torch_ratio']:.3f}x (target <= 0.9x)"
        )
        say(
            "compiled functional step (func.grad, all_reduce_grads, tree_map update, fullgraph): "
            f"{c['fn_compiled_ms']:.1f} ms vs eager {c['fn_eager_ms']:.1f} ms "
            f"-> {c['fn_ratio']:.3f}x"
        )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--only", choices=["all", "all_reduce", "step", "compiled"], default="all")
    parser.add_argument(
        "--bucket-cap-mb", type=float, default=25.0, help="DDP bucket size, fdp and torch alike"
    )
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=run, args=(rank, 2, port, args.quick, args.only, args.bucket_cap_mb))
        for rank in range(2)
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
