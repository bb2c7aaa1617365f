"""fdp's differentiable collectives, each once with its rules side by side (JAX's lax/parallel.py).

Every collective here is linear in its input, so its derivatives are
collectives too, as with JAX's ``psum``: the vjp is the transposed
collective on the cotangent (all-reduce for all-reduce, reduce-scatter for
all-gather and back), the jvp is the same collective on the tangent, and
under ``vmap`` each batched slice travels in one collective. Each is an
``autograd.Function`` with ``setup_context``, ``backward``, ``jvp`` and
``vmap``, and its rules call the Functions again, so they hold at any
nesting depth (``grad(grad)``, ``jvp(grad)``, ``vmap(grad)``, ``jacrev``,
``jacfwd``, ``hessian``, ``torch.autograd.forward_ad``).

- :func:`psum`: the all-reduce (``_AllReduce``); :func:`broadcast`, the
  stacked :func:`all_gather` and :func:`reduce_scatter` are built from it
  (a masked or zero-padded all-reduce, exact because adding zeros is).
- :func:`all_gather_flat` and :func:`reduce_scatter_flat`: a flat 1-D
  all-gather and its transpose (``_AllGather``, ``_ReduceScatter``), with a
  dtype policy (:class:`Flat`); fully sharded units and ZeRO use them.

These are the paths taken when a result must be differentiable; the fast
paths (in-place, bucketed, overlapped) stay where nothing requires grad and
no transform runs. While compiling, the flat pair traces as the functional
collectives (``_TracedAllGather``: dynamo cannot trace a Function with a
custom ``jvp``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from fdp import _mode
from fdp._comm import _groups
from fdp._comm._groups import ProcessGroup

# ---------------------------------------------------------------------------
# The all-reduce, and what is built from it.


class _AllReduce(torch.autograd.Function):
    """``scale *`` the sum over the ranks of ``group`` of ``t``; linear, so self-transposed."""

    @staticmethod
    def forward(t: torch.Tensor, scale: float, group: ProcessGroup | None) -> torch.Tensor:
        out = _groups.all_reduce(t, group=group)
        return out if scale == 1.0 else out.mul_(scale)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.scale, ctx.group = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return psum(grad, scale=ctx.scale, group=ctx.group), None, None

    @staticmethod
    def jvp(ctx: Any, tangent: torch.Tensor, *_: Any) -> torch.Tensor:
        return psum(tangent, scale=ctx.scale, group=ctx.group)

    @staticmethod
    def vmap(
        info: Any, in_dims: tuple[Any, ...], t: torch.Tensor, scale: float, group: Any
    ) -> tuple[torch.Tensor, int | None]:
        # Every rank runs the same program, so every rank batches the same
        # way: the batch dimension goes first everywhere and slices pair up.
        dim = in_dims[0]
        if dim is None:
            return psum(t, scale=scale, group=group), None
        return psum(t.movedim(dim, 0), scale=scale, group=group), 0


def psum(t: torch.Tensor, *, scale: float = 1.0, group: ProcessGroup | None = None) -> torch.Tensor:
    """``scale`` times the sum of ``t`` over the ranks of ``group``, differentiable at any depth."""
    out: torch.Tensor = _AllReduce.apply(t, scale, group)  # type: ignore[no-untyped-call]
    return out


def broadcast(t: torch.Tensor, src: int, group: ProcessGroup | None) -> torch.Tensor:
    """Rank ``src``'s ``t`` (a group rank) on every rank; the transpose sums onto ``src``."""
    # Zeros that depend on ``t``: every rank's psum then has the same
    # derivatives to run (zeros_like would give the other ranks none: a hang).
    mine = dist.get_rank(group) == src
    return psum(t if mine else torch.where(torch.tensor(False), t, 0), group=group)


def all_gather(t: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """``t`` from every rank stacked along a new dim 0; the transpose is a reduce-scatter."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    rows = [t if r == rank else torch.where(torch.tensor(False), t, 0) for r in range(world)]
    return psum(torch.stack(rows), group=group)


def reduce_scatter(t: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Row ``rank`` of the sum over ranks of ``t`` (shape ``(world, ...)``)."""
    return psum(t, group=group)[dist.get_rank(group)]


# ---------------------------------------------------------------------------
# The flat all-gather and its transpose, the reduce-scatter.


def _no_explanation(what: str) -> AbstractContextManager[None]:
    return contextlib.nullcontext()


class Flat(NamedTuple):
    """How a flat all-gather and its transpose travel."""

    group: ProcessGroup | None
    world: int  # the group's size
    gather_dtype: torch.dtype  # what the all-gather carries
    reduce_dtype: torch.dtype  # what the reduce-scatter carries
    out_dtype: torch.dtype  # what the reduce-scatter returns (the gathered input's dtype)
    # Wraps each eager collective: names what failed (fully sharded ranks out of step).
    explain: Callable[[str], AbstractContextManager[None]] = _no_explanation


def _gather_now(x: torch.Tensor, flat: Flat) -> torch.Tensor:
    return _groups.all_gather(x.to(flat.gather_dtype), group=flat.group)


def _scatter_now(y: torch.Tensor, flat: Flat) -> torch.Tensor:
    return _groups.reduce_scatter(y.to(flat.reduce_dtype), group=flat.group).to(flat.out_dtype)


class _AllGather(torch.autograd.Function):
    """Every rank's ``x`` (1-D) concatenated in rank order; backward the reduce-scatter.

    ``ready``: that result, gathered before (prefetched): returned as is.
    """

    @staticmethod
    def forward(x: torch.Tensor, flat: Flat, ready: torch.Tensor | None) -> torch.Tensor:
        if ready is not None:
            return ready
        with flat.explain("the all-gather of a unit's shards"):
            return _gather_now(x, flat)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.flat = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return reduce_scatter_flat(grad, ctx.flat), None, None

    @staticmethod
    def jvp(ctx: Any, tangent: torch.Tensor, *_: Any) -> torch.Tensor:
        return all_gather_flat(tangent, ctx.flat)

    @staticmethod
    def vmap(
        info: Any, in_dims: tuple[Any, ...], x: torch.Tensor, flat: Flat, ready: Any
    ) -> tuple[torch.Tensor, int | None]:
        # Every rank runs the same program and batches alike: the batch goes
        # into the flat buffer, rank-major, and back to the front after.
        if in_dims[0] is None:
            return all_gather_flat(x, flat), None
        rows = x.movedim(in_dims[0], 0)
        batch, n = rows.shape
        out = all_gather_flat(rows.reshape(-1), flat)
        return out.view(flat.world, batch, n).transpose(0, 1).reshape(batch, -1), 0


class _ReduceScatter(torch.autograd.Function):
    """This rank's part of the sum over ranks of ``y`` (1-D); backward the all-gather."""

    @staticmethod
    def forward(y: torch.Tensor, flat: Flat) -> torch.Tensor:
        with flat.explain("the reduce-scatter of a unit's gradient"):
            return _scatter_now(y, flat)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.flat = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_gather_flat(grad, ctx.flat), None

    @staticmethod
    def jvp(ctx: Any, tangent: torch.Tensor, *_: Any) -> torch.Tensor:
        return reduce_scatter_flat(tangent, ctx.flat)

    @staticmethod
    def vmap(
        info: Any, in_dims: tuple[Any, ...], y: torch.Tensor, flat: Flat
    ) -> tuple[torch.Tensor, int | None]:
        if in_dims[0] is None:
            return reduce_scatter_flat(y, flat), None
        rows = y.movedim(in_dims[0], 0)
        batch = rows.shape[0]
        rank_major = rows.reshape(batch, flat.world, -1).transpose(0, 1).reshape(-1)
        return reduce_scatter_flat(rank_major, flat).view(batch, -1), 0


class _TracedAllGather(torch.autograd.Function):
    """:class:`_AllGather` for ``torch.compile``: functional collectives both ways.

    No ``jvp`` or ``vmap`` rule, which dynamo cannot trace: callers refuse
    compiled transforms before this.
    """

    @staticmethod
    def forward(x: torch.Tensor, flat: Flat) -> torch.Tensor:
        return _gather_now(x, flat)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.flat = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _scatter_now(grad, ctx.flat), None


def _all_gather_eager(
    x: torch.Tensor, flat: Flat, *, ready: torch.Tensor | None = None
) -> torch.Tensor:
    """Every rank's ``x`` (1-D, the same size everywhere) concatenated in rank order.

    In ``flat.gather_dtype``; the derivative (vjp) is :func:`reduce_scatter_flat`,
    in ``flat.reduce_dtype``, returned in ``flat.out_dtype``. ``ready``: the
    result, gathered before (eagerly only).
    """
    out: torch.Tensor = _AllGather.apply(x, flat, ready)  # type: ignore[no-untyped-call]
    return out


def _all_gather_traced(
    x: torch.Tensor, flat: Flat, *, ready: torch.Tensor | None = None
) -> torch.Tensor:
    traced: torch.Tensor = _TracedAllGather.apply(x, flat)  # type: ignore[no-untyped-call]
    return traced


all_gather_flat = _mode.by_mode(_all_gather_eager, _all_gather_traced)


def reduce_scatter_flat(y: torch.Tensor, flat: Flat) -> torch.Tensor:
    """This rank's part (1/world of ``y``, rank-major) of the sum over ranks of ``y``."""
    out: torch.Tensor = _ReduceScatter.apply(y, flat)  # type: ignore[no-untyped-call]
    return out
