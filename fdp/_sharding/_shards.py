"""The sharding seam: how a strategy splits a parameter tree across ranks, and its state.

A sharding strategy plugs in here by describing its split as a
:class:`Shards` layout (which rank holds which elements of each leaf):
``fdp.ZeroRedundancy`` plans one from its own buckets (:func:`plan`),
``fdp.FullyShardedDataParallel`` from its units' buckets
(:func:`from_buckets`). Whatever holds such a layout, a :class:`ZeroState`
carries it, ``fdp.save_checkpoint``/``load_checkpoint`` reshard it by
element ranges to another world size or into unsharded leaves
(``fdp/_sharding/_checkpoint.py``), and an ``fdp.optim`` optimizer steps
its slices as if they were parameters.

ZeRO's split: the trained leaves (floating-point and complex tensors) are planned into
buckets as for DDP (``fdp/_bucket.py``). Each bucket's elements (complex
leaves as real pairs, every leaf in its memory order) are padded to a
multiple of the world size and cut into equal slices, one per rank, so a
slice may start or end inside a leaf and only the last rank's share of a
bucket is smaller, by the padding (fewer than ``world`` elements). A rank
keeps optimizer state only for its slice: per bucket, one segment per leaf
its slice touches, which the wrapped optimizer updates as if they were
parameters. A step reduce-scatters the gradients (stage 1: all-reduces
them and keeps its slice), updates its segments, and all-gathers the new
parameters; bucket k's all-gather is in flight while bucket k+1 is updated
(``fdp/_sharding/_zero.py``).

Eager and compiled steps use the bucket's one element order (each leaf in
its memory order, :meth:`fdp._bucket.Bucket.pieces`) and segments, so a
state built eagerly steps compiled and the other way round, and a
checkpoint (``fdp/_sharding/_checkpoint.py``) reshards it by element ranges.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from fdp import _bucket, _tree


@dataclasses.dataclass(frozen=True)
class Segment:
    """Elements ``[lo, hi)`` of leaf ``leaf`` (in memory order), at ``at`` in the slice."""

    leaf: int
    j: int  # the leaf's position in its bucket
    lo: int
    hi: int
    at: int


@dataclasses.dataclass(frozen=True)
class Part:
    """One bucket as this rank sees it: ``size`` elements per rank, and its own segments."""

    bucket: _bucket.Bucket
    size: int
    segments: tuple[Segment, ...]


@dataclasses.dataclass(frozen=True, eq=False)
class Shards:
    """How one ``ZeroRedundancy`` splits its tree; a ``ZeroState`` carries it.

    ``placements[i]`` lists, for leaf ``i``, every rank's piece as
    ``(rank, start, length)`` over the leaf's ``numel[i]`` (real) elements:
    what a checkpoint needs to write and to reshard the state.
    """

    rank: int
    world: int
    group: ProcessGroup | None
    parts: tuple[Part, ...]
    paths: tuple[str, ...]
    numel: dict[int, int]
    dtypes: dict[int, torch.dtype]
    placements: dict[int, tuple[tuple[int, int, int], ...]]


def _segments(bucket: _bucket.Bucket, size: int, rank: int) -> tuple[Segment, ...]:
    start, stop = rank * size, (rank + 1) * size
    out = []
    for j, i in enumerate(bucket.indices):
        off = bucket.offsets[j]
        n = bucket.width(j)
        lo, hi = max(off, start), min(off + n, stop)
        if lo < hi:
            out.append(Segment(i, j, lo - off, hi - off, lo - start))
    return tuple(out)


def plan(
    params: Any, tensors: Sequence[torch.Tensor | None], *, cap: int, group: ProcessGroup | None
) -> Shards:
    """The buckets, slices and segments of ``tensors`` (the trained leaves of ``params``)."""
    return from_buckets(params, _bucket.plan(tensors, cap_bytes=cap), tensors, group=group)


def from_buckets(
    params: Any,
    buckets: Sequence[_bucket.Bucket],
    tensors: Sequence[torch.Tensor | None],
    *,
    group: ProcessGroup | None,
) -> Shards:
    """The slices and segments of ``buckets`` (over ``tensors``, the leaves of ``params``)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    parts: list[Part] = []
    placements: dict[int, list[tuple[int, int, int]]] = {}
    for bucket in buckets:
        size = -(-bucket.numel // world)
        parts.append(Part(bucket, size, _segments(bucket, size, rank)))
        for r in range(world):
            for s in _segments(bucket, size, r):
                placements.setdefault(s.leaf, []).append((r, s.lo, s.hi - s.lo))
    numel = {i: _bucket.real_numel(t) for i, t in enumerate(tensors) if t is not None}
    dtypes = {i: part.bucket.dtype for part in parts for i in part.bucket.indices}
    return Shards(
        rank=rank,
        world=world,
        group=group,
        parts=tuple(parts),
        paths=tuple(_tree.paths(params, "")),
        numel=numel,
        dtypes=dtypes,
        placements={i: tuple(v) for i, v in placements.items()},
    )


class ZeroState:
    """This rank's shard of the optimizer state, from :meth:`ZeroRedundancy.init`.

    ``slots[name][k][s]`` is the optimizer's ``name`` entry (``"step"``,
    ``"exp_avg"``, ...) for segment ``s`` of bucket ``k``; ``shards`` says
    which elements of which leaf each segment holds. Pass it back to
    :meth:`ZeroRedundancy.step`, or to :func:`fdp.save_checkpoint`.
    """

    __slots__ = ("shards", "slots")

    def __init__(self, slots: dict[str, list[list[Any]]], shards: Shards) -> None:
        self.slots = slots
        self.shards = shards

    def __repr__(self) -> str:
        held = sum(t.numel() for v in self.slots.values() for ts in v for t in ts if t is not None)
        return (
            f"fdp.ZeroState(rank {self.shards.rank} of {self.shards.world}, "
            f"slots {sorted(self.slots)}, {held} elements)"
        )
