"""``DistributedDataParallel(broadcast_buffers=True)``: rank 0's buffers on every rank.

Buffers (BatchNorm's running statistics, step counters: every tensor leaf of
the tree that does not require grad and is not an ``nn.Parameter``) are
updated by each rank's own forward, so without care ranks drift apart and a
checkpoint from rank 0 evaluates differently from rank 1. torch's DDP
broadcasts them from rank 0 before forwards; :class:`Buffers` does it when
``ddp(state)`` decides to (``DistributedDataParallel._buffers_due``: torch's
rule), in place, coalesced by device and dtype into few broadcasts, like
:func:`fdp.broadcast_params`.

Eagerly (``loss.backward()``, ``torch.func.grad``) it uses async broadcasts
of packed buffers; under ``torch.func`` the leaves are functorch wrappers, so
the copy goes to the tensor underneath, with functorch's dispatch disabled
(the collective would otherwise be recorded). While compiling it uses
functional broadcasts and ``copy_`` into the leaves: an input mutation,
which ``torch.compile`` applies after the graph. Both are
:func:`fdp._comm._raw.broadcast_coalesced`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from fdp import _bucket
from fdp._comm import _groups, _raw


def is_buffer(t: torch.Tensor) -> bool:
    """Whether a leaf is a buffer: no grad, and not an ``nn.Parameter`` (a frozen one)."""
    return not t.requires_grad and not isinstance(t, torch.nn.Parameter)


class Buffers:
    """The buffer leaves of a DDP's tree and their coalesced broadcast.

    ``indices`` are the tree's buffers (:func:`is_buffer`, decided once, at
    construction, where ranks agree on the tree).
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor | None],
        group: ProcessGroup | None,
        *,
        with_params: bool = False,
    ) -> None:
        # with_params: every tensor leaf (construction, join's final synchronisation).
        self.indices = [
            i for i, t in enumerate(tensors) if t is not None and (with_params or is_buffer(t))
        ]
        self.buckets = _bucket.plan(
            [tensors[i] for i in self.indices], cap_bytes=_bucket.BROADCAST_CAP_BYTES
        )
        self.group = group

    def sync(self, leaves: Sequence[Any], *, src: int = 0) -> None:
        """Gives the buffers among ``leaves`` the values of the group's rank ``src``, in place."""
        if not self.buckets:
            return
        targets = [leaves[i] for i in self.indices]
        _raw.broadcast_coalesced(self.buckets, targets, src=src, group=self.group)

    def mirror(self, *, src: int) -> None:
        """Takes part in the broadcast of rank ``src``'s buffers, keeping nothing (``join``)."""
        with torch.no_grad():
            for bucket in self.buckets:
                root = _groups.global_rank(self.group, src)
                dist.broadcast(bucket.empty(), src=root, group=self.group)
