"""The collectives of fully sharded parameters, with a rule for every ``torch.func`` transform.

A unit's parameters live as one flat shard per rank; :func:`gather` makes
the whole flat buffer (every rank's shard in rank order) and its backward
averages the cotangents over ranks and keeps this rank's part: a
reduce-scatter divided by the world size, so that the shards' gradient is
the gradient of the mean of the ranks' losses, as under DDP.

As with :mod:`fdp._comm._transforms`' psum rule, every map here is linear, so
its derivatives are the same collectives: :class:`_Gather` (all-gather
forward; backward the reduce-scatter, or for the parameters the
data-parallel mean: also summed over HSDP's replicas, then divided by every
rank) and
:class:`_ReduceScatter` (its exact transpose; backward an all-gather) call
each other, and hold at any nesting depth (``grad(grad)``, ``jvp``,
``vmap``, ``torch.autograd.forward_ad``). Under ``vmap`` the batch travels
in the same collective, folded into the flat buffer. The dtype policy is
part of the map: the shard is cast to ``param_dtype`` before the
all-gather, and a cotangent to ``reduce_dtype`` before the reduce-scatter;
the shard's gradient comes back in the shard's own dtype.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from fdp import _compat
from fdp._comm import _groups, _transforms
from fdp._comm._groups import ProcessGroup


class How(NamedTuple):
    """What every call on one unit's shard shares."""

    group: ProcessGroup | None  # the shard group
    world: int  # its size
    param_dtype: torch.dtype  # what the all-gather carries
    reduce_dtype: torch.dtype  # what the reduce-scatter carries
    shard_dtype: torch.dtype  # the master copy's, which gradients come back in
    replicas: ProcessGroup | None = None  # HSDP: the group across which shards are replicated
    total: int = 0  # the ranks whose losses are averaged: world times the replicas


@dataclass(frozen=True)
class Ready:
    """A gather's result, already all-gathered (prefetched): not an input of autograd."""

    flat: torch.Tensor


def gather(shard: torch.Tensor, how: How, ready: Ready | None = None) -> torch.Tensor:
    """Every rank's ``shard`` (1-D), concatenated in rank order, in ``param_dtype``.

    The backward gives ``shard`` the mean over ranks of the cotangents'
    parts for this rank (a reduce-scatter in ``reduce_dtype``, divided by
    the world size), in the shard's dtype. ``ready``: that result, gathered
    before from ``shard`` as it is now (eager only).
    """
    if torch.compiler.is_compiling():
        if _compat.compiling_a_transform():
            raise NotImplementedError(
                "fdp.FullyShardedDataParallel: gathering shards inside torch.compile of a "
                "torch.func transform would lose the reduce-scatter of the gradients (torch drops "
                "a custom autograd.Function's backward there, pytorch/pytorch#193279); compile "
                "the loss and call .backward() or torch.autograd.grad on it, or run the "
                "transform without torch.compile"
            )
        traced: torch.Tensor = _Traced.apply(shard, how)  # type: ignore[no-untyped-call]
        return traced
    out: torch.Tensor = _Gather.apply(shard, how, True, ready)  # type: ignore[no-untyped-call]
    return out


class _Traced(torch.autograd.Function):
    """:class:`_Gather` for ``torch.compile``: functional collectives both ways.

    No ``jvp`` or ``vmap`` rule, which dynamo cannot trace; compiled
    transforms are refused before this (see :func:`gather`).
    """

    @staticmethod
    def forward(x: torch.Tensor, how: How) -> torch.Tensor:
        return _all_gather(x, how)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.how = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        how: How = ctx.how
        mine = _reduce_scatter(grad, how)
        if how.replicas is not None:
            mine = _groups.all_reduce(mine, group=how.replicas)
        return mine / how.total, None


@contextlib.contextmanager
def in_step(what: str) -> Iterator[None]:
    """Explains an eager collective that failed, most often because ranks are out of step.

    There is no ``join()`` for fully sharded ranks: each forward and backward
    is a sequence of collectives that every rank must make. A rank with more
    batches than another waits for collectives nobody answers, until the
    process group's timeout; this says why, instead of the backend's
    "timed out" alone (chained as the cause).
    """
    try:
        yield
    except RuntimeError as err:  # gloo raises RuntimeError, NCCL a subclass (DistBackendError)
        raise RuntimeError(
            f"fdp.FullyShardedDataParallel: {what} failed on this rank: {err}\n"
            "Every rank must make the same fully sharded calls (gather, apply, backward) in "
            "the same order. Most often a rank has more batches than another (uneven inputs) "
            "and waits for collectives the others never make: FullyShardedDataParallel has no "
            "join(), so give every rank the same number of batches (DistributedSampler with "
            "drop_last=True), or stop every rank when the first runs out of data"
        ) from err


def _all_gather(x: torch.Tensor, how: How) -> torch.Tensor:
    part = x.to(how.param_dtype)
    if torch.compiler.is_compiling():
        return _groups.all_gather(part, group=how.group)
    with in_step("the all-gather of a unit's shards"):
        return _groups.all_gather(part, group=how.group)


def _reduce_scatter(y: torch.Tensor, how: How) -> torch.Tensor:
    part = y.to(how.reduce_dtype)
    if torch.compiler.is_compiling():
        return _groups.reduce_scatter(part, group=how.group).to(how.shard_dtype)
    with in_step("the reduce-scatter of a unit's gradient"):
        return _groups.reduce_scatter(part, group=how.group).to(how.shard_dtype)


class _Gather(torch.autograd.Function):
    """All-gather forward; backward its transpose (the reduce-scatter), or with ``mean``
    the data-parallel average: summed over the replicas too and divided by every rank."""

    @staticmethod
    def forward(x: torch.Tensor, how: How, mean: bool, ready: Ready | None) -> torch.Tensor:
        return _all_gather(x, how) if ready is None else ready.flat

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.how, ctx.mean = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        how: How = ctx.how
        out: torch.Tensor = _ReduceScatter.apply(grad, how)  # type: ignore[no-untyped-call]
        if not ctx.mean:
            return out, None, None, None
        if how.replicas is not None:
            out = _transforms.psum(out, group=how.replicas)
        return out / how.total, None, None, None

    @staticmethod
    def jvp(ctx: Any, tangent: torch.Tensor, *_: Any) -> torch.Tensor:
        out: torch.Tensor = _Gather.apply(tangent, ctx.how, ctx.mean, None)  # type: ignore[no-untyped-call]
        return out

    @staticmethod
    def vmap(
        info: Any,
        in_dims: tuple[Any, ...],
        x: torch.Tensor,
        how: How,
        mean: bool,
        ready: Ready | None,
    ) -> tuple[torch.Tensor, int | None]:
        # Every rank runs the same program and batches alike: the batch goes
        # into the flat buffer, rank-major, and back to the front after.
        if in_dims[0] is None:
            return _Gather.apply(x, how, mean, None), None  # type: ignore[no-untyped-call]
        rows = x.movedim(in_dims[0], 0)
        batch, n = rows.shape
        flat = _Gather.apply(rows.reshape(-1), how, mean, None)  # type: ignore[no-untyped-call]
        return flat.view(how.world, batch, n).transpose(0, 1).reshape(batch, -1), 0


class _ReduceScatter(torch.autograd.Function):
    """This rank's part of the sum over ranks (a reduce-scatter); backward the all-gather."""

    @staticmethod
    def forward(y: torch.Tensor, how: How) -> torch.Tensor:
        return _reduce_scatter(y, how)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.how = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out: torch.Tensor = _Gather.apply(grad, ctx.how, False, None)  # type: ignore[no-untyped-call]
        return out, None

    @staticmethod
    def jvp(ctx: Any, tangent: torch.Tensor, *_: Any) -> torch.Tensor:
        out: torch.Tensor = _ReduceScatter.apply(tangent, ctx.how)  # type: ignore[no-untyped-call]
        return out

    @staticmethod
    def vmap(
        info: Any, in_dims: tuple[Any, ...], y: torch.Tensor, how: How
    ) -> tuple[torch.Tensor, int | None]:
        if in_dims[0] is None:
            return _ReduceScatter.apply(y, how), None  # type: ignore[no-untyped-call]
        rows = y.movedim(in_dims[0], 0)
        batch = rows.shape[0]
        rank_major = rows.reshape(batch, how.world, -1).transpose(0, 1).reshape(-1)
        mine = _ReduceScatter.apply(rank_major, how)  # type: ignore[no-untyped-call]
        return mine.view(batch, -1), 0
