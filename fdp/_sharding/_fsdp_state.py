"""Fully sharded trees as checkpoint states: shards and optimizer states as ``ZeroState``s.

A unit's flat buffer is cut into equal slices exactly as a
``ZeroRedundancy`` bucket is (``fdp/_sharding/_shards.py``), so the same
segments describe which elements of which parameter leaf each rank holds,
and ``fdp.save_checkpoint`` writes them the same way: per parameter leaf,
one 1-D sharded entry of the leaf's elements, under the key an unsharded
tree would use (``['params']['blocks'][0]['w']``, or
``['opt']['exp_avg']['blocks'][0]['w']`` for an ``fdp.optim`` state). A
fully sharded checkpoint therefore loads into another world size, into
unsharded parameters (DDP, one process), and the other way round.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fdp._sharding._shards import Shards, ZeroState

# {unit name: (flat shard per bucket, ...)}: what FullyShardedDataParallel.shard returns.
ShardTree = Mapping[str, tuple[Any, ...]]


def to_state(layout: Shards, units: list[tuple[str, int]], value: Any, *, call: str) -> ZeroState:
    """``value`` (shards, or an ``fdp.optim`` state over them) as a ``ZeroState``.

    ``units`` lists each bucket of ``layout`` as (unit name, index in the
    unit's tuple). Shards become the slot ``""`` (the parameters
    themselves); an optimizer state keeps its slot names.
    """
    named = _slots(value, call=call)
    slots: dict[str, list[list[Any]]] = {}
    for name, tree in named.items():
        per_bucket = []
        for part, (unit, b) in zip(layout.parts, units, strict=True):
            flat = tree[unit][b]
            per_bucket.append([_segment(flat, seg) for seg in part.segments])
        slots[name] = per_bucket
    return ZeroState(slots, layout)


def from_state(layout: Shards, units: list[tuple[str, int]], state: ZeroState) -> Any:
    """The inverse of :func:`to_state`: shards, or an ``fdp.optim`` state over them."""
    out: dict[str, dict[str, list[Any]]] = {}
    for name, per_bucket in state.slots.items():
        tree: dict[str, list[Any]] = {}
        for part, (unit, _b), values in zip(layout.parts, units, per_bucket, strict=True):
            tree.setdefault(unit, []).append(_flat(name, part.size, values, part))
        out[name] = tree
    trees = {name: {u: tuple(v) for u, v in tree.items()} for name, tree in out.items()}
    return trees[""] if set(trees) == {""} else trees


def _slots(value: Any, *, call: str) -> dict[str, ShardTree]:
    if isinstance(value, Mapping) and value and all(isinstance(v, tuple) for v in value.values()):
        return {"": value}  # shards
    if isinstance(value, Mapping) and "step" in value:
        return dict(value)  # an fdp.optim state over the shards
    raise TypeError(
        f"{call}: `value` expected the shards (FullyShardedDataParallel.shard) or an "
        f"fdp.optim state over them; got {type(value).__name__}"
    )


def _segment(flat: Any, seg: Any) -> Any:
    """Segment ``seg`` of a flat shard (a view), or a scalar (a step) as it is."""
    if isinstance(flat, torch.Tensor) and flat.dim() == 1:
        return flat[seg.at : seg.at + seg.hi - seg.lo]
    return flat


def _flat(name: str, size: int, values: list[Any], part: Any) -> Any:
    """A flat shard from its segments (zeros in the padding), or the scalar they share.

    A shard that holds only padding has no segment: zeros (its step, which
    only ever scales zeros, restarts at 0).
    """
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if not tensors and name == "step":  # fdp.optim's steps: one float64 scalar per shard
        return torch.zeros((), dtype=torch.float64, device=part.bucket.device)
    if not tensors:
        return torch.zeros(size, dtype=part.bucket.dtype, device=part.bucket.device)
    if tensors[0].dim() == 0:
        return tensors[0]
    flat = tensors[0].new_zeros(size)
    for seg, v in zip(part.segments, values, strict=True):
        flat[seg.at : seg.at + seg.hi - seg.lo] = v
    return flat
