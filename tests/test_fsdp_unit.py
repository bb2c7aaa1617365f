"""fdp/_sharding/_fsdp_unit.py: each unit's runtime state reads what the unit is doing.

The phases are read from the resharded buffers' storage, so they are checked
against that storage's size at each point of a step, and the step's
gradients against one process on the full batch (``tests/test_fsdp.py``'s
reference).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import fdp
from fdp._sharding._fsdp_unit import Phase
from tests import ranks
from tests.helpers import tree_allclose
from tests.test_fsdp import TOL, applied, data, local_loss, make_params, mine, reference_grad

BLOCKS = ("blocks.0", "blocks.1", "blocks.2")


def _phases(fsdp: fdp.FullyShardedDataParallel) -> dict[str, str]:
    return {name: fsdp._states[name].phase.value for name in BLOCKS}


def _stepped(rank: int, size: int, prefetch: bool) -> Any:
    params = make_params()
    fsdp = fdp.FullyShardedDataParallel(params, prefetch=prefetch)
    x, y = data(size)
    shards = fsdp.shard(params)
    seen: dict[str, Any] = {"before": _phases(fsdp)}
    calls: list[int] = []

    def block(unit: dict[str, torch.Tensor], h: torch.Tensor, probe: Any) -> Any:
        calls.append(len(calls))
        if len(calls) == 3:  # blocks.2's input is blocks.1's output: when its gradient
            # comes, blocks.1's own hook (registered first) has gathered it again.
            h.register_hook(lambda g: seen.update({"in backward": _phases(fsdp)}))  # type: ignore[no-untyped-call]
        return torch.tanh(h @ unit["w"] + unit["b"])

    out = applied(fsdp, shards, mine(x, rank), None, block=block)
    seen["after forward"] = _phases(fsdp)
    loss = (out - mine(y, rank)).square().mean()
    torch.autograd.backward(loss, retain_graph=True)
    seen["after backward (graph kept)"] = _phases(fsdp)
    seen["kept no_sync bytes"] = sum(s.kept_nbytes() for s in fsdp._states.values())
    grads = fsdp.full({k: tuple(_grad(t) for t in ts) for k, ts in shards.items()})
    return seen, grads


def _grad(t: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(t) if t.grad is None else t.grad


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "no_prefetch"])
def test_each_units_phase_follows_its_memory_through_a_step(prefetch: bool) -> None:
    expected = reference_grad(2, local_loss)
    expected = {**expected, "frozen": torch.zeros_like(expected["frozen"])}
    sharded = dict.fromkeys(BLOCKS, Phase.SHARDED.value)
    resharded = dict.fromkeys(BLOCKS, Phase.RESHARDED.value)
    for seen, grads in ranks.world(2).run(_stepped, prefetch):
        assert seen["before"] == sharded
        assert seen["after forward"] == resharded
        assert seen["in backward"]["blocks.1"] == Phase.REFILLED.value
        assert seen["after backward (graph kept)"] == resharded  # freed again at its end
        assert seen["kept no_sync bytes"] == 0
        tree_allclose(grads, expected, **TOL)


def _profiled(rank: int, size: int) -> Any:
    params = make_params()
    fsdp = fdp.FullyShardedDataParallel(params)
    x, y = data(size)
    shards = fsdp.shard(params)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        loss = (applied(fsdp, shards, mine(x, rank), None) - mine(y, rank)).square().mean()
        torch.autograd.backward(loss)
    labels = sorted({e.name for e in prof.events() if e.name.startswith("fdp::")})
    return labels, fsdp.full({k: tuple(_grad(t) for t in ts) for k, ts in shards.items()})


def test_a_profiler_trace_shows_each_units_gather_reshard_and_refill() -> None:
    expected = reference_grad(2, local_loss)
    expected = {**expected, "frozen": torch.zeros_like(expected["frozen"])}
    for labels, grads in ranks.world(2).run(_profiled):
        for name in BLOCKS:
            assert f"fdp::fsdp.all_gather {name}" in labels
            assert f"fdp::fsdp.reshard {name}" in labels
        assert {"fdp::fsdp.refill", "fdp::reduce-scatter"} <= set(labels)
        tree_allclose(grads, expected, **TOL)
