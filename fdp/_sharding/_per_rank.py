"""``fdp.PerRank``: a part of a checkpointed state that is each rank's own.

Everything else in a state is replicated and written once, after every rank's
bits are compared (``fdp/_sharding/_checkpoint_verify.py``). What is each
rank's own by design (a DiLoCo or LocalSGD worker's parameters and inner
optimizer state, a per-rank data position) is marked ``PerRank``: each rank
writes its own values under its own entries and, at the world size that
saved them, reads its own back.

A ``PerRank(value)`` at path ``p`` is saved as a dict at ``p`` with the one
key :func:`_rank_key` (``'_fdp/rank 1 of 2'``), so every rank's entries have
keys of their own (DCP writes each on its rank), and the rest of the
checkpoint code (torch optimizers, tensors loaded in place, ties) treats
the value as any other subtree.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import optree

from fdp._sharding._shards import ZeroState

__all__ = ["Expanded", "PerRank", "expand"]

V = TypeVar("V")
_PREFIX = "_fdp/rank "
MARK = f"['{_PREFIX}"  # in an entry's key: one rank's own value lies under it
_KEY = re.compile(re.escape(MARK) + r"(\d+) of (\d+)'\]")


class PerRank(Generic[V]):
    """Marks a part of a checkpointed state as each rank's own, not replicated.

    :func:`fdp.save_checkpoint` writes the state's other leaves once, after
    checking that every rank holds the same bits; it refuses leaves that
    differ. Wrap what differs by design in ``PerRank``: each rank writes its
    own ``value`` (any pytree: tensors, Python values, an ``fdp.optim``
    state, a torch optimizer), and :func:`fdp.load_checkpoint` with a
    ``PerRank`` in ``like`` gives each rank back its own, as a ``PerRank``.
    It loads only at the world size that saved it (there is no rule that
    maps one rank's values to another world size): at another one, every
    rank raises, naming the leaf and both sizes. Inside, the value may have
    another structure on each rank; it may not hold a ``ZeroState`` or
    another ``PerRank``.

    Args:
        value: this rank's part of the state.

    Example::

        saved = {"worker": fdp.PerRank({"params": params, "opt": state}), "step": step}
        fdp.save_checkpoint(f"ckpt/step_{step}", saved)
        loaded = fdp.load_checkpoint(found, like=saved)
        params, state = loaded["worker"].value["params"], loaded["worker"].value["opt"]
    """

    __slots__ = ("value",)

    def __init__(self, value: V) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"fdp.PerRank({self.value!r})"


def _rank_key(rank: int, world: int) -> str:
    return f"{_PREFIX}{rank} of {world}"


class Expanded:
    """A state with each ``PerRank`` replaced by a dict of this rank's one key.

    ``tree``: the state the checkpoint code works on; ``prefixes``: each
    ``PerRank``'s path (``"['worker']"``) -> the prefix of this rank's
    entries under it; ``restore``: turns a loaded expanded tree back into
    ``PerRank``s.
    """

    def __init__(
        self, tree: Any, prefixes: dict[str, str], restore: Callable[[Any], Any], world: int
    ) -> None:
        self.tree, self.prefixes, self.restore, self.world = tree, prefixes, restore, world

    def ranked(self, key: str) -> bool:
        """Whether entry ``key`` is one of this rank's own."""
        return any(key.startswith(p) for p in self.prefixes.values())

    def others(self, call: str, metadata: dict[str, Any]) -> set[str]:
        """The entries of the other ranks' ``PerRank`` values, checked against this world size.

        Raises where the checkpoint's ``PerRank`` entries at a path were
        saved by another number of ranks, or where it holds a value saved
        for every rank (without ``PerRank``).
        """
        covered = set()
        for path, mine in self.prefixes.items():
            shared = [
                k
                for k in metadata
                if (k == path or k.startswith(f"{path}[")) and not _KEY.match(k, len(path))
            ]
            if shared:
                raise ValueError(
                    f"{call}: `like` leaf like{path} expected each rank's own values (it is an "
                    f"fdp.PerRank); the checkpoint holds one for every rank there ({shared[0]}, "
                    "saved without PerRank): load it without the PerRank"
                )
            saved = {
                int(m.group(2))
                for k in metadata
                if k.startswith(path) and (m := _KEY.match(k, len(path))) is not None
            }
            if saved and saved != {self.world}:
                by = " and ".join(map(str, sorted(saved)))
                raise ValueError(
                    f"{call}: `like` leaf like{path} (fdp.PerRank) was saved by {by} ranks; "
                    f"loading it on {self.world}: each rank's own values load only at the world "
                    "size that saved them (leave the PerRank out of `like`, with strict=False, "
                    "to load the rest)"
                )
            covered |= {
                k
                for k in metadata
                if k.startswith(path) and _KEY.match(k, len(path)) and not k.startswith(mine)
            }
        return covered


def _stops(x: Any) -> bool:
    return isinstance(x, (PerRank, ZeroState))


def expand(call: str, arg: str, tree: Any, *, rank: int, world: int) -> Expanded:
    """``tree`` with each ``PerRank(v)`` replaced by ``{'_fdp/rank r of w': v}``."""
    leaves, spec = optree.tree_flatten(tree, is_leaf=_stops, none_is_leaf=True)
    if not any(isinstance(x, PerRank) for x in leaves):
        return Expanded(tree, {}, lambda loaded: loaded, world)
    paths = [a.codify("") for a in optree.tree_accessors(tree, is_leaf=_stops, none_is_leaf=True)]
    key = _rank_key(rank, world)
    prefixes: dict[str, str] = {}
    out: list[Any] = list(leaves)
    for i, (path, leaf) in enumerate(zip(paths, leaves, strict=True)):
        if not isinstance(leaf, PerRank):
            continue
        inner = optree.tree_leaves(leaf.value, is_leaf=_stops, none_is_leaf=True)
        if any(_stops(x) for x in inner):
            kind = next(type(x).__name__ for x in inner if _stops(x))
            raise TypeError(
                f"{call}: `{arg}` leaf {arg}{path} (fdp.PerRank) expected a value of each rank's "
                f"own; got one holding a {kind} (a ZeroState is already split across ranks: "
                "put it beside the PerRank)"
            )
        prefixes[path] = f"{path}[{key!r}]"
        out[i] = {key: leaf.value}

    def restore(loaded: Any) -> Any:
        parts: list[Any] = spec.flatten_up_to(loaded)
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, PerRank):
                parts[i] = PerRank(parts[i][key])
        return optree.tree_unflatten(spec, parts)

    return Expanded(optree.tree_unflatten(spec, out), prefixes, restore, world)
