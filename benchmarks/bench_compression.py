"""Fewer bytes on the wire: bf16 reductions with float32 sums against float32, side by side.

The training step of ``bench_ddp_step.py`` (8-layer 1024-wide tanh MLP, 33.6 MB
of float32 parameters, batch 64 per rank, SGD), on 2 gloo ranks (1 intra-op
thread each), every variant in the same processes, interleaved round by round:

- DDP: ``fdp.DistributedDataParallel`` with the default hook (float32), with
  ``bf16_compress_hook`` (bf16 on the wire, summed in bf16) and with
  ``bf16_wire_hook`` (bf16 on the wire, summed in float32);
- fully sharded: ``FullyShardedDataParallel`` with float32 reduce-scatters,
  with ``reduce_dtype=torch.bfloat16, sum_dtype=torch.float32``, and with
  ``gather_dtype=torch.int8`` (the parameters' all-gather block-wise int8).

Per row: the bytes each rank sends per step against the float32 variant's
(counted at every collective fdp issues, with the ring algorithms' volumes:
an all-reduce sends ``2 (w-1)/w`` of its buffer, a reduce-scatter, an
all-gather and an all-to-all ``(w-1)/w`` of the whole), the step time
against float32's, and the relative difference of the loss after the same
steps on the same data. Every row's ``bytes_vs_fp32`` is the bytes of the
collectives its option changes: the int8 row's, the parameters' all-gathers;
the bf16 rows', the gradients' reductions (everything but those all-gathers).
``step_bytes_vs_fp32`` is the whole step's. The last line is one JSON object
``{"rows": [...]}``.

    python benchmarks/bench_compression.py [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import json
from collections.abc import Callable
from typing import Any

import results
import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_ddp_step import data, make_params, mlp
from timing import interleaved, run_ranks

import fdp
from fdp import _compat

LR = 0.05
SENT = {"bytes": 0.0, "gather": 0.0}  # all collectives; the parameters' all-gathers


def _count(name: str, factor: Callable[[int], float], fn: Any, arg: int = 0) -> Any:
    """``fn`` that first adds what this rank sends to ``SENT`` (argument ``arg``'s bytes)."""

    def counted(*args: Any, **kwargs: Any) -> Any:
        t = args[arg]
        tensors = t if isinstance(t, list) else [t]
        size = sum(x.numel() * x.element_size() for x in tensors)
        sent = factor(dist.get_world_size(kwargs.get("group"))) * size
        SENT["bytes"] += sent
        SENT["gather"] += sent if name == "all_gather_single" else 0.0
        return fn(*args, **kwargs)

    counted.__name__ = name
    return counted


def count_bytes() -> None:
    """Wraps the collectives fdp issues eagerly (module attributes, read at each call)."""
    ring = {"all_reduce": lambda w: 2 * (w - 1) / w, "all_to_all_single": lambda w: (w - 1) / w}
    dist.all_reduce = _count("all_reduce", ring["all_reduce"], dist.all_reduce)
    dist.all_to_all_single = _count("a2a", ring["all_to_all_single"], dist.all_to_all_single, 1)
    dist.all_gather = _count("all_gather", lambda w: (w - 1) / w, dist.all_gather)  # the list
    _compat.reduce_scatter_single = _count(
        "reduce_scatter", lambda w: (w - 1) / w, _compat.reduce_scatter_single, 1
    )
    # Into one buffer (argument 0, the whole output): FSDP's gathers and prefetches.
    _compat.all_gather_single = _count(
        "all_gather_single", lambda w: (w - 1) / w, _compat.all_gather_single
    )


def variants(rank: int) -> dict[str, Callable[[], float]]:
    """Each variant's step on its own copy of the parameters; it returns the loss."""
    x, y = data(rank)
    steps: dict[str, Callable[[], float]] = {}
    hooks = {
        "ddp float32": fdp.allreduce_hook,
        "ddp bf16 all-reduce (bf16 sums)": fdp.bf16_compress_hook,
        "ddp bf16 all-reduce fp32 sum": fdp.bf16_wire_hook,
    }
    for name, hook in hooks.items():
        params = make_params(0)
        ddp = fdp.DistributedDataParallel(params, comm_hook=hook)

        def ddp_step(params: Any = params, ddp: Any = ddp) -> float:
            loss = F.cross_entropy(mlp(ddp(params), x), y)
            torch.autograd.backward(loss)
            with torch.no_grad():
                for layer in params:
                    for p in layer.values():
                        p -= LR * p.grad
                        p.grad = None
            return float(loss.detach())

        steps[name] = ddp_step
    policies: dict[str, dict[str, Any]] = {
        "fsdp float32": {},
        "fsdp bf16 reduce-scatter fp32 sum": {
            "reduce_dtype": torch.bfloat16,
            "sum_dtype": torch.float32,
        },
        "fsdp int8 all-gather": {"gather_dtype": torch.int8},
    }
    for name, policy in policies.items():
        full = [{k: v.detach() for k, v in layer.items()} for layer in make_params(0)]
        fsdp = fdp.FullyShardedDataParallel(full, **policy)
        opt = fdp.optim.sgd(LR)
        shards = fsdp.shard(full)
        box = {"shards": shards, "state": opt.init(shards)}

        def fsdp_step(fsdp: Any = fsdp, box: Any = box, opt: Any = opt) -> float:
            grads, loss = torch.func.grad_and_value(lambda s: F.cross_entropy(mlp(fsdp(s), x), y))(
                box["shards"]
            )
            box["shards"], box["state"] = opt.update(grads, box["state"], box["shards"])
            return float(loss.detach())

        steps[name] = fsdp_step
    return steps


def worker(rank: int, size: int, port: int, rounds: int, out: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
        timeout=datetime.timedelta(seconds=300),
    )  # fmt: skip
    count_bytes()
    steps = variants(rank)
    sent, gathered, losses = {}, {}, {}
    for name, step in steps.items():  # the same steps on the same data: the loss after them
        SENT["bytes"] = SENT["gather"] = 0.0
        for _ in range(rounds):
            losses[name] = step()
        sent[name], gathered[name] = SENT["bytes"] / rounds, SENT["gather"] / rounds
    times = interleaved(steps, rounds=rounds, repeats=2)
    if rank == 0:
        out.put({"sent": sent, "gathered": gathered, "losses": losses, "times": times})
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and rounds")
    args = parser.parse_args()
    import multiprocessing as mp

    queue = mp.get_context("spawn").Queue()
    run_ranks(worker, 2, 4 if args.quick else 12, queue)
    got = queue.get(timeout=60)
    rows = []
    for name in got["times"]:
        family = "ddp float32" if name.startswith("ddp") else "fsdp float32"
        step_bytes = got["sent"][name] / got["sent"][family]
        gather = "int8" in name  # what the option changes: the all-gathers
        reduced = {k: got["sent"][k] - got["gathered"][k] for k in (name, family)}
        row = {
            "name": name,
            "bytes_vs_fp32": got["gathered"][name] / got["gathered"][family]
            if gather
            else reduced[name] / reduced[family],
            "step_bytes_vs_fp32": step_bytes,
            "step_vs_fp32": got["times"][name] / got["times"][family],
            "loss_rel_diff": abs(got["losses"][name] - got["losses"][family])
            / got["losses"][family],
        }
        rows.append(row)
        what = "all-gather bytes" if gather else "reduction bytes"
        print(
            f"{name}: {what} {row['bytes_vs_fp32']:.3f}x (step's {step_bytes:.3f}x), "
            f"step {row['step_vs_fp32']:.3f}x, "
            f"loss after the steps {got['losses'][name]:.6f} (rel. diff {row['loss_rel_diff']:.2e})"
        )
    print(json.dumps({"rows": rows}))
    results.record("bench_compression", {k: v for row in rows for k, v in figures(row).items()})


def figures(row: dict[str, Any]) -> dict[str, float]:
    """One variant's figures the pages quote, as ``fsdp_int8_all_gather.step_vs_fp32``."""
    return {f"{results.slug(row['name'])}.{k}": v for k, v in row.items() if k != "name"}


if __name__ == "__main__":
    main()
