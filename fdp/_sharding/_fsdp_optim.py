"""``fdp.optim.param_groups`` over a ``FullyShardedDataParallel``'s shards, labelled per leaf.

A shard is one flat 1-D slice of a unit's buffer and may hold pieces of
several leaves, so a label function that looks at the tensor (``t.ndim <=
1``: no weight decay) would see only 1-D shards and put every element in one
group. :class:`ShardedGroups` labels each piece (a segment, as
``ZeroRedundancy`` cuts its slices) by the leaf it comes from, labels taken
once from the tree given at construction, and steps each group's optimizer
on its own segments. The state keeps the plain optimizer's format over the
shards (``opt.init(shards)``), so checkpoints take it unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fdp._sharding import _owners
from fdp._sharding._shards import Part, Segment, Shards
from fdp.optim import _param_groups

ShardTree = dict[str, tuple[torch.Tensor, ...]]


class ShardedGroups:
    """``param_groups`` bound to one ``FullyShardedDataParallel``'s shards (``fsdp.optimizer``)."""

    def __init__(
        self,
        groups: _param_groups.ParamGroups,
        labels: Sequence[str | None],
        layout: Shards,
        where: Sequence[tuple[str, int]],
        *,
        owners: _owners.Owners | None = None,
    ) -> None:
        self.groups, self.slots, self._owners = groups, groups.slots, owners
        self._parts, self._where = layout.parts, list(where)  # part k is where[k]'s shard
        segment_labels = [labels[s.leaf] for part in layout.parts for s in part.segments]
        self._bound = groups.bind(segment_labels)

    def __repr__(self) -> str:
        return f"fdp.FullyShardedDataParallel.optimizer({self.groups!r})"

    def init(self, shards: ShardTree) -> dict[str, Any]:
        """The state before the first step, over the shards: every group's slots on each
        (a shard holds several groups' pieces)."""
        return self.groups.init_every(shards)

    def update(
        self, grads: ShardTree, state: dict[str, Any], shards: ShardTree, *, donate: bool = False
    ) -> tuple[ShardTree, dict[str, Any]]:
        """One step of every group's optimizer on the segments of its leaves."""
        keys = ("step", *self.slots)
        p: list[torch.Tensor] = []
        g: list[torch.Tensor | None] = []
        s: dict[str, list[torch.Tensor]] = {k: [] for k in keys}
        for part, (unit, b) in zip(self._parts, self._where, strict=True):
            grad = grads[unit][b]
            for seg in part.segments:
                p.append(_piece(shards[unit][b], seg))
                g.append(None if grad is None else _piece(grad, seg))
                # One step per segment: a donated step adds to each in place.
                s["step"].append(state["step"][unit][b].clone())
                for k in self.slots:
                    s[k].append(_piece(state[k][unit][b], seg))
        if self._owners is None:
            new_p, new_s = self._bound.update(g, s, p, donate=donate)
        else:
            new_p, new_s = self._whole_step(grads, (p, g, s), donate)
        return self._assemble(shards, state, new_p, new_s, keys, donate=donate)

    def _whole_step(
        self, grads: ShardTree, segments: tuple[list[Any], list[Any], dict[str, Any]], donate: bool
    ) -> tuple[list[torch.Tensor], dict[str, list[torch.Tensor]]]:
        """Whole-leaf groups (Muon): each leaf transformed on its owner (``_owners.py``)."""
        owners = self._owners
        if owners is None:
            raise RuntimeError("fdp internal error: a whole-leaf step without owners")
        p, g, s = segments
        pending = self._bound.begin(g, s, p, donate=donate)
        stepped = {
            i
            for part, (unit, b) in zip(self._parts, self._where, strict=True)
            if grads[unit][b] is not None
            for i in part.bucket.indices
        }
        per_part, n = [], 0
        for part in self._parts:
            per_part.append(pending.directions[n : n + len(part.segments)])
            n += len(part.segments)
        done = owners.exchange(self._parts, per_part, stepped)  # every unit at once
        updates = [u for part_updates in done for u in part_updates]
        shapes = [shape for part in self._parts for shape in owners.shapes_of(part)]
        new_p, new_s = pending.finish(updates, shapes=shapes)
        return new_p, new_s

    def _assemble(
        self,
        shards: ShardTree,
        state: dict[str, Any],
        new_p: list[torch.Tensor],
        new_s: dict[str, list[torch.Tensor]],
        keys: tuple[str, ...],
        *,
        donate: bool,
    ) -> tuple[ShardTree, dict[str, Any]]:
        """The new shards and state from the segments' (written in place when donated)."""
        out_p: dict[str, list[torch.Tensor]] = {u: list(ts) for u, ts in shards.items()}
        out_s = {k: {u: list(ts) for u, ts in state[k].items()} for k in keys}
        n = 0
        for part, (unit, b) in zip(self._parts, self._where, strict=True):
            count = len(part.segments)
            if count:
                step = new_s["step"][n]
                if donate:
                    with torch.no_grad():
                        out_s["step"][unit][b].copy_(step)
                else:
                    out_s["step"][unit][b] = step
                    old = shards[unit][b]
                    out_p[unit][b] = _joined(old, part, new_p[n : n + count])
                    for k in self.slots:
                        out_s[k][unit][b] = _joined(
                            state[k][unit][b], part, new_s[k][n : n + count]
                        )
            n += count
        tuples = {u: tuple(ts) for u, ts in out_p.items()}
        return tuples, {k: {u: tuple(ts) for u, ts in v.items()} for k, v in out_s.items()}


def _piece(t: torch.Tensor, seg: Segment) -> torch.Tensor:
    """Segment ``seg`` of a shard (a view; detached from a leaf, as the optimizer's inputs)."""
    base = t.detach() if t.grad_fn is None else t
    return base[seg.at : seg.at + seg.hi - seg.lo]


def _joined(old: torch.Tensor, part: Part, pieces: Sequence[torch.Tensor]) -> torch.Tensor:
    """``old`` with its segments replaced by ``pieces`` (the padding kept)."""
    out, at = [], 0
    for seg, piece in zip(part.segments, pieces, strict=True):
        if seg.at > at:
            out.append(old.detach()[at : seg.at])
        out.append(piece)
        at = seg.at + seg.hi - seg.lo
    if at < old.numel():
        out.append(old.detach()[at:])
    joined = torch.cat(out)
    return joined.requires_grad_(old.requires_grad) if joined.grad_fn is None else joined


def holds_shards(units: Sequence[Any], tree: Any, *, none_ok: bool = False) -> bool:
    """Whether ``tree`` is a shards dict of these units (``fsdp.shard``'s format).

    ``none_ok``: a ``None`` may stand for a shard (a gradient tree: a unit
    no backward reached).
    """
    if not isinstance(tree, dict) or list(tree) != [u.name for u in units]:
        return False
    for unit in units:
        shards = tree[unit.name]
        if not isinstance(shards, tuple) or len(shards) != len(unit.sizes):
            return False
        for t, size in zip(shards, unit.sizes, strict=True):
            if t is None and none_ok:
                continue
            if not isinstance(t, torch.Tensor) or t.shape != (size,):
                return False
    return True
