"""Gradient accumulation without communication: ``FullyShardedDataParallel.no_sync``.

Inside ``no_sync`` a unit is gathered as always (forward needs it), but its
backward keeps the full-size gradient of each gathered buffer here instead
of reduce-scattering it (:class:`_Hold`: nothing reaches the shard). The
next synchronised backward adds what was kept into that buffer's gradient
before its reduce-scatter (:class:`_Release`), so the shards get, in one
reduce-scatter per buffer, the gradient of every micro-batch: what
reduce-scattering each one would have given, for a fraction of the
traffic. The cost is memory: a unit's full gradient is held between the
micro-batches, as torch's ``set_requires_gradient_sync(False)`` holds it.

Eager ``loss.backward()`` only: a ``torch.func`` transform returns its
gradients and keeps nothing between calls, and a compiled graph cannot hold
buffers across calls; both are refused inside ``no_sync``.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch

from fdp import _compat, _grad, _mode


def hold(
    kept: dict[Any, torch.Tensor],
    key: Hashable,
    flat: torch.Tensor,
    shard: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``flat`` (gathered from ``shard``, outside autograd) whose gradient goes to ``kept[key]``.

    ``kept`` is the unit's (``UnitState.kept``), ``key`` the gathered
    buffer's. Kept in ``dtype`` (the reduce dtype), so that micro-batches
    add up as the reduce-scattered gradients would.
    """
    if not shard.requires_grad or not torch.is_grad_enabled():
        return flat
    out: torch.Tensor = _Hold.apply(flat, shard, kept, key, dtype)  # type: ignore[no-untyped-call]
    return out


def release(kept: dict[Any, torch.Tensor], key: Hashable, flat: torch.Tensor) -> torch.Tensor:
    """``flat`` whose gradient gets ``kept[key]`` (if anything) added, once."""
    if key not in kept or not flat.requires_grad:
        return flat
    out: torch.Tensor = _Release.apply(flat, kept, key)  # type: ignore[no-untyped-call]
    return out


class _Hold(torch.autograd.Function):
    """The identity on a gathered buffer; backward keeps its gradient, the shard gets none."""

    @staticmethod
    def forward(
        flat: torch.Tensor, shard: torch.Tensor, kept: Any, key: Hashable, dtype: torch.dtype
    ) -> torch.Tensor:
        return flat.view_as(flat)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.shard, ctx.kept, ctx.key, ctx.dtype = inputs[1], inputs[2], inputs[3], inputs[4]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None, None, None]:
        if ctx.shard.is_leaf and _compat.leaf_destination(ctx.shard) == "returned":
            # torch.autograd.grad would get None (or "not used in the graph") for
            # the shard, and its next call outside both micro-batches' sum.
            raise NotImplementedError(
                "fdp.FullyShardedDataParallel.no_sync: torch.autograd.grad of the shards inside "
                "no_sync(); no_sync keeps their gradients for the next loss.backward(), so none "
                "would be returned: call backward(), or accumulate the returned gradients "
                "yourself outside no_sync"
            )
        kept = ctx.kept.get(ctx.key)
        if kept is None:  # a copy: the engine may hand the same tensor to another consumer
            ctx.kept[ctx.key] = grad.to(ctx.dtype, copy=True)
        else:
            kept.add_(grad)
        return None, None, None, None, None


class _Release(torch.autograd.Function):
    """The identity; backward adds the gradient ``no_sync`` kept for this buffer, once."""

    @staticmethod
    def forward(flat: torch.Tensor, kept: Any, key: Hashable) -> torch.Tensor:
        return flat.view_as(flat)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.kept, ctx.key = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        kept = ctx.kept.pop(ctx.key, None)
        return (grad if kept is None else grad + kept.to(grad.dtype)), None, None


def _check_traced(call: str, shard: torch.Tensor) -> None:
    raise NotImplementedError(
        f"{call}: inside no_sync() while torch.compile traces; a graph cannot keep gradients "
        "between calls: run the accumulating micro-batches eagerly, or accumulate outside fdp"
    )


@_mode.traced_as(_check_traced)
def check(call: str, shard: torch.Tensor) -> None:
    # fdp.grad's own call too: its result would lack the kept gradient (zeros),
    # and its next call would return two micro-batches' sum.
    if _mode.transform_running() or _mode.wrapped([shard]) or _grad.returns(shard):
        raise NotImplementedError(
            f"{call}: inside no_sync() under a torch.func transform or fdp.grad; no_sync keeps "
            "gradients between eager loss.backward() calls, which a call returning its "
            "gradients cannot: accumulate the returned gradients yourself, or call backward()"
        )
