"""fdp.ZeroRedundancy on 2 gloo ranks (1 intra-op thread each), ratios from one run.

The training step of ``bench_distributed.py`` (8-layer 1024-wide tanh MLP,
10-way head, batch 64 per rank) with AdamW, every variant interleaved round
by round (median over rounds):

- fdp ZeRO-2 (also with ``donate=True``) and ZeRO-1: ``torch.func.grad``,
  then ``zero.step``;
- fdp DDP + AdamW: ``torch.func.grad``, ``fdp.all_reduce_grads``, then
  ``fdp.optim.adamw``'s ``update``;
- torch DDP + ``ZeroRedundancyOptimizer(AdamW)``, and torch DDP + AdamW
  (both ``foreach``), as modules with ``.backward()``.

Targets: fdp ZeRO <= 1.1x fdp DDP + AdamW in time and <= torch's
ZeroRedundancyOptimizer; optimizer state per rank 1/world of DDP's
(summed tensor bytes, printed).

    python benchmarks/bench_zero.py [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import os
from typing import Any

import optree
import results
import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_ddp_step import CLASSES, DEPTH, WIDTH, data, make_params, mlp
from timing import interleaved, run_ranks
from torch.distributed.optim import ZeroRedundancyOptimizer

import fdp

LR = 1e-3


def state_bytes(tree: Any) -> int:
    if isinstance(tree, fdp.ZeroState):
        tree = tree.slots
    leaves = optree.tree_leaves(tree)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


def functional_steps(rank: int) -> tuple[dict[str, Any], dict[str, int]]:
    """The fdp variants, each over its own copy of the parameters."""
    x, y = data(rank)

    def loss(p: Any) -> torch.Tensor:
        return F.cross_entropy(mlp(p, x), y)

    grad = torch.func.grad(loss)
    fns: dict[str, Any] = {}
    memory: dict[str, int] = {}
    for stage, donate in ((2, False), (2, True), (1, False)):
        params = optree.tree_map(torch.Tensor.detach, make_params(0))  # type: ignore[arg-type]
        zero = fdp.ZeroRedundancy(fdp.optim.adamw(LR), params, stage=stage)
        box = [params, zero.init(params)]
        name = f"fdp ZeRO-{stage}" + (", donate=True" if donate else "")
        memory[name] = state_bytes(box[1])

        def zero_step(box: list[Any] = box, zero: Any = zero, donate: bool = donate) -> None:
            box[0], box[1] = zero.step(grad(box[0]), box[1], box[0], donate=donate)

        fns[name] = zero_step
    params = optree.tree_map(torch.Tensor.detach, make_params(0))  # type: ignore[arg-type]
    opt = fdp.optim.adamw(LR)
    ddp_box: list[Any] = [params, opt.init(params)]
    memory["fdp DDP + AdamW"] = state_bytes(ddp_box[1])

    def ddp_step() -> None:
        grads = fdp.all_reduce_grads(grad(ddp_box[0]))
        ddp_box[0], ddp_box[1] = opt.update(grads, ddp_box[1], ddp_box[0])

    fns["fdp DDP + AdamW"] = ddp_step
    return fns, memory


def torch_steps(rank: int) -> tuple[dict[str, Any], dict[str, int]]:
    x, y = data(rank)
    fns: dict[str, Any] = {}
    optims: dict[str, Any] = {}
    for name in ("torch DDP + ZeroRedundancyOptimizer", "torch DDP + AdamW"):
        layers: list[torch.nn.Module] = []
        for _ in range(DEPTH):
            layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
        layers.append(torch.nn.Linear(WIDTH, CLASSES))
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*layers))
        if "Zero" in name:
            opt: Any = ZeroRedundancyOptimizer(
                model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR, foreach=True
            )
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
        optims[name] = opt

        def step(model: Any = model, opt: Any = opt) -> None:
            opt.zero_grad()
            torch.autograd.backward(F.cross_entropy(model(x), y))
            opt.step()

        step()  # torch's optimizers make their state on the first step
        fns[name] = step
    memory = {
        name: state_bytes(list((opt.optim if "Zero" in name else opt).state.values()))
        for name, opt in optims.items()
    }
    return fns, memory


def run(rank: int, size: int, port: int, quick: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
        timeout=datetime.timedelta(seconds=300),
    )  # fmt: skip
    fdp_fns, memory = functional_steps(rank)
    torch_fns, torch_memory = torch_steps(rank)
    fns, memory = {**fdp_fns, **torch_fns}, {**memory, **torch_memory}
    times = interleaved(fns, rounds=4 if quick else 10, repeats=3, sync=dist.barrier)
    if rank == 0:
        base, theirs = times["fdp DDP + AdamW"], times["torch DDP + ZeroRedundancyOptimizer"]
        print(f"AdamW step, {size} gloo ranks, MLP {DEPTH}x{WIDTH} (rank 0's figures)")
        print(f"{'variant':40} {'ms/step':>8} {'/ fdp DDP':>10} {'/ torch ZeRO':>13} {'opt MB':>8}")
        for name, t in times.items():
            print(
                f"{name:40} {1e3 * t:8.1f} {t / base:10.2f} {t / theirs:13.2f} "
                f"{memory[name] / 2**20:8.1f}"
            )
        figures = {f"{results.slug(n)}.vs_fdp_ddp": t / base for n, t in times.items()}
        figures |= {f"{results.slug(n)}.vs_torch_zero": t / theirs for n, t in times.items()}
        results.record("bench_zero", figures)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--ranks", type=int, default=2)
    args, _ = parser.parse_known_args()
    run_ranks(run, args.ranks, args.quick)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
