"""A fault-tolerant step's cost: fdp.FaultTolerance (torchft) against plain fdp, side by side.

Two processes are two replica groups of a torchft job (a lighthouse in this
process) and, at the same time, the two ranks of a plain gloo group. Each
runs the training step of ``bench_ddp_step.py`` (8-layer 1024-wide tanh MLP,
33.6 MB of float32 gradients, batch 64 per process) with AdamW, both ways,
interleaved round by round (median over rounds):

- plain: ``torch.func.grad``, ``fdp.all_reduce_grads`` on the gloo group,
  ``fdp.optim.adamw``'s ``update``;
- fault-tolerant: the same inside ``FaultTolerance.step``: a quorum through
  the lighthouse, the average through torchft's process group, the error
  exchange and ``should_commit``.

The ratio is what per-step fault tolerance costs on this machine.

    python benchmarks/bench_fault_tolerance.py [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
from typing import Any

import results
import torch
import torch.distributed as dist
from bench_ddp_step import data, make_params, mlp
from timing import interleaved

import fdp

PLAIN, FT = "fdp.all_reduce_grads (gloo)", "FaultTolerance.step (torchft)"


def worker(rank: int, port: int, lighthouse: str, rounds: int, out: Any) -> None:
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=120)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timeout
    )
    ft = fdp.FaultTolerance.connect(lighthouse, replica_id=f"bench_{rank}", min_replicas=2)
    x, y = data(rank)
    opt = fdp.optim.adamw(1e-4)
    # Plain tensors, as torch.func.grad takes them (leaves that require grad would
    # make fdp.optim's update differentiable, recording a graph through the steps).
    params = [{k: v.detach() for k, v in layer.items()} for layer in make_params(0)]
    state: dict[str, Any] = {"plain": (params, opt.init(params))}
    state["ft"] = state["plain"]

    def loss(p: Any) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(mlp(p, x), y)

    def plain() -> None:
        p, s = state["plain"]
        state["plain"] = opt.update(fdp.all_reduce_grads(torch.func.grad(loss)(p)), s, p)

    def fault_tolerant() -> None:
        def step(t: Any) -> Any:
            p, s = t
            return opt.update(ft.all_reduce_grads(torch.func.grad(loss)(p)), s, p)

        state["ft"] = ft.step(step, state["ft"])

    times = interleaved({PLAIN: plain, FT: fault_tolerant}, rounds=rounds, repeats=3)
    if rank == 0:
        out.put(times)
    dist.barrier()
    ft.shutdown()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    args = parser.parse_args()
    from torchft._torchft import LighthouseServer

    from tests.ranks import free_port

    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=2)
    lighthouse = "http://127.0.0.1:" + server.address().rsplit(":", 1)[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    os.environ.pop("MASTER_ADDR", None)  # each replica group of one process makes its store
    procs = [
        ctx.Process(target=worker, args=(r, port, lighthouse, 4 if args.quick else 10, out))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    times = out.get(timeout=1800)
    for p in procs:
        p.join(120)
    server.shutdown()
    for name, t in times.items():
        print(f"{name}: {t * 1e3:.1f} ms per step")
    ratio = times[FT] / times[PLAIN]
    print(f"fault-tolerant / plain: {ratio:.3f}x")
    print(json.dumps({"plain_ms": times[PLAIN] * 1e3, "ft_ms": times[FT] * 1e3, "ratio": ratio}))
    figures = {"plain_ms": times[PLAIN] * 1e3, "ft_ms": times[FT] * 1e3}
    results.record("bench_fault_tolerance", figures | {"vs_plain": ratio})


if __name__ == "__main__":
    main()
