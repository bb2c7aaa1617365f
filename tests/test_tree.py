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


def test_planned_gives_the_leaves_or_names_the_argument_and_the_leaf() -> None:
    params: dict[str, Any] = {"w": torch.zeros(2, 3), "b": [torch.zeros(3), None], "n": 1.0}
    planned = _tree.Planned(params, owner="this thing")
    got = planned.leaves("f", "params", params)
    expected: list[Any] = [params["b"][0], None, params["n"], params["w"]]  # sorted keys
    assert all(a is b for a, b in zip(got, expected, strict=True))
    with pytest.raises(
        ValueError,
        match=r"^f: `params` expected the structure of the tree this thing was planned for; "
        r"expected 4 leaves, got 3; missing params\['b'\]\[1\]$",
    ):
        planned.leaves("f", "params", {"w": torch.zeros(2, 3), "b": [torch.zeros(3)], "n": 1.0})
    wrong_shape = {"w": torch.zeros(2, 3), "b": [torch.zeros(4), None], "n": 1.0}
    with pytest.raises(
        ValueError,
        match=r"^f: `params` leaf params\['b'\]\[0\] expected a tensor of shape \(3,\), dtype "
        r"torch.float32 on cpu; got a tensor of shape \(4,\)",
    ):
        planned.leaves("f", "params", wrong_shape)
    with pytest.raises(ValueError, match=r"`grads` leaf grads\['b'\]\[1\] expected None; got a"):
        planned.leaves("f", "grads", {"w": torch.zeros(2, 3), "b": [torch.zeros(3)] * 2, "n": 1.0})
    with pytest.raises(ValueError, match=r"leaf params\['n'\] expected a float; got int 1"):
        planned.leaves("f", "params", {"w": torch.zeros(2, 3), "b": [torch.zeros(3), None], "n": 1})
    assert len(planned.leaves("f", "grads", wrong_shape, kinds=False)) == 4  # structure only


@pytest.mark.parametrize(
    ("got", "expected", "message"),
    [
        (
            {"a": 1},
            {"a": 1, "b": [1, 2]},
            r"expected 3 leaves, got 1; missing p\['b'\]\[0\], p\['b'\]\[1\]",
        ),
        (
            {f"l{i}": 1 for i in range(6)},
            {f"l{i}": 1 for i in range(1, 7)},
            r"missing p\['l6'\]; unexpected p\['l0'\]",
        ),
        (
            {f"l{i}": 1 for i in range(9)},
            {},
            r"expected 0 leaves, got 9; unexpected p\['l0'\], p\['l1'\], p\['l2'\] and 6 more",
        ),
        (
            {"a": 1, "b": (1, 2)},
            {"a": 1, "b": [1, 2]},
            r"p\['b'\] is a tuple where a list was expected",
        ),
        (
            [{"a": Pair(1, [2])}],
            [{"a": Pair(1, (2,))}],
            r"p\[0\]\['a'\].second is a list where a tuple was expected",
        ),
        ({"a": Pair(1, 2)}, {"a": (1, 2)}, r"p\['a'\] is a Pair where a tuple was expected"),
        (collections.OrderedDict(a=1), {"a": 1}, r"p is an OrderedDict where a dict was expected"),
        ({"a": {"x": 1}}, {"a": 1}, r"p\['a'\] is a dict where a leaf was expected"),
        (
            collections.defaultdict(int, a=1),
            collections.defaultdict(float, a=1.0),
            r"a container's metadata differs \(a defaultdict's default_factory\)",
        ),
    ],
)
def test_a_structure_difference_names_the_paths_not_both_specs(
    got: Any, expected: Any, message: str
) -> None:
    planned = _tree.Planned(expected, owner="x")
    with pytest.raises(
        ValueError,
        match=rf"^f: `p` expected the structure of the tree x was planned for; {message}$",
    ):
        planned.leaves("f", "p", got)
    assert planned.leaves("f", "p", expected) == _tree.flatten(expected)[0]


def test_planned_refuses_inside_compile_a_node_the_traced_flatten_makes_a_leaf() -> None:
    params = {"w": collections.deque([torch.ones(2)])}  # an optree node, a leaf while tracing
    planned = _tree.Planned(params, owner="this thing")
    assert planned.leaves("f", "params", params)[0] is params["w"][0]

    @torch.compile(backend="eager", fullgraph=True)
    def traced(p: Any) -> Any:
        return planned.leaves("f", "params", p)

    # fullgraph: dynamo reports the TypeError as an error of its own (its class varies
    # across torch releases) that carries the message
    with pytest.raises(Exception, match=r"f: inside torch.compile the tree this thing was planned"):
        traced(params)
    plain = _tree.Planned({"w": [torch.ones(2)]}, owner="this thing")
    compiled = torch.compile(
        lambda p: plain.leaves("f", "params", p)[0] * 2, backend="eager", fullgraph=True
    )
    torch.testing.assert_close(compiled({"w": [torch.ones(2)]}), torch.full((2,), 2.0))


def _insertion_reference(tree: Any) -> list[int]:
    """optree's own insertion-ordered flatten, its leaves found in the sorted one by path."""
    sorted_paths = optree.tree_paths(tree, none_is_leaf=True)
    with optree.dict_insertion_ordered(True, namespace="fdp-test"):
        inserted = optree.tree_paths(tree, none_is_leaf=True, namespace="fdp-test")
    return [sorted_paths.index(p) for p in inserted]


@pytest.mark.parametrize("name", list(params_corpus()))
def test_insertion_order_follows_each_dicts_insertion_order(name: str) -> None:
    tree = params_corpus()[name]
    assert _tree.insertion_order(tree) == _insertion_reference(tree)


def test_insertion_order_of_a_modules_state_is_the_module_order() -> None:
    net = torch.nn.Sequential(
        collections.OrderedDict(
            [("z_in", torch.nn.Linear(2, 3)), ("a_mid", torch.nn.Linear(3, 3)),
             ("m_out", torch.nn.Linear(3, 1))]
        )
    )  # fmt: skip
    state = dict(net.named_parameters())
    leaves, _ = _tree.flatten(state)
    names = sorted(state)  # optree's order
    inserted = [names[i] for i in _tree.insertion_order(state)]
    assert inserted == list(state) == [n for n, _ in net.named_parameters()]
    assert len(leaves) == len(inserted)
    nested = {"b": {"y": 1, "x": [2, {"q": 3, "p": 4}]}, "a": collections.defaultdict(int, k=5)}
    assert _tree.insertion_order(nested) == _insertion_reference(nested)


@pytest.mark.parametrize("positions", [(), (2,), (0, 2), (3, 1, 1)])
def test_picker_picks_the_items_at_the_positions(positions: tuple[int, ...]) -> None:
    items = ["a", "b", "c", "d"]
    assert _tree.picker(positions)(items) == tuple(items[p] for p in positions)
