"""Streaming DiLoCo's fragments: which leaves synchronise together, and when.

The tree is cut into ``P`` fragments (Douillard et al. 2025, arXiv
2501.18512): by default contiguous runs of blocks in the tree's order (the
model's, layer after layer), each about ``1/P`` of the elements (a block
goes where its middle element falls). A block is what FSDP gathers as one
unit: in FSDP's shards (``fsdp.shard``), each unit; in a parameter tree, the
units ``FullyShardedDataParallel`` makes by default (a top-level entry, a
transformer block), or the leaves themselves where there are fewer blocks
than fragments. Or the user's labels, a tree of ints in ``range(P)`` with the
parameters' structure.
Fragment ``i`` synchronises after the inner steps ``c`` (counted from 1) with
``c % H == i * H // P``: fragment 0 with plain DiLoCo, the others staggered
between, so that at most one fragment's bytes cross the link at a step.
"""

from __future__ import annotations

from typing import Any, cast

import optree
import torch

from fdp import _tree

__all__ = ["fragment_of", "offsets"]


def offsets(fragments: int, sync_every: int) -> list[int]:
    """Fragment ``i`` synchronises after the inner steps ``c`` with ``c % H == offsets[i]``."""
    return [i * sync_every // fragments for i in range(fragments)]


def fragment_of(params: Any, fragments: int | Any, *, call: str) -> torch.Tensor:
    """Each leaf's fragment (int64, ``-1`` for a leaf that is not a tensor), checked."""
    leaves, _ = _tree.flatten(params)
    tensors = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    if isinstance(fragments, int):
        return _contiguous(params, leaves, tensors, fragments, call=call)
    labels, _ = _tree.flatten(fragments)
    spec = optree.tree_structure(params, none_is_leaf=True)
    got = optree.tree_structure(fragments, none_is_leaf=True)
    if got != spec:  # the same count is not enough: a label under another key is misplaced
        raise ValueError(
            f"{call}: `fragments` expected an int or a tree of ints with the parameters' "
            f"structure; {_tree.structure_difference(got, spec, 'fragments')}"
        )
    out = torch.full((len(leaves),), -1, dtype=torch.int64)
    for i in tensors:
        label = labels[i]
        if isinstance(label, bool) or not isinstance(label, int) or label < 0:
            raise ValueError(
                f"{call}: `fragments` leaf {_tree.path(params, i, 'fragments')} expected a "
                f"non-negative int (the leaf's fragment); got {label!r}"
            )
        out[i] = label
    used = sorted({int(v) for v in out.tolist() if v >= 0})
    if used != list(range(len(used))):
        raise ValueError(
            f"{call}: `fragments` expected labels 0..P-1, each used by a leaf; got {used}"
        )
    return out


def _contiguous(
    params: Any, leaves: list[Any], tensors: list[int], fragments: int, *, call: str
) -> torch.Tensor:
    if isinstance(fragments, bool) or fragments < 1 or fragments > max(1, len(tensors)):
        raise ValueError(
            f"{call}: `fragments` expected an int from 1 to the number of tensor leaves "
            f"({len(tensors)}), or a tree of labels; got {fragments!r}"
        )
    names, atoms = _atoms(params, tensors)
    if len(atoms) < fragments:  # too few blocks to cut: the leaves themselves
        names, atoms = list(range(len(tensors))), list(range(len(tensors)))
    sizes = dict.fromkeys(atoms, 0)
    for name, i in zip(names, tensors, strict=True):
        sizes[name] += leaves[i].numel()
    of = _shares([sizes[a] for a in atoms], fragments)
    out = torch.full((len(leaves),), -1, dtype=torch.int64)
    for name, i in zip(names, tensors, strict=True):
        out[i] = of[atoms.index(name)]
    return out


def _atoms(params: Any, tensors: list[int]) -> tuple[list[Any], list[Any]]:
    """The block of each tensor leaf, which the default cut keeps whole, and the blocks in order.

    FSDP's shards (``fsdp.shard``: a dict from unit name to a tuple of flat
    tensors, one per dtype): the units, in the dict's order (FSDP's).
    Otherwise each leaf's block, FSDP's default unit (a top-level entry, a
    transformer block: ``_tree.block``), in the order of their first leaf.
    """
    if isinstance(params, dict) and all(
        isinstance(v, tuple) and all(t is None or isinstance(t, torch.Tensor) for t in v)
        for v in params.values()
    ):
        paths = optree.tree_paths(cast(Any, params), none_is_leaf=_tree.NONE_IS_LEAF)
        names = [paths[i][0] for i in tensors]
        return names, [k for k in params if k in set(names)]
    segments = _tree.segments(params)
    names = [_tree.block(segments[i]) for i in tensors]
    return names, list(dict.fromkeys(names))


def _shares(sizes: list[int], fragments: int) -> list[int]:
    """Each item's fragment: contiguous, each about ``1/fragments`` of the elements.

    An item goes where its middle element falls; never an empty fragment:
    one more when every later fragment needs one of the items left.
    """
    total, out = sum(sizes), []
    done, current, holds = 0, 0, False
    for k, size in enumerate(sizes):
        middle = int((done + size / 2) * fragments // max(total, 1))
        needed = len(sizes) - k <= fragments - 1 - current
        if holds and current < fragments - 1 and (middle > current or needed):
            current, holds = current + 1, False
        out.append(current)
        done, holds = done + size, True
    return out
