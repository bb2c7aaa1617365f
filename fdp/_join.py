"""``DistributedDataParallel.join``: training on ranks with different numbers of batches.

A rank that runs out of data leaves its loop while the others still call
``ddp(params)`` and backward, whose collectives would then wait for it until
the timeout. Inside ``join`` every call of ``ddp(params)`` first all-reduces
a small vector: one flag per rank (1 while it trains) and whether the step
reduces gradients (not under ``no_sync``, grad enabled). A rank that leaves
the block keeps answering that all-reduce with zeros and mirrors each step
of the others (torch's ``Join`` semantics): the buffers' broadcast (received
from the first rank still training), one all-reduce of zeros per bucket, and
the all-reduce of usage counts. When every flag is 0, all ranks have left
and the block ends everywhere.

Only the default reduction is mirrored (a comm hook's collectives are its
own); ``fdp.sync_batch_norm`` inside the block would need mirroring too and
is not supported yet.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from fdp import _bucket
from fdp._buffers import Buffers

ProcessGroup = dist.ProcessGroup


class Joiner:
    """One ``join`` block's state: this rank's flag vector and how to mirror a step."""

    def __init__(
        self,
        *,
        group: ProcessGroup | None,
        buckets: Sequence[_bucket.Bucket],
        counted: int,
        buffers: Buffers | None,
        divide_by_initial_world_size: bool,
    ) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.buckets = list(buckets)
        self.counted = counted  # the length of a step's usage-count all-reduce
        self.buffers = buffers
        self.by_initial = divide_by_initial_world_size

    def _exchange(self, *, training: bool, synchronised: bool) -> tuple[int, int, bool]:
        """(ranks still training, the first of them, whether this step reduces)."""
        flags = torch.zeros(self.world + 1)
        if training:
            flags[self.rank] = 1.0
            flags[self.world] = 1.0 if synchronised else 0.0
        dist.all_reduce(flags, group=self.group)
        active = flags[: self.world].nonzero()
        first = int(active[0]) if len(active) else 0
        return len(active), first, bool(flags[self.world] > 0)

    def step(self, *, synchronised: bool) -> tuple[int, float | None]:
        """A training rank's call: (the source rank for buffers, the gradient scale or None)."""
        active, first, _ = self._exchange(training=True, synchronised=synchronised)
        return first, None if self.by_initial else 1.0 / active

    def shadow(self) -> None:
        """Mirrors the steps of the ranks still training until every rank has left."""
        with torch.no_grad():
            while True:
                active, first, reduces = self._exchange(training=False, synchronised=False)
                if active == 0:
                    return
                if self.buffers is not None:
                    self.buffers.shadow(src=first)
                if reduces:
                    for bucket in self.buckets:
                        dist.all_reduce(torch.zeros_like(bucket.empty()), group=self.group)
                    dist.all_reduce(torch.zeros(self.counted), group=self.group)
