"""Collectives on any tensor, for users: ``fdp.all_reduce`` and its siblings.

``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all`` and
``broadcast`` each check their arguments, make the ranks agree on what
must match (one tiny all-reduce of a fingerprint, eagerly: a rank's mistake
becomes every rank's error, never a hang or a collective paired wrongly),
then run ``fdp/_comm/_differentiable.py``'s collective, whose rules give the
derivatives under autograd and every ``torch.func`` transform. Ranks
(``src``, the order of a gather) are ranks of ``group``.
docs/collectives.md has the semantics and a worked example.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from fdp import _mode
from fdp._comm import _agreement, _differentiable, _transforms

__all__ = ["all_gather", "all_reduce", "all_to_all", "broadcast", "reduce_scatter"]

OPS = ("sum", "mean", "max", "min")


@_transforms.eager_under_transforms("fdp.all_reduce")
def all_reduce(
    x: torch.Tensor, op: str = "sum", *, group: ProcessGroup | None = None
) -> torch.Tensor:
    """The elementwise reduction of ``x`` over the ranks of ``group``, on every rank.

    Args:
        x: a tensor of the same shape and dtype on every rank.
        op: ``"sum"``, ``"mean"``, ``"max"`` or ``"min"``.
        group: the process group; ``None`` is the world.

    Differentiable under autograd and every ``torch.func`` transform: the
    cotangents of ``"sum"``/``"mean"`` are summed (and divided) over ranks;
    ``"max"``/``"min"`` are piecewise linear, the derivative going to the
    lowest rank holding the extreme (its tangent forward, the summed
    cotangent backward).

    Example::

        total = fdp.all_reduce(loss.detach(), "mean")  # the global batch's mean loss
    """
    call = "fdp.all_reduce"
    _agree(call, group, x, {"op": op}, lambda: _check_op(call, op, x))
    if op in ("max", "min"):
        return _differentiable.pmax(x, op, group)
    scale = 1.0 / dist.get_world_size(group) if op == "mean" else 1.0
    return _differentiable.psum(x, scale=scale, group=group)


@_transforms.eager_under_transforms("fdp.all_gather")
def all_gather(x: torch.Tensor, *, dim: int = 0, group: ProcessGroup | None = None) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in rank order, on every rank.

    Args:
        x: a tensor of the same shape and dtype on every rank (at least 1-D).
        dim: the dimension to concatenate along.
        group: the process group; ``None`` is the world.

    The vjp is the summing reduce-scatter: each rank gets the sum over
    ranks of the cotangent's part for its own rows.

    Example::

        keys = fdp.all_gather(encoder(views))  # every rank's embeddings: global negatives
    """
    call = "fdp.all_gather"
    d = _agree(call, group, x, {"dim": dim}, lambda: _dim(call, "dim", dim, x))
    world = dist.get_world_size(group)
    moved = x.movedim(d, 0)
    flat = _differentiable.Policy(group, world)
    out = _differentiable.all_gather_flat(moved.reshape(-1), flat)
    return out.view(world * moved.shape[0], *moved.shape[1:]).movedim(0, d)


@_transforms.eager_under_transforms("fdp.reduce_scatter")
def reduce_scatter(
    x: torch.Tensor, op: str = "sum", *, dim: int = 0, group: ProcessGroup | None = None
) -> torch.Tensor:
    """This rank's chunk along ``dim`` of the reduction of ``x`` over the ranks of ``group``.

    Args:
        x: a tensor of the same shape and dtype on every rank, whose size
            along ``dim`` the group's size divides.
        op: ``"sum"``, ``"mean"``, ``"max"`` or ``"min"``.
        dim: the dimension cut into one chunk per rank (chunk ``r`` for rank ``r``).
        group: the process group; ``None`` is the world.

    The vjp of ``"sum"`` is the all-gather of the cotangents.

    Example::

        mine = fdp.reduce_scatter(torch.ones(4, 3), dim=0)  # 2 ranks: rows 2r, 2r+1 of 2 * ones
    """
    call = "fdp.reduce_scatter"

    def check() -> int:
        _check_op(call, op, x)
        return _divisible(call, "dim", _dim(call, "dim", dim, x), x, group)

    d = _agree(call, group, x, {"op": op, "dim": dim}, check)
    world = dist.get_world_size(group)
    chunk = x.shape[d] // world
    if op in ("max", "min"):
        return _differentiable.pmax(x, op, group).narrow(d, dist.get_rank(group) * chunk, chunk)
    moved = x.movedim(d, 0)
    flat = _differentiable.Policy(group, world)
    out = _differentiable.reduce_scatter_flat(moved.reshape(-1), flat)
    out = out.view(chunk, *moved.shape[1:]).movedim(0, d)
    return out / world if op == "mean" else out


@_transforms.eager_under_transforms("fdp.all_to_all")
def all_to_all(
    x: torch.Tensor,
    *,
    split_dim: int = 0,
    concat_dim: int = 0,
    group: ProcessGroup | None = None,
) -> torch.Tensor:
    """Chunk ``j`` of ``x`` along ``split_dim`` to rank ``j``; what arrives, along ``concat_dim``.

    Args:
        x: a tensor of the same shape and dtype on every rank, whose size
            along ``split_dim`` the group's size divides.
        split_dim: the dimension cut into one chunk per rank.
        concat_dim: the dimension the received chunks are concatenated
            along, in rank order.
        group: the process group; ``None`` is the world.

    Its own transpose: the vjp sends each cotangent chunk back where its
    value came from (the inverse all-to-all).

    Example::

        routed = fdp.all_to_all(tokens_by_expert, split_dim=0, concat_dim=0)
    """
    call = "fdp.all_to_all"

    def check() -> tuple[int, int]:
        s = _divisible(call, "split_dim", _dim(call, "split_dim", split_dim, x), x, group)
        return s, _dim(call, "concat_dim", concat_dim, x)

    s, c = _agree(call, group, x, {"split_dim": split_dim, "concat_dim": concat_dim}, check)
    world = dist.get_world_size(group)
    moved = x.movedim(s, 0)
    chunk = moved.shape[0] // world
    got = _differentiable.all_to_all_rows(moved.reshape(world, -1), group)
    chunks = got.view(world, chunk, *moved.shape[1:]).movedim(1, s + 1)
    return chunks.movedim(0, c).flatten(c, c + 1)


@_transforms.eager_under_transforms("fdp.broadcast")
def broadcast(x: torch.Tensor, src: int = 0, *, group: ProcessGroup | None = None) -> torch.Tensor:
    """Rank ``src``'s ``x`` on every rank of ``group``.

    Args:
        x: a tensor of the same shape and dtype on every rank (the values
            of ranks other than ``src`` are not used).
        src: a rank of ``group`` (0 .. size - 1), not a global rank.
        group: the process group; ``None`` is the world.

    The vjp sums the cotangents of every rank onto ``src``; the other ranks'
    inputs get zeros.

    Example::

        noise = fdp.broadcast(torch.randn(shape))  # rank 0's draw on every rank
    """
    call = "fdp.broadcast"
    _agree(call, group, x, {"src": src}, lambda: _src(call, src, group))
    return _differentiable.broadcast(x, src, group)


# ---------------------------------------------------------------------------
# Checks, shared with every rank.


def _agree_traced(
    call: str, group: ProcessGroup | None, x: Any, options: dict[str, Any], check: Callable[[], Any]
) -> Any:
    """While dynamo traces, the local checks only: a graph cannot compare ranks."""
    _tensor(call, x)
    return check()


@_mode.traced_as(_agree_traced)
def _agree(
    call: str, group: ProcessGroup | None, x: Any, options: dict[str, Any], check: Callable[[], Any]
) -> Any:
    """``check()``'s value once every rank agrees on ``x``'s shape, dtype and ``options``.

    A rank whose arguments are wrong (its ``check`` raises) still takes part
    in the comparison, with its error appended, so every rank raises: that
    rank its own error, the others one that names it.
    """
    _agreement.require_member(call, group)
    error: Exception | None = None
    value = None
    try:
        _tensor(call, x)
        value = check()
    except (TypeError, ValueError) as e:
        error = e
    described = [("x", _describe(x)), *((k, repr(v)) for k, v in options.items())]
    if error is not None:
        described.append((_agreement.ERROR, f"{type(error).__name__}: {error}"))
    if dist.get_world_size(group) > 1:
        fingerprint = _agreement.Fingerprint(described)
        started = fingerprint.start(group)
        try:
            fingerprint.finish(started, group=group, call=call, arg="x", named=True)
        except ValueError as differs:
            if error is not None:
                raise error from differs
            raise
    if error is not None:
        raise error
    return value


def _tensor(call: str, x: Any) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{call}: `x` expected a torch.Tensor; got {type(x).__name__} {x!r:.60}")


def _describe(x: Any) -> str:
    if not isinstance(x, torch.Tensor):
        return type(x).__name__
    return f"a tensor of shape {tuple(x.shape)}, dtype {x.dtype} on {x.device.type}"


def _check_op(call: str, op: object, x: torch.Tensor) -> None:
    if op not in OPS:
        raise ValueError(f"{call}: `op` expected one of {list(OPS)}; got {op!r}")
    if op in ("max", "min") and x.is_complex():
        raise TypeError(f"{call}: `op={op!r}` expected a real tensor; got dtype {x.dtype}")
    if op == "mean" and not (x.is_floating_point() or x.is_complex()):
        raise TypeError(
            f"{call}: `op='mean'` expected a floating-point or complex tensor; got dtype "
            f"{x.dtype} (use op='sum' and divide)"
        )


def _dim(call: str, arg: str, dim: object, x: torch.Tensor) -> int:
    """``dim`` as a non-negative dimension of ``x``."""
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{call}: `{arg}` expected an int; got {dim!r}")
    if x.dim() == 0:
        raise ValueError(
            f"{call}: `x` expected a tensor with at least one dimension; got a 0-d tensor "
            "(x.reshape(1) gives it one)"
        )
    if not -x.dim() <= dim < x.dim():
        raise ValueError(
            f"{call}: `{arg}` expected a dimension of x (shape {tuple(x.shape)}), in "
            f"[{-x.dim()}, {x.dim() - 1}]; got {dim}"
        )
    return dim % x.dim()


def _divisible(call: str, arg: str, dim: int, x: torch.Tensor, group: ProcessGroup | None) -> int:
    world = dist.get_world_size(group)
    if x.shape[dim] % world:
        raise ValueError(
            f"{call}: `x` expected a size along `{arg}` ({dim}) that the group's size "
            f"{world} divides; got shape {tuple(x.shape)}"
        )
    return dim


def _src(call: str, src: object, group: ProcessGroup | None) -> None:
    world = dist.get_world_size(group)
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < world:
        raise ValueError(
            f"{call}: `src` expected a rank of the group (0 .. {world - 1}; a group rank, not "
            f"a global one); got {src!r}"
        )
