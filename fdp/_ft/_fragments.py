"""Streaming DiLoCo's fragments: which leaves synchronise together, and when.

The tree is cut into ``P`` fragments (Douillard et al. 2025, arXiv
2501.18512): by default contiguous runs of tensor leaves in the tree's order
(the model's, layer after layer), each about ``1/P`` of the elements (a leaf
goes where its middle element falls); or the
user's labels, a tree of ints in ``range(P)`` with the parameters' structure.
Fragment ``i`` synchronises after the inner steps ``c`` (counted from 1) with
``c % H == i * H // P``: fragment 0 with plain DiLoCo, the others staggered
between, so that at most one fragment's bytes cross the link at a step.
"""

from __future__ import annotations

from typing import Any

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
        return _contiguous(leaves, tensors, fragments, call=call)
    labels, _ = _tree.flatten(fragments)
    if len(labels) != len(leaves):
        spec = optree.tree_structure(params, none_is_leaf=True)
        raise ValueError(
            f"{call}: `fragments` expected an int or a tree of ints with the parameters' "
            f"structure {spec}; got {optree.tree_structure(fragments, none_is_leaf=True)}"
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
    leaves: list[Any], tensors: list[int], fragments: int, *, call: str
) -> torch.Tensor:
    if isinstance(fragments, bool) or fragments < 1 or fragments > max(1, len(tensors)):
        raise ValueError(
            f"{call}: `fragments` expected an int from 1 to the number of tensor leaves "
            f"({len(tensors)}), or a tree of labels; got {fragments!r}"
        )
    sizes = [leaves[i].numel() for i in tensors]
    total, out = sum(sizes), torch.full((len(leaves),), -1, dtype=torch.int64)
    done, current, holds = 0, 0, False
    for k, (i, size) in enumerate(zip(tensors, sizes, strict=True)):
        # The fragment whose share holds the leaf's middle element; never an empty
        # fragment: one more when every later fragment needs one of the leaves left.
        middle = int((done + size / 2) * fragments // max(total, 1))
        needed = len(tensors) - k <= fragments - 1 - current
        if holds and current < fragments - 1 and (middle > current or needed):
            current, holds = current + 1, False
        out[i], done, holds = current, done + size, True
    return out
