"""fdp's collectives on any tensor against torch's, on 2 gloo ranks (1 intra-op thread each).

For an all-gather of embeddings (as a contrastive loss gathers them) and an
all-reduce, small and large, interleaved round by round (median):

- ``fdp.all_gather`` / ``fdp.all_reduce`` (the agreement exchange, then the
  collective with its rules), forward and forward + backward;
- ``torch.distributed.nn.functional.all_gather`` / ``all_reduce`` (torch's
  differentiable collectives), forward and forward + backward;
- ``dist.all_gather_into_tensor`` / ``dist.all_reduce`` on a copy (no
  derivative: the floor).

The ratios fdp / torch and fdp / floor say what fdp's checks and rules
cost; the agreement's all-reduce of 16 bytes is a fixed latency, so it
shows most on small tensors.

    python benchmarks/bench_collectives.py [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import os
from collections.abc import Callable
from typing import Any

import results
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
from timing import interleaved, run_ranks

import fdp

SIZES = {"small (256 x 32)": (256, 32), "large (4096 x 512)": (4096, 512)}


def torch_gather(t: torch.Tensor) -> torch.Tensor:
    parts: tuple[torch.Tensor, ...] = dist_nn.all_gather(t)  # type: ignore[no-untyped-call]
    return torch.cat(parts)


def torch_reduce(t: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = dist_nn.all_reduce(t)  # type: ignore[no-untyped-call]
    return out


def variants(rows: int, cols: int) -> dict[str, Callable[[], Any]]:
    x = torch.randn(rows, cols, requires_grad=True)
    world = dist.get_world_size()

    def floor_gather() -> Any:
        out = torch.empty(world * rows, cols)
        dist.all_gather_into_tensor(out, x.detach().contiguous())
        return out

    def floor_reduce() -> Any:
        out = x.detach().clone()
        dist.all_reduce(out)
        return out

    def backward(out: torch.Tensor) -> None:
        torch.autograd.backward(out.sum())

    return {
        "all_gather fdp": lambda: fdp.all_gather(x.detach()),
        "all_gather torch.distributed.nn": lambda: torch_gather(x.detach()),
        "all_gather floor": floor_gather,
        "all_gather fdp +bwd": lambda: backward(fdp.all_gather(x)),
        "all_gather torch.distributed.nn +bwd": lambda: backward(torch_gather(x)),
        "all_reduce fdp": lambda: fdp.all_reduce(x.detach()),
        "all_reduce torch.distributed.nn": lambda: torch_reduce(x.detach().clone()),
        "all_reduce floor": floor_reduce,
        "all_reduce fdp +bwd": lambda: backward(fdp.all_reduce(x)),
        "all_reduce torch.distributed.nn +bwd": lambda: backward(torch_reduce(x * 1.0)),
    }


def run(rank: int, size: int, port: int, quick: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
        timeout=datetime.timedelta(seconds=300),
    )  # fmt: skip
    figures: dict[str, float] = {}
    for label, (rows, cols) in SIZES.items():
        fns = variants(rows, cols)
        if rows * cols > 1 << 16:
            times = interleaved(fns, rounds=5 if quick else 15, repeats=5, sync=dist.barrier)
        else:
            # Small: each call timed alone, the order rotating call by call, the median
            # of hundreds (the collectives keep the ranks in step). Rounds of 40 calls
            # caught the machine's drift: torch's path measured below the floor.
            times = interleaved(fns, rounds=150 if quick else 600, repeats=1)
        if rank == 0:
            print(f"{label}, float32, {size} gloo ranks (median us per call):")
            for op in ("all_gather", "all_reduce"):
                fdp_t, torch_t = times[f"{op} fdp"], times[f"{op} torch.distributed.nn"]
                floor_t = times[f"{op} floor"]
                fdp_b = times[f"{op} fdp +bwd"]
                torch_b = times[f"{op} torch.distributed.nn +bwd"]
                print(
                    f"  {op}: fdp {1e6 * fdp_t:8.0f}, torch.distributed.nn {1e6 * torch_t:8.0f}"
                    f", floor {1e6 * floor_t:8.0f} -> fdp / torch {fdp_t / torch_t:.2f}x, "
                    f"fdp / floor {fdp_t / floor_t:.2f}x; with backward fdp {1e6 * fdp_b:8.0f}"
                    f", torch {1e6 * torch_b:8.0f} -> {fdp_b / torch_b:.2f}x"
                )
                key = f"{label.split()[0]}.{op}"
                figures |= {f"{key}.vs_torch": fdp_t / torch_t, f"{key}.vs_floor": fdp_t / floor_t}
                figures[f"{key}.backward_vs_torch"] = fdp_b / torch_b
    if rank == 0:
        results.record("bench_collectives", figures)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    args, _ = parser.parse_known_args()
    run_ranks(run, 2, args.quick)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
