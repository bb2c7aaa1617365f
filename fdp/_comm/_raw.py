"""The raw collectives: a new tensor from ``torch.distributed``, no derivatives.

The bottom rung of fdp's collective ladder. :func:`all_reduce`,
:func:`all_gather`, :func:`reduce_scatter`, :func:`all_to_all` and
:func:`broadcast` return a new tensor and leave their input alone. While
``torch.compile`` traces, they are torch's functional collectives (dynamo
puts them in the graph, with a wait at first use); eagerly,
``torch.distributed``'s, on a copy, outside autograd and ``torch.func`` (the
result is a constant to both). Ranks given to these functions are ranks of
``group``, as the functional collectives take them.

The rungs above: :mod:`fdp._comm._differentiable` gives each collective its
derivative and batching rules; :mod:`fdp._comm._tensor_collectives` and
:mod:`fdp._comm._tree_collectives` are the public calls on a tensor and on a
tree. The in-place, asynchronous, bucketed fast paths of DDP and ZeRO keep
``torch.distributed`` calls of their own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.autograd.graph import increment_version
from torch.distributed import ProcessGroup

from fdp import _bucket, _compat, _mode
from fdp._comm._groups import global_rank, resolve

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def all_reduce(
    t: torch.Tensor, *, group: ProcessGroup | None, op: str = "sum", scale: float = 1.0
) -> torch.Tensor:
    """``scale`` times the ``"sum"``, ``"max"`` or ``"min"`` of ``t`` over ``group``."""
    if _mode.traced():
        out: torch.Tensor = funcol.all_reduce(t, op, resolve(group))
        return out if scale == 1.0 else out * scale
    with torch.no_grad(), _compat.functorch_disabled():
        plain = _own(t)
        dist.all_reduce(plain, op=_OPS[op], group=group)
        return plain if scale == 1.0 else plain.mul_(scale)


def all_reduce_start(t: torch.Tensor, *, group: ProcessGroup | None) -> Any:
    """Starts summing ``t`` in place over ``group``; returns the work. Eager only, on a
    plain tensor the caller owns (outside autograd and ``torch.func``)."""
    return dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group, async_op=True)


def all_gather(t: torch.Tensor, *, group: ProcessGroup | None) -> torch.Tensor:
    """Every rank's ``t``, concatenated along dim 0 in rank order."""
    if _mode.traced():
        out: torch.Tensor = funcol.all_gather_tensor(t, 0, resolve(group))
        return out
    rows, work = all_gather_start(t, group=group)
    work.wait()  # one buffer: less than a list
    # A 1-D result is the buffer itself: a view made inside a Function's forward
    # would refuse in-place ops on every view of the Function's output.
    return rows.view(-1, *t.shape[1:]) if t.dim() > 1 else rows


def all_gather_start(
    t: torch.Tensor, *, group: ProcessGroup | None, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, Any]:
    """Starts gathering every rank's ``t``, flat, into ``out`` (new if ``None``); eager only.

    Returns ``out`` and the work; ``out`` holds the result once the work's
    ``wait()`` returns. Outside autograd: prefetching, whose result enters
    autograd later (``fdp/_sharding/_fsdp_prefetch.py``).
    """
    if not (t.requires_grad or _mode.transform_running() or _mode.wrapped([t])):
        return _start_gather(t, group, out)  # nothing to step under or keep out of autograd
    with torch.no_grad(), _compat.functorch_disabled():
        return _start_gather(_compat.unwrap_functorch(t).detach(), group, out)


def _start_gather(
    t: torch.Tensor, group: ProcessGroup | None, out: torch.Tensor | None
) -> tuple[torch.Tensor, Any]:
    part = t.contiguous().reshape(-1)
    if out is None:
        out = part.new_empty(dist.get_world_size(group) * part.numel())
    return out, _compat.all_gather_single(out, part, group)


def reduce_scatter(t: torch.Tensor, *, group: ProcessGroup | None) -> torch.Tensor:
    """This rank's part (dim 0 cut in ``world`` equal parts) of the sum of ``t`` over ``group``.

    On CPU tensors (gloo) an all-to-all and a local sum, as torch's own
    differentiable all-gather does there: gloo's reduce-scatter takes about
    twice as long (8 MB on 2 ranks: 14.4 against 7.1 ms; docs/performance.md).
    """
    if t.device.type == "cpu":
        return reduce_scatter_wide(t, wire=t.dtype, group=group)
    if _mode.traced():
        out: torch.Tensor = funcol.reduce_scatter_tensor(t, "sum", 0, resolve(group))
        return out
    with torch.no_grad(), _compat.functorch_disabled():
        plain = _compat.unwrap_functorch(t).contiguous()
        world = dist.get_world_size(group)
        mine = plain.new_empty(plain.shape[0] // world, *plain.shape[1:])
        _compat.reduce_scatter_single(mine, plain, group).wait()
        return mine


def all_to_all(t: torch.Tensor, *, group: ProcessGroup | None) -> torch.Tensor:
    """Row ``j`` of ``t`` (dim 0 cut in ``world`` equal parts) to rank ``j``; rows by sender."""
    if _mode.traced():
        out: torch.Tensor = funcol.all_to_all_single(t, None, None, resolve(group))
        return out
    with torch.no_grad(), _compat.functorch_disabled():
        plain = _compat.unwrap_functorch(t).contiguous()
        got = torch.empty_like(plain)
        dist.all_to_all_single(got, plain, group=group)
        return got


def all_to_all_split(
    t: torch.Tensor, receive: Sequence[int], send: Sequence[int], *, group: ProcessGroup | None
) -> torch.Tensor:
    """The 1-D ``t`` cut in ``send[j]`` elements for rank ``j``; ``receive[j]`` from rank ``j``."""
    if _mode.traced():
        out: torch.Tensor = funcol.all_to_all_single(t, list(receive), list(send), resolve(group))
        return out
    with torch.no_grad(), _compat.functorch_disabled():
        plain = _compat.unwrap_functorch(t).contiguous()
        got = plain.new_empty(sum(receive))
        dist.all_to_all_single(got, plain, list(receive), list(send), group=group)
        return got


def reduce_scatter_wide(
    t: torch.Tensor, *, wire: torch.dtype, group: ProcessGroup | None
) -> torch.Tensor:
    """:func:`reduce_scatter` with ``wire`` bytes on the wire and the sum in ``t``'s dtype.

    Row ``j`` of ``t`` goes to rank ``j`` in ``wire`` (an all-to-all: the bytes
    of a reduce-scatter in that dtype), and each rank adds the rows it got in
    ``t``'s dtype, in rank order: the only rounding is each input's to
    ``wire``, however many ranks there are. A ring reduction in ``wire`` rounds
    every partial sum instead, so its error grows with the ranks.
    """
    world = dist.get_world_size(group)
    # No no-op casts (Note [no-op casts in traced forwards] in _differentiable).
    rows = all_to_all(t if t.dtype == wire else t.to(wire), group=group)
    rows = rows.view(world, -1, *t.shape[1:])
    return (rows if rows.dtype == t.dtype else rows.to(t.dtype)).sum(0)


def broadcast(t: torch.Tensor, *, src: int, group: ProcessGroup | None) -> torch.Tensor:
    """Rank ``src``'s ``t`` (``src`` a rank of ``group``)."""
    if _mode.traced():
        out: torch.Tensor = funcol.broadcast(t, src, resolve(group))
        return out
    with torch.no_grad(), _compat.functorch_disabled():
        plain = _own(t)
        dist.broadcast(plain, src=global_rank(group, src), group=group)
        return plain


def _own(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of the plain tensor under any ``torch.func`` wrappers."""
    return torch.clone(_compat.unwrap_functorch(t), memory_format=torch.contiguous_format)


def broadcast_coalesced(
    buckets: Sequence[_bucket.Bucket],
    targets: Sequence[torch.Tensor | None],
    *,
    src: int,
    group: ProcessGroup | None,
) -> None:
    """Gives ``targets`` the values of rank ``src`` of ``group``, in place.

    One broadcast per bucket (``buckets`` index ``targets``, as
    :func:`fdp._bucket.plan` made them), asynchronous eagerly; ``None``
    targets are skipped. Outside autograd; under ``torch.func`` the tensors
    underneath the wrappers are written. Eagerly rank ``src`` copies nothing
    back (its targets hold the values) and a group of one rank communicates
    nothing; their targets' versions are bumped all the same.
    """
    if _mode.traced():  # copy_ into the leaves: an input mutation of the graph
        with torch.no_grad():
            for bucket in buckets:  # functional packing: dynamo cannot trace pack's views
                flat = torch.cat(bucket.pieces([targets[i] for i in bucket.indices]))
                flat = broadcast(flat, src=src, group=group)
                for i, view in zip(bucket.indices, bucket.unpack(flat), strict=True):
                    if targets[i] is not None:
                        targets[i].copy_(view)  # type: ignore[union-attr]
        return
    root = global_rank(group, src)
    with torch.no_grad(), _compat.functorch_disabled():
        # Under torch.func the tensor underneath the wrappers receives the values.
        targets = [None if t is None else _compat.unwrap_functorch(t) for t in targets]
        # Rank src keeps its values: it packs what it sends, the others
        # receive into new buffers (what they would pack is overwritten).
        sends = dist.get_rank() == root
        if sends:
            # Its tensors count as written, as every other rank's are: a tensor
            # autograd saved fails its in-place check alike on every rank.
            increment_version([t for t in targets if t is not None])
            if dist.get_world_size(group) == 1:
                return
        flats = [b.pack([targets[i] for i in b.indices]) if sends else b.empty() for b in buckets]
        works = [dist.broadcast(f, src=root, group=group, async_op=True) for f in flats]
        for bucket, flat, work in zip(buckets, flats, works, strict=True):
            work.wait()
            if sends:
                continue
            pairs = [
                (t, view)
                for t, view in zip(
                    [targets[i] for i in bucket.indices], bucket.views(flat), strict=True
                )
                if t is not None
            ]
            _compat.foreach_copy_([t for t, _ in pairs], [view for _, view in pairs])
