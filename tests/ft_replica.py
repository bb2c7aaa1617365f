"""One replica group of the fault-tolerance drill of ``tests/test_fault_tolerance.py``.

Run as ``python -m tests.ft_replica --lighthouse ADDR --replica R --dir DIR``
(one process per replica group). Trains a small regression with AdamW and a
warm-up schedule through :class:`fdp.FaultTolerance`; each replica group's
batch at a step is drawn from (data position, replica), and the data
position is part of the training state, so a healed replica continues the
peers' stream. Every attempted step appends one line to ``DIR/ledger-R``:
the step before it, whether it was committed, how many replica groups
took part and the attempting process's pid; the last line is ``done``.
``--kill-at K --killer R`` SIGKILLs replica group R (every process of it:
the drill starts each group in a Unix process group of its own) inside its
first step at or after step K that follows a committed step of its own,
mid-step (the peers' all-reduce is waiting for it), unless ``--restarted``;
``--error-at J`` injects an error into this replica group's all-reduce at
step J. The final state goes to ``DIR/final-R.pt``.

The drill stops on the same step everywhere: the first committed step at
or after ``--steps`` that all ``--replicas`` took part in, once a step
after the kill ran without them (counted in the state, healed with it).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import fdp

REPLICAS = 3
STEPS = 12
MAX_STEPS = 20000


def init_params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w1": torch.randn(6, 16, generator=g) / 6**0.5,
        "b1": torch.zeros(16),
        "w2": torch.randn(16, 3, generator=g) / 4,
    }


def batch(position: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * position + replica)
    x = torch.randn(8, 6, generator=g)
    return x, torch.sin(x[:, :3]) + 0.1 * torch.randn(8, 3, generator=g)


def loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(x @ params["w1"] + params["b1"])
    return torch.nn.functional.mse_loss(h @ params["w2"], y)


def optimizer() -> fdp.optim.Optimizer:
    return fdp.optim.adamw(fdp.optim.linear_schedule(0.0, 0.02, 5), weight_decay=0.01)


def initial_state() -> dict[str, Any]:
    params = init_params()
    return {"params": params, "opt": optimizer().init(params), "data": 0, "shrunk": 0}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--replica", type=int, required=True)
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--killer", type=int, default=-1)
    parser.add_argument("--restarted", action="store_true")
    parser.add_argument("--error-at", type=int, default=-1)
    parser.add_argument("--replicas", type=int, default=REPLICAS)
    parser.add_argument("--diloco", action="store_true")
    parser.add_argument("--streaming", action="store_true", help="with --diloco: fragments")
    parser.add_argument("--overlap", type=int, default=0, help="with --streaming")
    parser.add_argument("--ddp", action="store_true")
    parser.add_argument("--group-size", type=int, default=1)
    parser.add_argument("--group-rank", type=int, default=0)
    parser.add_argument("--group-port", type=int, default=0)
    args = parser.parse_args()
    args.suffix = f".{args.group_rank}" if args.group_rank else ""
    args.worker = args.replica * args.group_size + args.group_rank
    torch.manual_seed(1234 + args.worker)  # a healed replica must not need this
    if not args.restarted:
        _barrier(args.dir, args.replica, args.replicas, args.group_size, args.suffix)
    fsdp = _replica_group(args) if args.group_size > 1 else None
    import torchft

    # Generous: a loaded machine's process group setup and quorums take seconds; a
    # lost peer is noticed at once (its connections close), never by a timeout.
    pg = _flaky(torchft.ProcessGroupGloo)(timeout=timedelta(seconds=30))
    ft = fdp.FaultTolerance.connect(
        args.lighthouse,
        replica_id=f"replica_{args.replica}",
        min_replicas=2,
        timeout=timedelta(seconds=60),
        pg=pg,
        init_sync=not args.diloco,
        group_rank=args.group_rank,
        group_world_size=args.group_size,
    )
    if args.diloco:
        from tests import ft_diloco

        ft_diloco.run(ft, args, _kill_replica_group)
        return
    state, opt = initial_state(), optimizer()
    if fsdp is not None:  # HSDP: sharded inside the replica group, replicated across groups
        state["params"] = fsdp.shard(state["params"])
        state["opt"] = opt.init(state["params"])
    reduce = (
        _ddp_grads(ft)
        if args.ddp
        else lambda params, x, y: ft.all_reduce_grads(
            torch.func.grad(lambda p: loss(p if fsdp is None else fsdp(p), x, y))(params)
        )
    )
    ledger = (args.dir / f"ledger-{args.replica}{args.suffix}").open("a")
    seen: dict[str, Any] = {}

    def train_step(s: dict[str, Any]) -> dict[str, Any]:
        step = seen["step"] = ft.current_step()
        seen["participants"] = ft.participants()
        # Once it has taken part in a step: a group that started late (a loaded machine)
        # and healed first dies in a later step, never before its first life counted.
        lived = seen.get("lived", 0) > 0
        if args.replica == args.killer and not args.restarted and step >= args.kill_at and lived:
            _kill_replica_group()
        x, y = batch(s["data"], args.worker)
        if step == args.error_at and not seen.get("injected"):
            pg.armed = seen["injected"] = True
        grads = reduce(s["params"], x, y)
        params, opt_state = opt.update(grads, s["opt"], s["params"])
        after_kill = args.kill_at >= 0 and step > args.kill_at
        shrunk = s["shrunk"] + int(after_kill and seen["participants"] < args.replicas)
        return {"params": params, "opt": opt_state, "data": s["data"] + 1, "shrunk": shrunk}

    while True:
        state = ft.step(train_step, state)
        committed = ft.current_step() > seen["step"]
        seen["lived"] = seen.get("lived", 0) + int(committed)
        record = {"step": seen["step"], "committed": committed, "n": seen["participants"]}
        record["pid"] = os.getpid()  # which life of the group's process attempted it
        ledger.write(json.dumps(record) + "\n")
        ledger.flush()
        done = (
            committed and seen["step"] + 1 >= args.steps and seen["participants"] == args.replicas
        )
        if (done and (args.kill_at < 0 or state["shrunk"] > 0)) or seen["step"] > MAX_STEPS:
            break
    if fsdp is not None:  # every rank of the group takes part in gathering the whole tree
        state["full"] = fsdp.full(state["params"])
    torch.save(state, args.dir / f"final-{args.replica}{args.suffix}.pt")
    ledger.write("done\n")
    ledger.close()
    ft.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()


def _ddp_grads(ft: fdp.FaultTolerance) -> Any:
    """fdp's DDP in a replica group of one process, its buckets averaged through the manager."""
    store: Any = dist.HashStore()  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    ddp = fdp.DistributedDataParallel(init_params(), bucket_cap_mb=1e-4)  # several buckets
    ddp.register_comm_hook(ft, fdp.FaultTolerance.comm_hook)

    def grads(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> Any:
        leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
        loss(ddp(leaves), x, y).backward()  # type: ignore[no-untyped-call]
        return {k: v.grad for k, v in leaves.items()}

    return grads


def _flaky(base: Any) -> Any:
    """torchft's gloo group whose next all-reduce, once armed, fails here (it ran everywhere)."""

    class Flaky(base):  # type: ignore[misc]
        armed = False

        def allreduce(self, tensors: Any, opts: Any) -> Any:
            work = super().allreduce(tensors, opts)
            if not self.armed:
                return work
            self.armed = False
            work.wait()
            raise RuntimeError("injected by the drill: this replica group's all-reduce failed")

    return Flaky


def _replica_group(args: argparse.Namespace) -> fdp.FullyShardedDataParallel:
    """This replica group's process group (its own store, torchrun's way) and FSDP inside it."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.group_port))
    os.environ.update(RANK=str(args.group_rank), WORLD_SIZE=str(args.group_size))
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    return fdp.FullyShardedDataParallel(init_params())


def _kill_replica_group() -> None:
    """SIGKILLs this replica group's processes at once, as a lost machine (the drill starts
    each group in a Unix process group of its own; otherwise this process alone)."""
    mine = os.getpgrp()
    if mine != os.getpgid(os.getppid()):  # never the launcher's group
        os.killpg(mine, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _barrier(where: Path, replica: int, replicas: int, size: int, suffix: str) -> None:
    """Every replica group's processes start their managers together (a restart does not wait)."""
    (where / f"ready-{replica}{suffix}").touch(exist_ok=True)
    while len(list(where.glob("ready-*"))) < replicas * size:
        time.sleep(0.05)


if __name__ == "__main__":
    main()
    # The drill waits for this exit: without it, the interpreter's exit collects every
    # object torch made (about a second of CPU a process).
    gc.freeze()
