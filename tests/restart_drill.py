"""The fault drill of ``tests/test_checkpoint.py``: ZeRO training that survives a SIGKILL.

Run under ``torchrun --nproc_per_node=2 --max-restarts=1``. Trains 12 steps
(each rank draws its batch from its own global RNG, so a resume must
restore the RNG states too), checkpoints every 3 steps, and with
``--kill-at K`` SIGKILLs rank 1 after step K of the first attempt. torchrun
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--kill-at", type=int, default=0)
    args = parser.parse_args()
    fdp.init_distributed("gloo", timeout=datetime.timedelta(seconds=30))
    rank = dist.get_rank()
    torch.manual_seed(100 + rank)
    params = tree()
    zero = fdp.ZeroRedundancy(fdp.optim.adamw(0.01), params)
    state: dict[str, Any] = {"params": params, "opt": zero.init(params), "step": 0}
    found = fdp.latest_checkpoint(args.dir)  # the newest complete one, rank 0's pick
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
            fdp.save_checkpoint(args.dir / f"step_{step + 1}", checkpoint)
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if step + 1 == args.kill_at and rank == 1 and first_attempt:
            os.kill(os.getpid(), signal.SIGKILL)
    fdp.save_checkpoint(args.dir / "final", {"params": params, "step": STEPS}, rng=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
