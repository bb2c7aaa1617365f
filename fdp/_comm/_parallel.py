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
- :func:`pmax`: the elementwise max or min, piecewise linear (the holder's
  derivatives), from a constant extreme and :func:`psum`.
- :func:`all_gather_flat` and :func:`reduce_scatter_flat`: a flat 1-D
  all-gather and its transpose (``_AllGather``, ``_ReduceScatter``), with a
  dtype policy (:class:`Flat`); fully sharded units, ZeRO and the public
  ``fdp.all_gather``/``fdp.reduce_scatter`` use them.
- :func:`all_to_all_rows`: row ``j`` to rank ``j`` (``_AllToAll``), its own
  transpose.

These are the paths taken when a result must be differentiable; the fast
paths (in-place, bucketed, overlapped) stay where nothing requires grad and
no transform runs. While compiling, each traces as the functional
collectives through a Function with forward and backward only
(``_TracedAllReduce``, ``_TracedAllGather``, ...): dynamo cannot trace a
Function with a custom ``jvp`` or ``vmap``; ``fdp/_mode.py`` picks the form.
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


class _TracedAllReduce(torch.autograd.Function):
    """:class:`_AllReduce` for ``torch.compile``: forward and backward only (see the module doc)."""

    @staticmethod
    def forward(t: torch.Tensor, scale: float, group: ProcessGroup | None) -> torch.Tensor:
        out = _groups.all_reduce(t, group=group)
        return out if scale == 1.0 else out * scale

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.scale, ctx.group = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        out = _groups.all_reduce(grad, group=ctx.group)
        return (out if ctx.scale == 1.0 else out * ctx.scale), None, None


def _psum_eager(
    t: torch.Tensor, *, scale: float = 1.0, group: ProcessGroup | None = None
) -> torch.Tensor:
    """``scale`` times the sum of ``t`` over the ranks of ``group``, differentiable at any depth."""
    out: torch.Tensor = _AllReduce.apply(t, scale, group)  # type: ignore[no-untyped-call]
    return out


def _psum_traced(
    t: torch.Tensor, *, scale: float = 1.0, group: ProcessGroup | None = None
) -> torch.Tensor:
    out: torch.Tensor = _TracedAllReduce.apply(t, scale, group)  # type: ignore[no-untyped-call]
    return out


psum = _mode.by_mode(_psum_eager, _psum_traced)


class _Extreme(torch.autograd.Function):
    """The elementwise max or min over ranks, as a constant (no derivatives): see :func:`pmax`."""

    @staticmethod
    def forward(t: torch.Tensor, op: str, group: ProcessGroup | None) -> torch.Tensor:
        return _groups.all_reduce(t, group=group, op=op)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.mark_non_differentiable(output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:
        return None, None, None

    @staticmethod
    def vmap(
        info: Any, in_dims: tuple[Any, ...], t: torch.Tensor, op: str, group: Any
    ) -> tuple[torch.Tensor, int | None]:
        if in_dims[0] is None:
            return _extreme(t, op, group), None
        return _extreme(t.movedim(in_dims[0], 0), op, group), 0


def _extreme_eager(t: torch.Tensor, op: str, group: ProcessGroup | None) -> torch.Tensor:
    out: torch.Tensor = _Extreme.apply(t.detach(), op, group)  # type: ignore[no-untyped-call]
    return out


def _extreme_traced(t: torch.Tensor, op: str, group: ProcessGroup | None) -> torch.Tensor:
    return _groups.all_reduce(t.detach(), group=group, op=op)


_extreme = _mode.by_mode(_extreme_eager, _extreme_traced)


def pmax(t: torch.Tensor, op: str, group: ProcessGroup | None) -> torch.Tensor:
    """The elementwise ``op`` (``"max"`` or ``"min"``) over ranks, piecewise linear.

    Each element's value is its holder's: the lowest rank holding the
    extreme (ties go to the lowest rank). So the derivatives are that rank's:
    its tangent forward; the cotangent summed over ranks, to it alone,
    backward (a :func:`psum` of ``t`` where this rank holds the extreme, else
    zeros, which gives the extreme exactly). Three collectives: the extreme,
    the holder, the psum.
    """
    extreme = _extreme(t, op, group)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    held = t.detach() == extreme
    claim = torch.where(held, rank, world).to(torch.int32)
    holder = _extreme(claim, "min", group)
    return psum(torch.where(holder == rank, t, torch.zeros_like(t)), group=group)


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


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype``: ``t`` itself when it has it already.

    Note [no-op casts in traced forwards]: on torch 2.11, a compiled
    ``autograd.Function`` whose forward returns the result of an op that
    hands back its own input (``.to`` to the same dtype or device,
    ``.contiguous()`` of a contiguous tensor, ``.type_as``) made from a
    tensor computed inside that forward gets a zero gradient, silently
    (measured right on 2.13 and 2.15). Never calling the op keeps every version right.
    """
    return t if t.dtype == dtype else t.to(dtype)


def _gather_now(x: torch.Tensor, flat: Flat) -> torch.Tensor:
    return _groups.all_gather(_cast(x, flat.gather_dtype), group=flat.group)


def _scatter_now(y: torch.Tensor, flat: Flat) -> torch.Tensor:
    out = _groups.reduce_scatter(_cast(y, flat.reduce_dtype), group=flat.group)
    return _cast(out, flat.out_dtype)  # Note [no-op casts in traced forwards]


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


class _TracedReduceScatter(torch.autograd.Function):
    """:class:`_ReduceScatter` for ``torch.compile``: functional collectives both ways."""

    @staticmethod
    def forward(y: torch.Tensor, flat: Flat) -> torch.Tensor:
        return _scatter_now(y, flat)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.flat = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_now(grad, ctx.flat), None


def _reduce_scatter_eager(y: torch.Tensor, flat: Flat) -> torch.Tensor:
    """This rank's part (1/world of ``y``, rank-major) of the sum over ranks of ``y``."""
    out: torch.Tensor = _ReduceScatter.apply(y, flat)  # type: ignore[no-untyped-call]
    return out


def _reduce_scatter_traced(y: torch.Tensor, flat: Flat) -> torch.Tensor:
    out: torch.Tensor = _TracedReduceScatter.apply(y, flat)  # type: ignore[no-untyped-call]
    return out


reduce_scatter_flat = _mode.by_mode(_reduce_scatter_eager, _reduce_scatter_traced)


# ---------------------------------------------------------------------------
# The all-to-all: row j to rank j. Its own transpose, as psum is.


class _AllToAll(torch.autograd.Function):
    """Row ``j`` of ``rows`` (``(world, m)``) to rank ``j``; row ``i`` of the result from ``i``."""

    @staticmethod
    def forward(rows: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        return _groups.all_to_all(rows, group=group)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.group = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # What rank i got from me, row i, was my row i: its cotangent goes back the same way.
        return all_to_all_rows(grad, ctx.group), None

    @staticmethod
    def jvp(ctx: Any, tangent: torch.Tensor, *_: Any) -> torch.Tensor:
        return all_to_all_rows(tangent, ctx.group)

    @staticmethod
    def vmap(
        info: Any, in_dims: tuple[Any, ...], rows: torch.Tensor, group: Any
    ) -> tuple[torch.Tensor, int | None]:
        if in_dims[0] is None:
            return all_to_all_rows(rows, group), None
        batched = rows.movedim(in_dims[0], 0)  # (batch, world, m): each rank's rows by batch
        batch, world, m = batched.shape
        out = all_to_all_rows(batched.transpose(0, 1).reshape(world, batch * m), group)
        return out.view(world, batch, m).transpose(0, 1), 0


class _TracedAllToAll(torch.autograd.Function):
    """:class:`_AllToAll` for ``torch.compile``: forward and backward only."""

    @staticmethod
    def forward(rows: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        return _groups.all_to_all(rows, group=group)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.group = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _groups.all_to_all(grad, group=ctx.group), None


def _all_to_all_eager(rows: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Row ``j`` of ``rows`` (``(world, m)``) to rank ``j``; row ``i`` of the result from ``i``."""
    out: torch.Tensor = _AllToAll.apply(rows, group)  # type: ignore[no-untyped-call]
    return out


def _all_to_all_traced(rows: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    out: torch.Tensor = _TracedAllToAll.apply(rows, group)  # type: ignore[no-untyped-call]
    return out


all_to_all_rows = _mode.by_mode(_all_to_all_eager, _all_to_all_traced)
