"""A MeanFlow training step on 2 gloo ranks (1 intra-op thread each), ratios from one run.

The step of ``examples/train_meanflow.py`` (``torch.func.jvp`` of the model,
a loss on its output, ``.backward()``, SGD) on a 4-layer 512-wide SiLU MLP,
batch 256 per rank. Every variant is interleaved round by round (median over
rounds); the script spawns the ranks itself (127.0.0.1) and rank 0 prints.

- ``fdp, ddp(params) inside jvp``: the MeanFlow pattern, gradients averaged
  over the ranks bucket by bucket during backward;
- ``fdp, ddp(params) outside jvp``: the same reduction, called before the
  transformed function;
- ``local (no data parallelism)``: the same step on the same per-rank batch,
  no communication: the half-batch step of one device, the lower bound;
- ``local, then one flat all-reduce``: the bound without overlap.

Targets: fdp inside jvp <= 1.05x fdp outside (the placement costs nothing)
and <= 1.1x local-then-all-reduce. With ``--compile`` the inside variant is
also run as one ``fullgraph=True`` inductor graph, next to the compiled local
step.

    python benchmarks/bench_meanflow.py
    python benchmarks/bench_meanflow.py --quick --compile
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
from collections.abc import Callable

import results
import torch
import torch.distributed as dist
from timing import interleaved, run_ranks

import fdp

WIDTH, DEPTH, BATCH = 512, 4, 256
Params = list[dict[str, torch.Tensor]]
Loss = Callable[[Params, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def make_params() -> Params:
    g = torch.Generator().manual_seed(0)
    sizes = [4, *([WIDTH] * DEPTH), 2]
    return [
        {
            "w": (torch.randn(i, o, generator=g) * (2 / i) ** 0.5).requires_grad_(),
            "b": torch.zeros(o, requires_grad=True),
        }
        for i, o in itertools.pairwise(sizes)
    ]


def velocity(params: Params, z: torch.Tensor, r: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    x = torch.cat([z, t[:, None], (t - r)[:, None]], dim=1)
    *hidden, last = params
    for layer in hidden:
        x = torch.nn.functional.silu(x @ layer["w"] + layer["b"])
    return x @ last["w"] + last["b"]


def meanflow(sync: Callable[[Params], Params], *, inside: bool) -> Loss:
    """The MeanFlow loss, with ``sync`` applied inside the jvp'd function or before it."""

    def loss(
        p: Params, x: torch.Tensor, noise: torch.Tensor, r: torch.Tensor, t: torch.Tensor
    ) -> torch.Tensor:
        outer = p if inside else sync(p)
        z = (1 - t[:, None]) * x + t[:, None] * noise
        v = noise - x

        def u(z: torch.Tensor, r: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            return velocity(sync(outer) if inside else outer, z, r, t)

        tangents = (v, torch.zeros_like(r), torch.ones_like(t))
        out, dudt = torch.func.jvp(u, (z, r, t), tangents)  # type: ignore[misc]
        target = (v - (t - r)[:, None] * dudt).detach()
        value: torch.Tensor = (out - target).pow(2).sum(1).mean()
        return value

    return loss


def step_fns(rank: int, *, compiled: bool) -> tuple[dict[str, Callable[[], None]], int]:
    """The steps to compare, and how many buckets fdp's DDP has."""
    g = torch.Generator().manual_seed(rank)
    batch = (torch.randn(BATCH, 2, generator=g), torch.randn(BATCH, 2, generator=g))
    # Separate tensors: a compiled jvp of a view of one (2, BATCH) tensor trips a torch 2.13
    # internal assert (forward-mode view layouts).
    r, t = (row.clone() for row in torch.rand(2, BATCH, generator=g).sort(0).values)
    params, own = make_params(), make_params()  # the local steps step their own copy
    leaves = [t for layer in params for t in layer.values()]
    ddp = fdp.DistributedDataParallel(params)
    opt = torch.optim.SGD(leaves, lr=1e-4)
    own_opt = torch.optim.SGD([t for layer in own for t in layer.values()], lr=1e-4)
    flat = torch.cat([t.detach().reshape(-1) for t in leaves])

    def sgd(
        loss: Loss, *, then_all_reduce: bool = False, local: bool = False
    ) -> Callable[[], None]:
        tree, optimizer = (own, own_opt) if local else (params, opt)

        def step() -> None:
            optimizer.zero_grad()
            torch.autograd.backward(loss(tree, *batch, r, t))
            if then_all_reduce:
                dist.all_reduce(flat)
            optimizer.step()

        return step

    def local(p: Params) -> Params:
        return p

    fns = {
        "fdp, ddp(params) inside jvp": sgd(meanflow(ddp, inside=True)),
        "fdp, ddp(params) outside jvp": sgd(meanflow(ddp, inside=False)),
        "local (no data parallelism)": sgd(meanflow(local, inside=True), local=True),
        "local, then one flat all-reduce": sgd(
            meanflow(local, inside=True), then_all_reduce=True, local=True
        ),
    }
    if compiled:
        fns["fdp inside jvp, compiled"] = sgd(
            torch.compile(meanflow(ddp, inside=True), fullgraph=True)
        )
        fns["local, compiled"] = sgd(
            torch.compile(meanflow(local, inside=True), fullgraph=True), local=True
        )
    return fns, len(ddp.buckets)


def run(rank: int, size: int, port: int, quick: bool, compiled: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=600),
    )
    say = print if rank == 0 else (lambda *a, **k: None)
    fns, buckets = step_fns(rank, compiled=compiled)
    for fn in fns.values():
        fn()  # compiles, allocates
    ms = {
        k: v * 1e3
        for k, v in interleaved(fns, rounds=5 if quick else 11, repeats=3 if quick else 6).items()
    }
    mb = sum(t.numel() for layer in make_params() for t in layer.values()) * 4 / 1e6
    say(f"torch {torch.__version__}, {size} gloo ranks on 127.0.0.1, 1 intra-op thread each")
    say(f"MeanFlow step, {DEPTH}x{WIDTH} SiLU MLP ({mb:.1f} MB of gradients in {buckets} buckets), "
        f"batch {BATCH}/rank:")  # fmt: skip
    for name, value in ms.items():
        say(f"  {name:34s} {value:7.1f} ms")
    inside, outside = ms["fdp, ddp(params) inside jvp"], ms["fdp, ddp(params) outside jvp"]
    local, then = ms["local (no data parallelism)"], ms["local, then one flat all-reduce"]
    say(f"inside / outside jvp: {inside / outside:.3f}x (target <= 1.05x)")
    say(f"inside / local, then all-reduce: {inside / then:.3f}x (target <= 1.1x)")
    say(f"inside / local (the cost of data parallelism): {inside / local:.3f}x")
    if compiled:
        c, lc = ms["fdp inside jvp, compiled"], ms["local, compiled"]
        say(f"compiled: fdp {c:.1f} ms / local {lc:.1f} ms -> {c / lc:.3f}x; "
            f"vs eager fdp {c / inside:.3f}x")  # fmt: skip
    if rank == 0:
        results.record("bench_meanflow", figures(ms))
    dist.destroy_process_group()


def figures(ms: dict[str, float]) -> dict[str, float]:
    """The ratios the pages quote, by name."""
    inside = ms["fdp, ddp(params) inside jvp"]
    got = {
        "inside_vs_outside": inside / ms["fdp, ddp(params) outside jvp"],
        "inside_vs_local_then_all_reduce": inside / ms["local, then one flat all-reduce"],
        "inside_vs_local": inside / ms["local (no data parallelism)"],
    }
    if "fdp inside jvp, compiled" in ms:
        got["compiled_vs_eager"] = ms["fdp inside jvp, compiled"] / inside
        got["compiled_vs_local_compiled"] = ms["fdp inside jvp, compiled"] / ms["local, compiled"]
    return got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--compile", action="store_true", help="add the compiled variants")
    args = parser.parse_args()
    run_ranks(run, 2, args.quick, args.compile)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
