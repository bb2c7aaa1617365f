"""The plan of fully sharded parameters: which leaves form each unit, and its flat buffers."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed import ProcessGroup

from fdp import _bucket, _tree
from fdp._comm import _agreement

# A unit is packed whole: one flat buffer per dtype and device.
_WHOLE = 1 << 62


@dataclass(frozen=True)
class Unit:
    """One unit: its leaves (indices into the flattened tree) and their flat buffers."""

    name: str
    buckets: tuple[_bucket.Bucket, ...]  # indices are the tree's leaf indices
    sizes: tuple[int, ...]  # each bucket's shard: elements per rank


def owners(call: str, params: Any, units: Sequence[str] | None) -> list[str]:
    """Each leaf's unit name (tied leaves included, which no unit shards)."""
    return _owners(call, params, _tree.names(params), units)


def without_buffers(
    call: str,
    params: Any,
    leaves: list[Any],
    tensors: list[torch.Tensor | None],
    buffers: Sequence[str] | None,
) -> list[torch.Tensor | None]:
    """``tensors`` with ``None`` at the buffers: the leaves kept whole on every rank.

    ``buffers`` names their subtrees (dotted prefixes). ``None``: in a tree
    holding ``nn.Parameter`` leaves (``make_functional``'s state), every
    leaf that is not one and does not require grad, as ``fully_shard`` leaves a module's buffers
    unsharded so BatchNorm's in-place statistics land on each rank's own.
    """
    names = _tree.names(params)
    if buffers is None:
        if not any(isinstance(t, torch.nn.Parameter) for t in leaves):
            return tensors
        # A plain tensor that requires grad is trained: sharded, never a buffer.
        return [t if isinstance(leaves[i], torch.nn.Parameter) or leaves[i].requires_grad
                else None for i, t in enumerate(tensors)]  # fmt: skip
    _check_prefixes(call, "buffers", buffers, names)
    mine = [any(_under(n, b) for b in buffers) for n in names]
    return [None if buffer else t for t, buffer in zip(tensors, mine, strict=True)]


def borrowed(owner: Sequence[str], ties: dict[int, int]) -> dict[str, tuple[str, ...]]:
    """Per unit, the other units holding the tensors tied into it.

    ``ties`` maps a tied leaf to the first leaf of its tensor, the one
    sharded. Gathering a unit alone must gather these too: its tied leaves
    are the same gathered tensors (``p["head"]["unembed"] = p["embed"]``).
    """
    out: dict[str, list[str]] = {}
    for i, j in ties.items():
        if owner[i] != owner[j] and owner[j] not in out.setdefault(owner[i], []):
            out[owner[i]].append(owner[j])
    return {k: tuple(v) for k, v in out.items()}


def plan(
    call: str,
    params: Any,
    tensors: Sequence[torch.Tensor | None],
    units: Sequence[str] | None,
    world: int,
) -> tuple[Unit, ...]:
    """The units of ``params``: names, and their leaves planned into flat buffers."""
    owners = _owners(call, params, _tree.names(params), units)
    grouped: dict[str, list[int]] = {}
    for i, owner in enumerate(owners):
        if tensors[i] is not None:
            grouped.setdefault(owner, []).append(i)
    out = []
    for name, indices in grouped.items():
        buckets = []
        # Frozen leaves get buckets (so shards) of their own, which need no
        # gradient; complex leaves too, which keep their dtype under a policy.
        for kind in ((True, False), (True, True), (False, False), (False, True)):
            mine = [i for i in indices if _kind(tensors[i]) == kind]
            buckets += [  # indexed by the tree's leaves
                dataclasses.replace(b, indices=tuple(mine[j] for j in b.indices))
                for b in _bucket.plan([tensors[i] for i in mine], cap_bytes=_WHOLE)
            ]
        sizes = tuple(-(-b.numel // world) for b in buckets)
        out.append(Unit(name, tuple(buckets), sizes))
    return tuple(out)


def mesh_groups(call: str, group: Any, mesh: Any) -> tuple[Any, Any]:
    """(the shard group, the replica group or None) from ``group`` or a 2-D ``mesh``."""
    if mesh is None:
        return group, None
    if group is not None:
        raise ValueError(f"{call}: pass `group` or `mesh`, not both; got both")
    ndim = getattr(mesh, "ndim", None)
    if ndim != 2:
        raise ValueError(
            f"{call}: `mesh` expected a 2-D DeviceMesh (replicate, shard); got "
            f"{_tree.describe(mesh) if ndim is None else f'a {ndim}-D mesh'}"
        )
    return mesh.get_group(1), mesh.get_group(0)


def _kind(t: torch.Tensor | None) -> tuple[bool, bool]:
    return (t is not None and t.requires_grad, t is not None and t.is_complex())


def _owners(call: str, params: Any, names: list[str], units: Sequence[str] | None) -> list[str]:
    """Each leaf's unit name."""
    if units is None:
        return [_tree.block(parts) for parts in _tree.segments(params)]
    _check_prefixes(call, "units", units, names)
    for u in units:
        nested = [v for v in units if v != u and v.startswith(u + ".")]
        if nested or list(units).count(u) > 1:
            raise ValueError(
                f"{call}: `units` expected disjoint subtrees; got {u!r} and {nested or [u]}"
            )
    return [next((u for u in units if _under(n, u)), "") for n in names]


def _check_prefixes(call: str, arg: str, given: Sequence[str], names: list[str]) -> None:
    """Raises unless ``given`` is a sequence of dotted names each holding a leaf."""
    if isinstance(given, str):
        raise TypeError(f"{call}: `{arg}` expected a sequence of dotted names; got {given!r}")
    for g in given:
        if not any(_under(n, g) for n in names):
            raise ValueError(
                f"{call}: `{arg}` names {g!r}, which holds no leaf of `params`; expected "
                f"a dotted prefix of the leaf names, e.g. {names[:3]}"
            )


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def subtree(tree: Any, name: str) -> Any:
    """The subtree of ``tree`` at the dotted ``name`` (``""``: the tree).

    In a dict whose keys hold dots (a flat state), the entries under
    ``name`` with the rest of their key, as the block's own
    ``named_parameters`` names them.
    """
    rest = name
    while rest:
        if isinstance(tree, dict):
            if rest in tree:
                return tree[rest]
            key = next((k for k in tree if isinstance(k, str) and rest.startswith(k + ".")), None)
            if key is None:
                prefix = rest + "."
                return {k[len(prefix) :]: v for k, v in tree.items() if k.startswith(prefix)}
            tree, rest = tree[key], rest[len(key) + 1 :]
            continue
        part, _, rest = rest.partition(".")
        if isinstance(tree, (list, tuple)) and part.isdigit() and not hasattr(tree, "_fields"):
            tree = tree[int(part)]
        else:
            tree = getattr(tree, part)
    return tree


def checked_params(
    call: str, params: Any, group: ProcessGroup | None, replicas: ProcessGroup | None
) -> tuple[list[Any], Any, list[torch.Tensor | None]]:
    """``params``' leaves, spec and float tensors: the same tree and values on every rank."""
    with _agreement.local_checks(call, "params", group):  # an error on one rank: on every
        _agreement.require_member(call, group)
        leaves, spec, tensors = _tree.tensor_leaves(
            params, call=call, arg="params", float_only=True
        )
        described = _agreement.signature(params, leaves, "params", requires_grad=False)
    paths = _tree.paths(params, "params")
    for among in (group,) if replicas is None else (group, replicas):
        _agreement.check(described, group=among, call=call, arg="params")
        _agreement.check_values(tensors, paths, group=among, call=call, arg="params")
    return leaves, spec, tensors


def check_shards(
    call: str, units: Sequence[Unit], shards: Any, *, agree_over: Any = False, none_ok: bool = False
) -> None:
    """Raises unless ``shards`` is a dict of ``units``' shards, with this rank's shapes.

    ``agree_over``: a process group (``None``: the world) on whose every rank
    this raises at once where it fails on some only (one tiny all-reduce; for
    calls outside the training step). ``False``: this rank alone.
    ``none_ok``: ``None`` may stand for a shard (gradients: a unit no
    backward reached).
    """
    if agree_over is False:
        _check_shards(call, units, shards, none_ok)
        return
    try:
        _check_shards(call, units, shards, none_ok)
    except (ValueError, TypeError) as e:
        _agreement.raise_together(call, e, agree_over)
        raise
    _agreement.raise_together(call, None, agree_over)


def _check_shards(call: str, units: Sequence[Unit], shards: Any, none_ok: bool) -> None:
    names = sorted(u.name for u in units)
    if not isinstance(shards, dict) or sorted(shards) != names:
        got = sorted(shards) if isinstance(shards, dict) else _tree.describe(shards)
        raise ValueError(
            f"{call}: `shards` expected the dict shard() returns, with the units {names}; got {got}"
        )
    for unit in units:
        given = shards[unit.name]
        expected = [(size,) for size in unit.sizes]
        got_shapes = [
            (size,) if t is None and none_ok else tuple(getattr(t, "shape", ()))
            for t, size in zip(given, unit.sizes, strict=False)
        ]
        if got_shapes != expected:
            raise ValueError(
                f"{call}: `shards` unit {unit.name!r} expected tensors of shapes {expected} "
                f"(this rank's shards); got {[_tree.describe(t) for t in given]}"
            )
