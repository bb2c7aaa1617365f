"""The fault drill of ``tests/test_checkpoint.py``: ZeRO training that survives a SIGKILL.

Run under ``torchrun --nproc_per_node=2 --max-restarts=1``. Trains 12 steps
(each rank draws its batch from its own global RNG, so a resume must
restore the RNG states too), checkpoints every 3 steps, and with
``--kill-at K`` SIGKILLs rank 1 after step K of the first attempt; with
``--kill-in-save K --kill-rank R``, rank R dies inside the save of step K,
once its data files are written and before the save completes. With
``--last`` every checkpoint is saved over one path, ``DIR/last``. torchrun
then restarts both ranks, which resume from the latest complete
checkpoint. The final parameters go to ``DIR/final``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import fdp

STEPS, EVERY = 12, 3


def tree() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w1": torch.randn(6, 16, generator=g) / 6**0.5,
        "b1": torch.zeros(16),
        "w2": torch.randn(16, 3, generator=g) / 4,
    }


def loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(x @ params["w1"] + params["b1"])
    return torch.nn.functional.mse_loss(h @ params["w2"], y)


def first_attempt() -> bool:
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


def kill_in_save(step: int, rank: int, saving: list[int]) -> None:
    """Rank ``rank`` dies once its files of the save of step ``step`` are written."""
    from torch.distributed.checkpoint import filesystem

    write_data = filesystem.FileSystemWriter.write_data

    def dying(self: Any, plan: Any, planner: Any) -> Any:
        written = write_data(self, plan, planner)
        written.wait()
        if saving[0] == step and dist.get_rank() == rank and first_attempt():
            os.kill(os.getpid(), signal.SIGKILL)
        return written

    filesystem.FileSystemWriter.write_data = dying  # type: ignore[method-assign]


def resume_from(args: argparse.Namespace) -> str | None:
    if not args.last:
        return fdp.latest_checkpoint(args.dir)  # the newest complete one, rank 0's pick
    last = args.dir / "last"
    return str(last) if (last / ".metadata").is_file() else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--kill-at", type=int, default=0)
    parser.add_argument("--kill-in-save", type=int, default=0)
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--last", action="store_true")
    args = parser.parse_args()
    saving = [0]
    if args.kill_in_save:
        kill_in_save(args.kill_in_save, args.kill_rank, saving)
    fdp.init_distributed("gloo", timeout=datetime.timedelta(seconds=30))
    rank = dist.get_rank()
    torch.manual_seed(100 + rank)
    params = tree()
    zero = fdp.ZeroRedundancy(fdp.optim.adamw(0.01), params)
    state: dict[str, Any] = {"params": params, "opt": zero.init(params), "step": 0}
    found = resume_from(args)
    if found is not None:
        state = fdp.load_checkpoint(found, state)
        if rank == 0:
            (args.dir / f"resumed_from_{state['step']}").touch()
    params, opt = state["params"], state["opt"]
    for step in range(state["step"], STEPS):
        x, y = torch.randn(8, 6), torch.randn(8, 3)
        params, opt = zero.step(torch.func.grad(loss)(params, x, y), opt, params)
        if (step + 1) % EVERY == 0:
            checkpoint = {"params": params, "opt": opt, "step": step + 1}
            saving[0] = step + 1
            fdp.save_checkpoint(
                args.dir / ("last" if args.last else f"step_{step + 1}"), checkpoint
            )
            saving[0] = 0
        if step + 1 == args.kill_at and rank == 1 and first_attempt():
            os.kill(os.getpid(), signal.SIGKILL)
    fdp.save_checkpoint(args.dir / "final", {"params": params, "step": STEPS}, rng=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
