"""FullyShardedDataParallel.apply: units freed after forward, gathered again for backward.

Resharding and prefetching (fdp/_sharding/_fsdp_reshard.py,
_fsdp_prefetch.py), against one process on the full batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fdp
from tests import ranks
from tests.helpers import tree_allclose
from tests.test_fsdp import (
    TOL,
    _block,
    _detached,
    _zero_if_none,
    applied,
    data,
    local_loss,
    make_params,
    mine,
    model,
    reference_grad,
)


def _resharded(rank: int, size: int, reshard: bool) -> Any:
    params = make_params()
    fsdp = fdp.FullyShardedDataParallel(params, reshard_after_forward=reshard)
    x, y = data(size)
    shards = fsdp.shard(params)
    seen: list[Any] = []
    loss = (applied(fsdp, shards, mine(x, rank), seen) - mine(y, rank)).square().mean()
    after_forward = [s.nbytes() for s in seen]
    torch.autograd.backward(loss, retain_graph=True)  # the units are gathered again for it
    after_backward = [s.nbytes() for s in seen]
    first = {k: tuple(t.grad.clone() for t in ts if t.grad is not None) for k, ts in shards.items()}
    torch.autograd.backward(loss)  # and again, for a second backward of the same graph
    doubled = {k: tuple(t.grad for t in ts if t.grad is not None) for k, ts in shards.items()}
    twice = all(
        torch.allclose(d, 2 * f) for k in first for d, f in zip(doubled[k], first[k], strict=True)
    )

    def grad(t: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(t) if t.grad is None else t.grad / 2

    grads = fsdp.full({k: tuple(grad(t) for t in ts) for k, ts in shards.items()})
    # Under torch.func.grad the units stay gathered: the same gradients.
    by_func = torch.func.grad(
        lambda s: (applied(fsdp, s, mine(x, rank), None) - mine(y, rank)).square().mean()
    )(_detached(shards))
    return after_forward, after_backward, twice, grads, fsdp.full(by_func)


@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
def test_apply_frees_each_unit_between_forward_and_backward(reshard: bool) -> None:
    expected = reference_grad(2, local_loss)
    frozen = {**expected, "frozen": torch.zeros_like(expected["frozen"])}
    for after_forward, after_backward, twice, grads, by_func in ranks.world(2).run(
        _resharded, reshard
    ):
        assert len(after_forward) == 4  # embed and three blocks, one buffer each
        if reshard:
            assert after_forward == [0, 0, 0, 0]
            assert after_backward == [0, 0, 0, 0]
        else:
            assert all(n > 0 for n in after_forward)
        assert twice
        tree_allclose(grads, frozen, **TOL)
        tree_allclose(by_func, expected, **TOL)


class Watch(list[Any]):
    """The storages seen inside unit functions; the gather ahead then; their sizes in backward."""

    def __init__(self, started: list[str], change: Callable[[], None] | None = None) -> None:
        super().__init__()
        self.started, self.change = started, change
        self.ahead: list[str | None] = []  # per block: the last gather started when it ran
        self.sizes: list[list[int]] = []  # per block's backward, every storage's size

    def forward(self) -> None:
        self.ahead.append(self.started[-1] if self.started else None)
        if self.change is not None:  # once, between a prefetch and its use
            self.change()
            self.change = None

    def backward(self) -> None:
        self.sizes.append([s.nbytes() for s in self])


def _watched(unit: dict[str, torch.Tensor], h: torch.Tensor, watch: Watch) -> Any:
    watch.forward()
    h = h.clone()  # its gradient arrives once this block's backward is done
    h.register_hook(lambda grad: watch.backward())  # type: ignore[no-untyped-call]
    return _block(unit, h, watch)


def _double_blocks_1(params: dict[str, Any]) -> None:
    block = params["blocks"][1]
    params["blocks"][1] = {k: (2 * v).detach().requires_grad_() for k, v in block.items()}


# Passes of a prefetching run: the block order, and whether blocks.1's shards
# are doubled in place after its gather was started ahead (before its use).
PASSES = [((0, 1, 2), False), ((0, 1, 2), False), ((2, 0, 1), False), ((0, 1, 2), True)]


def _prefetching(rank: int, size: int, prefetch: bool) -> Any:
    from fdp._sharding import _fsdp_prefetch  # the gathers started, logged by unit

    params = make_params()
    fsdp = fdp.FullyShardedDataParallel(params, prefetch=prefetch)
    x, y = data(size)
    started: list[str] = []

    class Logged(_fsdp_prefetch.Started):
        def __init__(self, state: Any, *args: Any) -> None:
            started.append(state.name)
            super().__init__(state, *args)

    with mock.patch.object(_fsdp_prefetch, "Started", Logged):
        out = []
        for order, change in PASSES:
            shards = fsdp.shard(params)

            def double(block: tuple[torch.Tensor, ...] = shards["blocks.1"]) -> None:
                with torch.no_grad():
                    for t in block:
                        t.mul_(2)

            watch = Watch(started, double if change else None)
            got = applied(fsdp, shards, mine(x, rank), watch, order, _watched)
            torch.autograd.backward((got - mine(y, rank)).square().mean())
            grads = fsdp.full({k: tuple(_zero_if_none(t) for t in ts) for k, ts in shards.items()})
            after = [s.nbytes() for s in watch]
            out.append((grads, watch.ahead, watch.sizes, after))
        # Gradients w.r.t. the inputs only: the units' flat gradients never
        # come, yet each unit is freed when backward ends.
        shards, xr = fsdp.shard(params), mine(x, rank).requires_grad_()
        watch = Watch(started)
        loss = (applied(fsdp, shards, xr, watch, (0, 1, 2), _watched) - mine(y, rank)).square()
        (dx,) = torch.autograd.grad(loss.mean(), xr)
        return out, dx, [s.nbytes() for s in watch]


def _input_grad(size: int) -> torch.Tensor:
    params, (x, y) = make_params(), data(size)
    return torch.cat(
        [
            torch.func.grad(local_loss, argnums=1)(params, mine(x, r), mine(y, r))
            for r in range(size)
        ]
    )


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "no_prefetch"])
def test_prefetching_runs_one_unit_ahead_and_changes_no_result(prefetch: bool) -> None:
    def loss_in(order: Sequence[int]) -> Callable[[Any, torch.Tensor, torch.Tensor], torch.Tensor]:
        return lambda p, x, y: (model(p, x, order) - y).square().mean()

    results = ranks.world(2).run(_prefetching, prefetch)
    for (order, change), *per_rank in zip(PASSES, *[out for out, _, _ in results], strict=True):
        expected = reference_grad(2, loss_in(order), _double_blocks_1 if change else None)
        expected = {**expected, "frozen": torch.zeros_like(expected["frozen"])}
        for grads, ahead, sizes, after in per_rank:
            tree_allclose(grads, expected, **TOL)
            assert after == [0, 0, 0, 0]  # embed and three blocks, freed after backward
            # In backward, each block's predecessor is refilled while it runs.
            before = [s[i] for s, i in zip(sizes, [2, 1, 0], strict=True)]
            assert all(n > 0 for n in before) if prefetch else before == [0, 0, 0]
            if order == (0, 1, 2) and not change:  # each block ran with the next one ahead
                assert ahead == (["blocks.1", "blocks.2", "conv"] if prefetch else [None] * 3)
    dx = torch.cat([dx for _, dx, _ in results])
    torch.testing.assert_close(dx, _input_grad(2), **TOL)
    assert all(after == [0, 0, 0, 0] for _, _, after in results)


class _HeldInBackward(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """How many applied units are gathered at each reduce-scatter, and at each ``cat``
    that assembles a unit's flat gradient."""

    def __init__(self, resharded: list[Any]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.resharded = resharded
        self.at_scatter: list[int] = []
        self.at_assembly: list[int] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        held = sum(r.storage.nbytes() > 0 for r in self.resharded)
        # On CPU a reduce-scatter is an all-to-all and a sum (fdp/_comm/_raw.py).
        if "reduce_scatter" in str(func) or "alltoall" in str(func):
            self.at_scatter.append(held)
        elif func is torch.ops.aten.cat.default and out.numel() in {
            r.numel for r in self.resharded
        }:
            self.at_assembly.append(held)
        return out


def _held_in_backward(rank: int, size: int, prefetch: bool) -> Any:
    from fdp._sharding import _fsdp_reshard  # each applied unit's gathered buffer

    params = make_params()
    fsdp = fdp.FullyShardedDataParallel(params, prefetch=prefetch)
    x, y = data(size)
    resharded: list[Any] = []

    class Logged(_fsdp_reshard.Resharded):
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            resharded.append(self)

    with mock.patch.object(_fsdp_reshard, "Resharded", Logged):
        shards = fsdp.shard(params)
        loss = (applied(fsdp, shards, mine(x, rank), None) - mine(y, rank)).square().mean()
    with _HeldInBackward(resharded) as watch:
        torch.autograd.backward(loss)
    grads = fsdp.full({k: tuple(_zero_if_none(t) for t in ts) for k, ts in shards.items()})
    return grads, watch.at_scatter, watch.at_assembly


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "no_prefetch"])
def test_backward_holds_one_unit_besides_the_one_it_reduces(prefetch: bool) -> None:
    """As torch's fully_shard: a unit's gathered parameters are freed before its flat
    gradient is assembled, and only the unit before it (prefetched, or refilled for
    its turn) is gathered during its reduce-scatter."""
    expected = reference_grad(2, local_loss)
    expected = {**expected, "frozen": torch.zeros_like(expected["frozen"])}
    for grads, at_scatter, at_assembly in ranks.world(2).run(_held_in_backward, prefetch):
        tree_allclose(grads, expected, **TOL)
        # embed and blocks 0-2 are applied, conv, head and embed again gathered;
        # the gathered units stay gathered until backward and count for none.
        assert len(at_assembly) >= 4
        assert len(at_scatter) >= 4
        assert max(at_scatter) == 1
        assert at_scatter[-1] == 0  # embed: nothing before it
        assert max(at_assembly) == (1 if prefetch else 0)
        assert at_assembly[-1] == 0


def test_prefetcher_predicts_the_last_order_and_nothing_used_in_this_pass() -> None:
    from fdp._sharding._fsdp_prefetch import Prefetcher

    ahead = Prefetcher(["e", "a", "b", "c"], enabled=True)
    # First: the plan's order, nothing used in this pass ("b" after "a");
    # "e" used again (a tied embedding) starts a new pass.
    assert [ahead.visit(u) for u in ["e", "b", "a", "c", "e"]] == ["a", "c", None, None, "a"]
    # Then what followed the same two uses last time: after "c", "e" (used
    # in this pass, so nothing); after the second "e", "e" again (nothing).
    assert [ahead.visit(u) for u in ["e", "b", "a", "c", "e"]] == ["a", "a", "c", None, None]
    # The third step starts as the second did; a new order falls back to the plan.
    assert [ahead.visit(u) for u in ["e", "a"]] == ["b", "b"]


def _keeps_a_gathered_tensor(rank: int, size: int) -> tuple[str, Any]:
    params = make_params()
    fsdp = fdp.FullyShardedDataParallel(params)
    shards = fsdp.shard(params)
    x = mine(data(size)[0], rank)
    with pytest.raises(ValueError, match="gathered parameters") as info:
        fsdp.apply(shards, "blocks.0", lambda u, h: (torch.tanh(h @ u["w"]), u["w"]), x[:, :5])
    # Computed values are fine; the parameters themselves come from gather.
    out = fsdp.apply(shards, "blocks.0", lambda u, h: torch.tanh(h @ u["w"]), x[:, :5])
    torch.autograd.backward(out.sum())
    grads = {
        k: tuple(torch.zeros_like(t) if t.grad is None else t.grad for t in ts)
        for k, ts in shards.items()
    }
    return str(info.value), fsdp.full(grads)


def test_returning_a_gathered_parameter_from_apply_is_refused_by_name() -> None:
    # Before, using it later failed in torch with "data is not allocated yet".
    size = 2
    ref = make_params()
    x = data(size)[0]
    outs = [torch.tanh(mine(x, r)[:, :5] @ ref["blocks"][0]["w"]).sum() for r in range(size)]
    torch.autograd.backward(torch.stack(outs).mean())
    for message, grads in ranks.world(size).run(_keeps_a_gathered_tensor):
        assert "output output[1]" in message
        assert "blocks.0" in message
        torch.testing.assert_close(grads["blocks"][0]["w"], ref["blocks"][0]["w"].grad, **TOL)
