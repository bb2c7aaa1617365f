"""Where a DDP step's time goes: forward, backward and optimizer, torch DDP against fdp DDP.

The same Hugging Face models as ``bench_models_step.py`` (GPT-2 and Llama
from configs, 2 gloo ranks, one intra-op thread each, glibc's allocator at
its defaults, as there), three ways, each step split into its phases:

- the module alone: ``model(...).loss.backward()``, no communication;
- torch DDP: ``DistributedDataParallel(model)``;
- fdp DDP: ``fn(ddp(state))`` (``make_functional``), ``loss.backward()``.

Each takes ``torch.optim.AdamW(foreach=True)``. Every round runs one step
of each, in rotating order, after a barrier; the figures are medians over
rounds, and the differences (fdp DDP minus torch DDP, and each DDP minus the
module alone) are medians of each round's difference. What the backward
adds over the module alone is the reduction: packing the gradients, the
all-reduces (gloo on this machine's two cores) and the wait for the last
bucket, which nothing overlaps.

    python benchmarks/bench_ddp_phases.py [--quick] [--models gpt2,llama]
    python benchmarks/bench_ddp_phases.py --bucket-cap-mb 0.5

With ``--bucket-cap-mb``, torch DDP and fdp DDP run again with buckets of
that many MiB, in the same rotation (each against its default buckets, and
fdp's against torch's); such a run records nothing.

The last line is one JSON object: ``{"rows": [...]}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import results
import torch
import torch.distributed as dist
from bench_models_step import SIZE, batch, build, over_ranks, parsed

import fdp

PHASES = ("forward", "backward", "optimizer")
ALONE = "module alone"
Phased = Callable[[], tuple[float, float, float]]


def phased(
    forward: Callable[[], torch.Tensor],
    params: list[torch.Tensor],
    *,
    optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None = None,
) -> Phased:
    """A training step that returns the seconds of its forward, backward and optimizer step.

    ``optimizer(params)`` makes the optimizer; by default AdamW (foreach).
    """
    opt = (optimizer or _adamw)(params)
    clock = time.perf_counter

    def step() -> tuple[float, float, float]:
        start = clock()
        loss = forward()
        forwarded = clock()
        torch.autograd.backward(loss)
        backwarded = clock()
        opt.step()
        opt.zero_grad()
        return forwarded - start, backwarded - forwarded, clock() - backwarded

    return step


def _adamw(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4, foreach=True)


def ddp_pair(name: str, ids: torch.Tensor, **caps: Any) -> tuple[Phased, Phased]:
    """torch DDP's and fdp DDP's steps, each on a model of its own; ``caps``: bucket sizes."""
    model = build(name)
    ddp: Any = torch.nn.parallel.DistributedDataParallel(model, **caps)
    fn, state = fdp.make_functional(build(name))
    fdp_ddp = fdp.DistributedDataParallel(state, **caps)
    trained = [t for t in state.values() if t.requires_grad]
    return (
        phased(lambda: ddp(input_ids=ids, labels=ids).loss, list(model.parameters())),
        phased(lambda: fn(fdp_ddp(state), input_ids=ids, labels=ids).loss, trained),
    )


def methods(name: str, ids: torch.Tensor, cap: float | None) -> dict[str, Phased]:
    """The three steps; with ``cap``, both DDPs again with buckets of ``cap`` MiB."""
    alone = build(name)
    steps = {ALONE: phased(
        lambda: alone(input_ids=ids, labels=ids).loss, list(alone.parameters())
    )}  # fmt: skip
    steps["torch DDP"], steps["fdp DDP"] = ddp_pair(name, ids)
    if cap is not None:
        capped = ddp_pair(name, ids, bucket_cap_mb=cap)
        steps[f"torch DDP {cap} MiB"], steps[f"fdp DDP {cap} MiB"] = capped
    return steps


def rotate(
    steps: dict[str, Phased], rounds: int, *, before: Callable[[], object] = lambda: None
) -> dict[str, list[tuple[float, float, float]]]:
    """One step of each per round, in rotating order, ``before`` each; three rounds warm up."""
    names = list(steps)
    times: dict[str, list[tuple[float, float, float]]] = {n: [] for n in names}
    for r in range(rounds + 3):
        for j in range(len(names)):
            method = names[(r + j) % len(names)]
            before()
            phases = steps[method]()
            if r >= 3:
                times[method].append(phases)
    return times


def measure(rank: int, name: str, args: Any) -> dict[str, list[tuple[float, float, float]]]:
    steps = methods(name, batch(rank), args.bucket_cap_mb)
    return rotate(steps, args.rounds, before=dist.barrier)


def _median_ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1e3, 2)


def method_rows(
    times: dict[str, list[tuple[float, float, float]]], **fields: Any
) -> list[dict[str, Any]]:
    """Each method's median phases and step, in a row with ``fields``."""
    rows = []
    for method, steps in times.items():
        row = {**fields, "method": method}
        for p, phase in enumerate(PHASES):
            row[f"{phase}_ms"] = _median_ms([s[p] for s in steps])
        row["step_ms"] = _median_ms([sum(s) for s in steps])
        rows.append(row)
    return rows


def rows_of(name: str, times: dict[str, list[tuple[float, float, float]]]) -> list[dict[str, Any]]:
    """Each method's phases, then each comparison's per-round differences."""
    rows = method_rows(times, model=name, ranks=SIZE)
    compared = [("fdp DDP", "torch DDP"), ("torch DDP", ALONE), ("fdp DDP", ALONE)]
    capped = [m for m in times if m.endswith(" MiB")]  # torch's, then fdp's
    if capped:
        compared += [(capped[0], "torch DDP"), (capped[1], "fdp DDP"), (capped[1], capped[0])]
    for method, reference in compared:
        pairs = list(zip(times[method], times[reference], strict=True))
        row = {"model": name, "ranks": SIZE, "method": f"{method} minus {reference}"}
        for p, phase in enumerate(PHASES):
            row[f"{phase}_ms"] = _median_ms([a[p] - b[p] for a, b in pairs])
        row["step_ms"] = _median_ms([sum(a) - sum(b) for a, b in pairs])
        rows.append(row)
    return rows


def figures(row: dict[str, Any]) -> dict[str, float]:
    """One row's figures, as ``gpt2.fdp_ddp_minus_torch_ddp.backward_ms``."""
    prefix = f"{row['model']}.{results.slug(row['method'])}"
    keys = [f"{phase}_ms" for phase in PHASES] + ["step_ms"]
    return {f"{prefix}.{k}": row[k] for k in keys}


def main() -> None:
    args = parsed(__doc__, rounds=(15, 100))
    extra = argparse.ArgumentParser()
    extra.add_argument("--bucket-cap-mb", type=float, default=None)
    args.bucket_cap_mb = extra.parse_known_args()[0].bucket_cap_mb
    rows = [row for got in over_ranks(measure, args) for row in rows_of(*got)]
    for row in rows:
        sign = "+" if " minus " in row["method"] else ""
        phases = "  ".join(f"{phase} {row[f'{phase}_ms']:{sign}7.2f}" for phase in PHASES)
        print(f"{row['model']} {row['method']:>34}: {phases}  step {row['step_ms']:{sign}7.2f} ms",
              file=sys.stderr)  # fmt: skip
    print(json.dumps({"rows": rows}))
    if args.bucket_cap_mb is not None:  # an experiment: the record is the default run's
        return
    results.record("bench_ddp_phases", {k: v for row in rows for k, v in figures(row).items()})


if __name__ == "__main__":
    main()
