"""What one ``ddp(params)`` call costs: arming 200 leaves, against hooks on plain aliases.

    python benchmarks/bench_ddp_call.py [--quick]

``ddp(params)`` returns, per leaf that requires grad, an alias with a
gradient hook on it; one autograd node makes the aliases of a run of a
bucket's leaves, and runs early in backward (``fdp/_ddp/_reducer.py``). The
tree is 200 leaves (100 of 64x64, 100 of 64) on one gloo rank. Side by
side, interleaved round by round (medians), against the least a node per
leaf can do: an ``aten._unsafe_view`` alias of each leaf with one hook each
(what fdp did before its aliases passed sparse gradients and ran early;
from then until a node made a run's aliases, ``ddp(params)`` sat at this
floor). Target: ``ddp(params)`` under 1 ms. Also timed: the same tree
of ``nn.Parameter`` leaves, called again with the same tensors, which hands
the last call's aliases out again (Note [reused aliases],
``fdp/_ddp/_reuse.py``): what a training loop's every call after the first
costs.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import results
import torch
import torch.distributed as dist
from timing import side_by_side

import fdp

LEAVES = 200


def tree() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    params = {f"w{i}": torch.randn(64, 64, generator=g) for i in range(LEAVES // 2)}
    params |= {f"b{i}": torch.randn(64, generator=g) for i in range(LEAVES // 2)}
    return {k: v.requires_grad_() for k, v in params.items()}


def hooks_on_views(params: dict[str, torch.Tensor]) -> dict[str, Any]:
    def hook(grad: torch.Tensor) -> torch.Tensor:
        return grad

    out = {}
    for k, leaf in params.items():
        alias = torch.ops.aten._unsafe_view.default(leaf, leaf.shape)
        alias.register_hook(hook)
        out[k] = alias
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    args, _ = parser.parse_known_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    params = tree()
    ddp = fdp.DistributedDataParallel(params)
    rounds = 5 if args.quick else 15
    t_ddp, t_floor = side_by_side(
        lambda: ddp(params), lambda: hooks_on_views(params), rounds=rounds, repeats=50
    )
    module = {k: torch.nn.Parameter(v.detach()) for k, v in params.items()}
    ddp_module = fdp.DistributedDataParallel(module)
    t_reused, _ = side_by_side(
        lambda: ddp_module(module), lambda: hooks_on_views(params), rounds=rounds, repeats=50
    )
    print(f"torch {torch.__version__}, {LEAVES} leaves (100 of 64x64, 100 of 64), 1 gloo rank")
    print(
        f"  ddp(params): {1e3 * t_ddp:.3f} ms per call; a node per leaf (an _unsafe_view alias "
        f"+ hook): {1e3 * t_floor:.3f} ms -> {t_ddp / t_floor:.2f}x (target: ddp(params) < 1 ms)"
    )
    print(f"  again with the same nn.Parameters (aliases reused): {1e3 * t_reused:.3f} ms")
    figures = {"call_ms": 1e3 * t_ddp, "node_per_leaf_ms": 1e3 * t_floor}
    figures["reused_call_ms"] = 1e3 * t_reused
    results.record("bench_ddp_call", figures | {"vs_node_per_leaf": t_ddp / t_floor})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
