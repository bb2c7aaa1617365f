"""fdp._tree: the traceable flatten used while compiling agrees with optree's."""

from __future__ import annotations

import collections
from typing import Any

import optree
import pytest
import torch

from fdp import _tree
from tests.helpers import Pair, params_corpus


def trees() -> dict[str, Any]:
    corpus: dict[str, Any] = params_corpus()
    corpus["defaultdict"] = collections.defaultdict(list, {"b": 1, "a": [2, None]})
    corpus["unsortable_keys"] = {1: "x", "a": torch.ones(1)}
    corpus["insertion_order"] = {"z": 1, "a": {"y": 2, "b": 3}}
    corpus["deep"] = [Pair(first=(1, [2, {"k": None}]), second=collections.OrderedDict(b=1, a=2))]
    corpus["leaf"] = torch.zeros(2)
    return corpus


@pytest.mark.parametrize(("name", "tree"), list(trees().items()))
def test_traceable_flatten_matches_optree(name: str, tree: Any) -> None:
    expected, _ = optree.tree_flatten(tree, none_is_leaf=True)
    leaves: list[Any] = []
    spec = _tree._flatten_traceable(tree, leaves)
    assert len(leaves) == len(expected)
    assert all(a is b for a, b in zip(leaves, expected, strict=True))
    rebuilt = _tree.unflatten(spec, leaves)
    assert type(rebuilt) is type(tree)
    assert optree.tree_structure(rebuilt, none_is_leaf=True) == optree.tree_structure(
        tree, none_is_leaf=True
    )
    if isinstance(tree, dict):
        assert list(rebuilt) == list(tree)  # insertion order restored
    if isinstance(tree, collections.defaultdict):
        assert rebuilt.default_factory is tree.default_factory
