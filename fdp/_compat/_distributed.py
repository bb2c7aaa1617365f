"""``torch.distributed``'s internals: functional collectives' issue and wait, renamed
collectives, the process group's fast all-gather and timeout, DCP's ShardedTensor.

Part of :mod:`fdp._compat` (its docstring says how each function degrades).
"""

from __future__ import annotations

import datetime
import functools
from typing import Any

import torch


def all_reduce_issue(t: torch.Tensor, op: str, group: Any) -> torch.Tensor:
    """Start a traceable all-reduce of ``t``; its result is valid after :func:`wait`.

    ``funcol.all_reduce`` waits at the result's first use, and while tracing
    it records the wait right after the collective: nothing could then
    depend on the collective having been *issued* without depending on its
    end. If the ``_c10d_functional`` ops go: the public ``funcol.all_reduce``
    (issue and wait together), with :func:`wait` a no-op on it.
    """
    import torch.distributed._functional_collectives as funcol

    ops = getattr(torch.ops, "_c10d_functional", None)
    if ops is None or not hasattr(ops, "all_reduce"):
        summed: torch.Tensor = funcol.all_reduce(t, op, group)
        return summed
    out: torch.Tensor = ops.all_reduce(t, op, funcol._resolve_group_name(group))
    return out


def wait(t: torch.Tensor) -> torch.Tensor:
    """The finished result of :func:`all_reduce_issue`."""
    ops = getattr(torch.ops, "_c10d_functional", None)
    if ops is None or not hasattr(ops, "wait_tensor"):
        return t
    out: torch.Tensor = ops.wait_tensor(t)
    return out


def group_timeout(group: Any) -> datetime.timedelta | None:
    """The collective timeout of ``group`` (the default group for None), or None if unknown.

    A subgroup made with ``dist.new_group`` gets torch's default timeout
    (30 minutes for gloo), not its parent's. If backends stop exposing
    ``options._timeout``: None, and subgroups wait torch's default.
    """
    import torch.distributed as dist

    pg: Any = group if group is not None else dist.group.WORLD
    try:
        for device in pg._device_types:
            timeout = pg._get_backend(device).options._timeout
            return timeout if isinstance(timeout, datetime.timedelta) else None
    except (AttributeError, RuntimeError):
        return None
    return None


def reduce_scatter_single(out: torch.Tensor, flat: torch.Tensor, group: Any) -> Any:
    """Starts a sum reduce-scatter of ``flat`` into ``out`` (this rank's part); returns the work.

    torch 2.13 renamed ``reduce_scatter_tensor`` to ``reduce_scatter_single``
    and deprecates the old name; before 2.13 only the old one exists.
    """
    fn = _renamed("reduce_scatter_single", "reduce_scatter_tensor")
    return fn(out, flat, group=group, async_op=True)


def all_gather_single(out: torch.Tensor, part: torch.Tensor, group: Any) -> Any:
    """Starts an all-gather of every rank's ``part`` into ``out``; returns the work.

    A plain real tensor goes straight to the process group's
    ``_allgather_base``, which ``all_gather_into_tensor`` calls after checks
    that a plain tensor passes (a few microseconds of Python: the small
    public all-gather's cost is its latency). Otherwise, and if
    ``_allgather_base`` or ``_get_default_group`` go, the public call: the
    2.13 name of ``all_gather_into_tensor`` (deprecated there).
    """
    if type(part) is torch.Tensor and type(out) is torch.Tensor and not part.is_complex():
        base = _default_group() if group is None else group
        direct = getattr(base, "_allgather_base", None)
        if direct is not None:
            return direct(out, part)
    fn = _renamed("all_gather_single", "all_gather_into_tensor")
    return fn(out, part, group=group, async_op=True)


def all_reduce_sum(t: torch.Tensor, group: Any) -> Any:
    """Starts a sum all-reduce of ``t`` in place; returns the work.

    A plain real tensor goes straight to the process group's ``allreduce``,
    which ``dist.all_reduce`` calls after checks that it passes: about 70 us
    of Python a call (measured: 195 against 122 us for a launch and wait on
    one gloo rank), twice or more a DDP step. Otherwise, and if
    ``allreduce`` or ``_get_default_group`` go, the public call.
    """
    import torch.distributed as dist

    if type(t) is torch.Tensor and not t.is_complex():
        base = _default_group() if group is None else group
        direct = getattr(base, "allreduce", None)
        options = getattr(dist, "AllreduceOptions", None)
        if direct is not None and options is not None:
            opts = options()
            opts.reduceOp = dist.ReduceOp.SUM
            return direct([t], opts)
    return dist.all_reduce(t, group=group, async_op=True)


def _default_group() -> Any:
    import torch.distributed as dist

    c10d = dist.distributed_c10d
    get = getattr(c10d, "_get_default_group", None)
    return get() if get is not None else None


@functools.cache
def _renamed(new: str, old: str) -> Any:
    """``torch.distributed``'s function ``new``, or ``old`` before it (looked up once:
    the public collectives' per-call cost)."""
    import torch.distributed as dist

    return getattr(dist, new, None) or getattr(dist, old)


def sharded_tensor(
    local: list[tuple[torch.Tensor, int]],
    placements: list[tuple[int, int, int]],
    numel: int,
    dtype: torch.dtype,
    group: Any,
) -> torch.Tensor:
    """A 1-D ``ShardedTensor`` of ``numel`` elements, for ``torch.distributed.checkpoint``.

    ``placements`` lists every rank's pieces as ``(rank in group, start, length)``;
    ``local`` this rank's tensors with their starts. DCP writes and reads a
    ShardedTensor's pieces on the ranks that hold them and reshards on load
    (any pieces on any world size), which DTensor's even chunks cannot
    describe. Built from global metadata known on every rank, so no
    collective. ShardedTensor is torch's older sharded type (experimental,
    kept for DCP); if it goes, a DCP planner with the same chunk metadata.
    """
    import torch.distributed as dist
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor.api import ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import (
        ShardedTensorMetadata,
        TensorProperties,
    )
    from torch.distributed._shard.sharded_tensor.shard import Shard

    device = local[0][0].device if local else torch.device("cpu")
    # Placements name global ranks, whatever the group.
    metas = [
        ShardMetadata([start], [length], f"rank:{_global(group, rank)}/{device}")
        for rank, start, length in placements
    ]
    me = _global(group, dist.get_rank(group))
    shards = [
        Shard(t, ShardMetadata([start], [t.numel()], f"rank:{me}/{t.device}")) for t, start in local
    ]
    meta = ShardedTensorMetadata(metas, torch.Size([numel]), TensorProperties(dtype=dtype))
    st: torch.Tensor = ShardedTensor._init_from_local_shards_and_global_metadata(
        shards, meta, process_group=group
    )
    return st


def _global(group: Any, rank: int) -> int:
    import torch.distributed as dist

    return rank if group is None else dist.get_global_rank(group, rank)
