"""Process groups as fdp's calls take them: ``None`` means the default (world) group.

One place for what every distributed module needs of a group: its type,
the group ``None`` stands for, a group rank as a global rank (what
``src=``/``dst=`` and device-mesh placements take), and whether two
arguments name the same group.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from fdp import _bucket, _compat

ProcessGroup = dist.ProcessGroup

# Broadcasts are rare (initial weights, buffers): one per device and dtype.
BROADCAST_CAP_BYTES = 250 * _bucket.MB


def resolve(group: ProcessGroup | None) -> Any:
    """The group itself; ``None``: the default group (``dist.group.WORLD``)."""
    return dist.group.WORLD if group is None else group


def global_rank(group: ProcessGroup | None, rank: int) -> int:
    """Rank ``rank`` of ``group`` as a rank of the default group."""
    return rank if group is None else dist.get_global_rank(group, rank)


def same(a: ProcessGroup | None, b: ProcessGroup | None) -> bool:
    """Whether ``a`` and ``b`` are the same group (``None`` and the world are)."""
    return resolve(a) is resolve(b)


def broadcast_coalesced(
    buckets: Sequence[_bucket.Bucket],
    targets: Sequence[torch.Tensor | None],
    *,
    src: int,
    group: ProcessGroup | None,
) -> None:
    """Gives ``targets`` the values of global rank ``src``, in place, eagerly.

    One asynchronous broadcast per bucket (``buckets`` index ``targets``, as
    :func:`fdp._bucket.plan` made them); ``None`` targets are skipped.
    """
    with torch.no_grad():
        flats = [b.pack([targets[i] for i in b.indices]) for b in buckets]
        works = [dist.broadcast(f, src=src, group=group, async_op=True) for f in flats]
        for bucket, flat, work in zip(buckets, flats, works, strict=True):
            work.wait()
            pairs = [
                (t, view)
                for t, view in zip(
                    [targets[i] for i in bucket.indices], bucket.views(flat), strict=True
                )
                if t is not None
            ]
            _compat.foreach_copy_([t for t, _ in pairs], [view for _, view in pairs])
