"""Whole-leaf optimizers on shards: each leaf orthogonalized once, on its owner rank.

ZeRO and fully sharded training cut leaves into flat slices across ranks;
Muon's Newton-Schulz iteration needs each whole matrix. A step here: every
rank computes the directions of its slices (element by
element, ``WholeLeafOptimizer.begin``); one all-to-all sends each leaf's
pieces to the leaf's *owner*; each owner puts its leaves together, runs
``transform`` once per leaf (same-shaped leaves stacked, one call), and a
second all-to-all sends each piece of the updates back, where
``WholeLeafOptimizer.finish`` applies them to the slices. No leaf is
transformed twice in the group, and one exchange moves at most a bucket
cap's worth of whole leaves (25 MiB; a larger leaf alone), so an owner holds
at most that much at once.

Owners are planned once, greedily from the largest cost down to the least
loaded rank, the cost of a matrix being Newton-Schulz's ``m * n * min(m,
n)`` per matrix of a stack. Which leaves are stepped depends on the
gradients' ``None`` pattern, which the strategies check is the same on
every rank, so every rank runs the same all-to-alls.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.distributed import ProcessGroup

from fdp import _bucket
from fdp._comm import _raw
from fdp._sharding._shards import Part, Shards
from fdp.optim._whole import WholeLeafOptimizer, plan_owners, transform_stack

Transform = Callable[[torch.Tensor], torch.Tensor]


class Owners:
    """Who transforms each whole leaf of a sharded layout, and the exchange that does it."""

    def __init__(
        self,
        layout: Shards,
        optimizers: dict[int, WholeLeafOptimizer],
        group: ProcessGroup | None,
        *,
        cap: int = int(_bucket.BUCKET_CAP_MB * 2**20),
    ) -> None:
        self.layout, self.optimizers, self.group = layout, optimizers, group
        self.cap = cap  # the bytes of whole leaves one exchange moves (all ranks' pieces)
        self.shapes: dict[int, torch.Size] = {}
        self.orders: dict[int, tuple[int, ...]] = {}
        for part in layout.parts:
            for j, i in enumerate(part.bucket.indices):
                if i in optimizers:
                    self.shapes[i], self.orders[i] = part.bucket.shapes[j], part.bucket.order(j)
        self.owner = plan_owners(self.shapes, layout.world)

    def shapes_of(self, part: Part) -> list[torch.Size | None]:
        """The whole leaves' shapes, one per segment of ``part`` (``finish``'s ``shapes``)."""
        return [self.shapes.get(s.leaf) for s in part.segments]

    def exchange(
        self,
        parts: Sequence[Part],
        directions: Sequence[Sequence[torch.Tensor | None]],
        stepped: set[int],
    ) -> list[list[torch.Tensor | None]]:
        """Each part's segments' updates from their directions (``None`` where none).

        ``directions[k]`` are part ``k``'s, a tensor per segment; ``stepped``:
        the leaves stepped this time, the same on every rank. One pair of
        all-to-alls per dtype of the parts, whatever their number.
        """
        out: list[list[torch.Tensor | None]] = [[None] * len(p.segments) for p in parts]
        kinds: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        for k, part in enumerate(parts):
            kinds.setdefault((part.bucket.dtype, part.bucket.device), []).append(k)
        for ks in kinds.values():
            at: dict[int, tuple[int, int]] = {}  # leaf -> (part, segment) on this rank
            leaves = []
            for k in ks:
                leaves += [
                    i for i in parts[k].bucket.indices if i in stepped and i in self.optimizers
                ]
                at |= {s.leaf: (k, j) for j, s in enumerate(parts[k].segments)}
            like = part_like(parts[ks[0]])
            for chunk in self._chunks(leaves, like.element_size()):
                self._exchange(chunk, at, parts, directions, out, like)
        return out

    def _chunks(self, leaves: list[int], itemsize: int) -> list[list[int]]:
        """``leaves`` in runs of at most ``cap`` bytes (a leaf at least): what an owner holds."""
        runs: list[list[int]] = []
        size = 0
        for i in leaves:
            nbytes = self.shapes[i].numel() * itemsize
            if not runs or size + nbytes > self.cap:
                runs.append([])
                size = 0
            runs[-1].append(i)
            size += nbytes
        return runs

    def _exchange(
        self,
        leaves: list[int],
        at: dict[int, tuple[int, int]],
        parts: Sequence[Part],
        directions: Sequence[Sequence[torch.Tensor | None]],
        out: list[list[torch.Tensor | None]],
        like: torch.Tensor,
    ) -> None:
        """There (pieces to owners), transformed, and back: ``out`` gets the updates."""
        world, rank = self.layout.world, self.layout.rank
        mine = [i for i in leaves if i in at]
        send = [[i for i in mine if self.owner[i] == r] for r in range(world)]
        length = {i: _length(parts[at[i][0]], at[i][1]) for i in mine}
        chunks = [_direction(directions, at[i], i) for r in range(world) for i in send[r]]
        pieces = {i: _pieces(self.layout, i) for i in leaves if self.owner[i] == rank}
        receive = [sum(n for i in pieces for q, n in pieces[i] if q == r) for r in range(world)]
        sizes = [sum(length[i] for i in s) for s in send]
        flat = torch.cat(chunks) if chunks else like
        got = _raw.all_to_all_split(flat, receive, sizes, group=self.group)
        back = self._transform(got, receive, pieces)
        returned = _raw.all_to_all_split(back, sizes, receive, group=self.group)
        order = [i for s in send for i in s]  # by owner, then in leaf order
        for i, piece in zip(
            order, returned.split_with_sizes([length[i] for i in order]), strict=True
        ):
            k, j = at[i]
            out[k][j] = piece

    def _transform(
        self,
        got: torch.Tensor,
        receive: list[int],
        pieces: dict[int, list[tuple[int, int]]],
    ) -> torch.Tensor:
        """The owned leaves put together, transformed, and cut back into the same pieces.

        Each same-shaped group of leaves is assembled straight into its
        stack's rows, and the updates' pieces straight into the buffer that
        goes back (cast to the leaves' dtype there): one copy each way.
        """
        held = _held(got, receive, pieces, self.layout.world)
        updates: dict[int, torch.Tensor] = {}
        for group in self._stacks(list(pieces)):
            first = group[0]
            rows = got.new_empty((len(group), self.shapes[first].numel()))
            for row, i in zip(rows.unbind(0), group, strict=True):
                torch.cat(held[i], out=row)
            stacked = _bucket.memory_unflat_rows(rows, self.shapes[first], self.orders[first])
            done = transform_stack(self.optimizers[first].transform, stacked)
            updates |= dict(zip(group, done.unbind(0), strict=True))
        back: list[list[torch.Tensor]] = [[] for _ in range(self.layout.world)]
        for i in pieces:  # in leaf order, as each rank sent them
            cut = _bucket.memory_flat(updates[i], self.orders[i]).split_with_sizes(
                [n for _, n in pieces[i]]
            )
            for (q, _), piece in zip(pieces[i], cut, strict=True):
                back[q].append(piece)
        out = [p for pieces_to_q in back for p in pieces_to_q]  # by rank, then in leaf order
        if not out:  # owns nothing in this exchange
            return got.new_empty(0)
        return torch.cat(out, out=got.new_empty(sum(p.numel() for p in out)))

    def _stacks(self, owned: list[int]) -> list[list[int]]:
        """``owned`` in groups that one ``transform`` call takes: optimizer, shape and order."""
        groups: dict[tuple[int, torch.Size, tuple[int, ...]], list[int]] = {}
        for i in owned:
            key = (id(self.optimizers[i]), self.shapes[i], self.orders[i])
            groups.setdefault(key, []).append(i)
        return list(groups.values())


def _held(
    got: torch.Tensor, receive: list[int], pieces: dict[int, list[tuple[int, int]]], world: int
) -> dict[int, list[torch.Tensor]]:
    """Each owned leaf's received pieces, in rank order (views of ``got``)."""
    by_rank = got.split_with_sizes(receive)
    held: list[list[torch.Tensor]] = []
    for r in range(world):  # rank r's pieces come in leaf order
        held.append(
            list(by_rank[r].split_with_sizes([n for i in pieces for q, n in pieces[i] if q == r]))
        )
    cursor = [0] * world
    out: dict[int, list[torch.Tensor]] = {}
    for i in pieces:
        for q, _ in pieces[i]:
            out.setdefault(i, []).append(held[q][cursor[q]])
            cursor[q] += 1
    return out


def part_like(part: Part) -> torch.Tensor:
    """An empty tensor of ``part``'s dtype and device (a rank with nothing to send)."""
    return torch.empty(0, dtype=part.bucket.dtype, device=part.bucket.device)


def _length(part: Part, j: int) -> int:
    s = part.segments[j]
    return s.hi - s.lo


def _direction(
    directions: Sequence[Sequence[torch.Tensor | None]], where: tuple[int, int], leaf: int
) -> torch.Tensor:
    d = directions[where[0]][where[1]]
    if d is None:  # the None pattern is checked equal on every rank before the step
        raise RuntimeError(f"fdp internal error: no direction for stepped leaf {leaf}")
    return d


def _pieces(layout: Shards, i: int) -> list[tuple[int, int]]:
    """Leaf ``i``'s pieces as ``(rank, length)``, in rank (and element) order."""
    return [(r, n) for r, _, n in sorted(layout.placements[i], key=lambda p: p[1]) if n > 0]
