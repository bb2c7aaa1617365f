"""The leaves of a checkpointed state: each one's DCP entries, and the leaf rebuilt after a load.

A tensor is one entry, written once for every rank (a module's buffers:
rank 0's); a ``ZeroState`` one sharded entry per slot and parameter leaf,
each rank writing its pieces; any other value DCP's bytes. Loading, a leaf
gives DCP tensors to read into (laid out like ``like``), and builds its
result from them (``fdp/_sharding/_checkpoint.py`` runs both).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import optree
import torch

from fdp import _bucket, _compat, _functional
from fdp._sharding import _checkpoint_match
from fdp._sharding._shards import Shards, ZeroState

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

__all__ = ["Leaf", "Reshaped", "TensorLeaf", "ZeroLeaf", "leaves_of"]

_RNG = _checkpoint_match.RNG


class Leaf:
    """One leaf of the state: its DCP entries, and the leaf rebuilt from loaded entries."""

    def __init__(self, key: str, value: Any) -> None:
        self.key = key
        self.entries: dict[str, Any] = {key: value}

    def result(self, entries: dict[str, Any]) -> Any:
        return entries.get(self.key)

    def once(self) -> dict[str, Any]:
        """The entries written once for every rank (verified equal before a save)."""
        return self.entries

    def reshaped(self, key: str, saved: TensorStorageMetadata) -> Reshaped | None:
        """What to load entry ``key`` through when the checkpoint holds another shape."""
        return None


# A tensor for DCP to load into, and what to do with it after the load.
Reshaped = tuple[torch.Tensor, Callable[[], None]]


class TensorLeaf(Leaf):
    def __init__(self, key: str, t: torch.Tensor, *, fresh: bool) -> None:
        # A module's own parameter or buffer in `like` is loaded into in place,
        # as DCP does: new tensors would leave the module (and a torch
        # optimizer over its parameters) behind.
        self.own = t if fresh and _functional.module_tensor(t) and _holds_data(t) else None
        super().__init__(key, torch.empty_like(t) if fresh and self.own is None else t.detach())
        self.tensor, self.requires_grad = self.entries[key], t.requires_grad
        self.buffer = _functional.module_tensor(t) and not isinstance(t, torch.nn.Parameter)

    def result(self, entries: dict[str, Any]) -> Any:
        if self.own is not None:
            return self.own
        # Loaded in place; a leaf of `like` that requires grad gives one that does.
        out: torch.Tensor = self.tensor
        return out.requires_grad_() if self.requires_grad else out

    def once(self) -> dict[str, Any]:
        # A module's buffers drift between DDP's broadcasts: rank 0's are saved.
        return {} if self.buffer else self.entries

    def reshaped(self, key: str, saved: TensorStorageMetadata) -> Reshaped | None:
        """A ``ZeroState`` entry (the leaf's elements, 1-D) loaded into an unsharded leaf."""
        t = self.tensor
        if len(saved.size) != 1 or saved.size[0] != _bucket.real_numel(t):
            return None
        view = _bucket.memory_flat(t, _bucket.memory_order(t))
        if view.data_ptr() != t.data_ptr() or not view.is_contiguous():
            return None  # not a view: loading into it would not reach t
        return view, lambda: None


class ZeroLeaf(Leaf):
    """A ``ZeroState``: per slot and parameter leaf, one sharded entry (or a scalar)."""

    def __init__(self, key: str, state: ZeroState, *, fresh: bool) -> None:
        self.key, self.entries = key, {}
        slots = {
            name: [[_fresh(t) if fresh else t for t in seg] for seg in per_bucket]
            for name, per_bucket in state.slots.items()
        }
        self.state = ZeroState(slots, state.shards)
        shards = state.shards
        # Pieces are saved in each leaf's memory order: saved with it, checked at load.
        self.orders_key = f"{key}.memory_orders"
        self.orders = {
            shards.paths[i]: part.bucket.order(j)
            for part in shards.parts
            for j, i in enumerate(part.bucket.indices)
        }
        # A string: DCP would flatten a dict into one entry per key.
        self.entries[self.orders_key] = json.dumps({k: list(v) for k, v in self.orders.items()})
        self.pieces: dict[str, tuple[Any, torch.Tensor, tuple[int, ...]]] = {}
        # Every rank's entries, not only the pieces this rank reads: what it stands for.
        self.covers = {
            f"{key}{f'[{name!r}]' if name else ''}{path}" for name in slots for path in shards.paths
        }
        for name, per_bucket in slots.items():
            for part, values in zip(shards.parts, per_bucket, strict=True):
                for seg, t in zip(part.segments, values, strict=True):
                    if isinstance(t, torch.Tensor):
                        # The slot "" is the parameters themselves (fully sharded).
                        slot = f"[{name!r}]" if name else ""
                        entry = f"{key}{slot}{shards.paths[seg.leaf]}"
                        self.entries[entry] = _piece(shards, seg, t)
                        self.pieces[entry] = (seg, t, part.bucket.order(seg.j))

    def result(self, entries: dict[str, Any]) -> Any:
        return self.state

    def once(self) -> dict[str, Any]:
        # Each rank writes its own pieces, and a 0-d step of the leaves it holds
        # pieces of (the ranks holding one step each, alike: one optimizer);
        # the layout record is every rank's.
        return {self.orders_key: self.entries[self.orders_key]}

    def check_orders(self, call: str, saved: Any) -> None:
        """Refuses a ZeroState saved with leaves laid out otherwise (channels_last vs not)."""
        saved = json.loads(saved) if isinstance(saved, str) else {}
        for path, order in self.orders.items():
            was = saved.get(path, order)
            if tuple(was) != tuple(order):
                raise ValueError(
                    f"{call}: `like` leaf like{self.key} (a ZeroState) holds parameter {path} "
                    f"in memory order {tuple(order)}; the checkpoint saved its pieces in memory "
                    f"order {tuple(was)} (e.g. channels_last vs contiguous): give the "
                    "parameters the saving run's memory format before zero.init"
                )

    def reshaped(self, key: str, saved: TensorStorageMetadata) -> Reshaped | None:
        """An unsharded entry (the whole leaf) read whole, then this rank's pieces copied."""
        found = self.pieces.get(key)
        if found is None or found[1].dim() != 1:
            return None
        seg, piece, order = found
        dtype = saved.properties.dtype
        width = 2 if dtype is not None and dtype.is_complex else 1
        if saved.size.numel() * width != self.state.shards.numel[seg.leaf]:
            return None
        whole = torch.empty(saved.size, dtype=dtype, device=piece.device)

        def fill() -> None:
            piece.copy_(_bucket.memory_flat(whole, order)[seg.lo : seg.hi])

        return whole, fill


def _holds_data(t: torch.Tensor) -> bool:
    """Whether ``t`` has its elements (not a parameter ``fsdp.wrap`` released)."""
    return t.numel() == 0 or t.untyped_storage().nbytes() > 0


def _fresh(t: Any) -> Any:
    return torch.empty_like(t) if isinstance(t, torch.Tensor) else t


def _piece(shards: Shards, seg: Any, t: torch.Tensor) -> torch.Tensor:
    """Segment ``seg``'s tensor ``t`` as DCP should see it.

    A tensor of the segment's length is this rank's piece of the leaf's
    elements; any other (a 0-d step) is the same on every rank holding the
    leaf, and is written once.
    """
    if t.dim() != 1 or t.numel() != seg.hi - seg.lo:
        return t.detach()
    return _compat.sharded_tensor(
        [(t.detach(), seg.lo)],
        list(shards.placements[seg.leaf]),
        shards.numel[seg.leaf],
        t.dtype,
        shards.group,
    )


def leaves_of(call: str, arg: str, tree: Any, *, fresh: bool) -> tuple[Any, list[Leaf]]:
    flat, spec = optree.tree_flatten(
        tree, is_leaf=lambda x: isinstance(x, ZeroState), none_is_leaf=True
    )
    paths = [
        a.codify("")
        for a in optree.tree_accessors(
            tree, is_leaf=lambda x: isinstance(x, ZeroState), none_is_leaf=True
        )
    ]
    out: list[Leaf] = []
    for key, value in zip(paths, flat, strict=True):
        if key.startswith(_RNG):
            raise ValueError(f"{call}: `{arg}` leaf {arg}{key}: the prefix {_RNG} is fdp's")
        if isinstance(value, ZeroState):
            out.append(ZeroLeaf(key, value, fresh=fresh))
        elif isinstance(value, torch.Tensor):
            if value.layout != torch.strided:
                raise TypeError(
                    f"{call}: `{arg}` leaf {arg}{key} expected a dense tensor; got layout "
                    f"{value.layout}"
                )
            out.append(TensorLeaf(key, value, fresh=fresh))
        else:
            out.append(Leaf(key, value))
    return spec, out
