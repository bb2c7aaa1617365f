"""optree glue shared by every module: flattening, leaf paths, structure checks.

fdp flattens with ``none_is_leaf=True``: a ``None`` is a leaf with a path of its
own, so a params tree and a grads tree with missing entries have the same
structure and the same leaf count, and error messages can point at a ``None``.
Dict keys are flattened in sorted order (optree's default), so two processes
that built the same dict in different insertion orders agree on leaf order;
unflattening restores each dict's own insertion order.
"""

from __future__ import annotations

from typing import Any

import optree
from optree import PyTreeSpec

NONE_IS_LEAF = True


def flatten(tree: Any) -> tuple[list[Any], PyTreeSpec]:
    """Leaves in optree order and the structure to rebuild the tree."""
    return optree.tree_flatten(tree, none_is_leaf=NONE_IS_LEAF)


def unflatten(spec: PyTreeSpec, leaves: list[Any]) -> Any:
    """Inverse of :func:`flatten`."""
    return optree.tree_unflatten(spec, leaves)


def paths(tree: Any, root: str) -> list[str]:
    """Python expressions (``params['layers'][0].weight``) naming each leaf of ``tree``."""
    accessors = optree.tree_accessors(tree, none_is_leaf=NONE_IS_LEAF)
    return [accessor.codify(root) for accessor in accessors]


def path(tree: Any, index: int, root: str) -> str:
    """The path of leaf ``index``; computed only when an error needs it."""
    return paths(tree, root)[index]


def describe(leaf: object) -> str:
    """A short description of a leaf for error messages."""
    import torch

    if isinstance(leaf, torch.Tensor):
        return f"a tensor of shape {tuple(leaf.shape)}, dtype {leaf.dtype} on {leaf.device}"
    if leaf is None:
        return "None"
    return f"{type(leaf).__name__} {leaf!r}"[:200]
