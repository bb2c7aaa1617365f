"""fdp.optim.clip_by_global_norm against torch.nn.utils.clip_grad_norm_ (fdp.optim._clip)."""

from __future__ import annotations

import math
from typing import Any

import optree
import pytest
import torch

import fdp
from tests.helpers import Pair, tree_allclose


def grads_tree(scale: float) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": scale * torch.randn(4, 3, generator=g),
        "nested": [scale * torch.randn(5, generator=g), None],
        "pair": Pair(first=scale * torch.randn(2, 2, generator=g), second=None),
        "z": scale * torch.randn(3, generator=g, dtype=torch.complex64),
        "cl": (scale * torch.randn(2, 3, 2, 2, generator=g)).contiguous(
            memory_format=torch.channels_last
        ),
    }


def torch_reference(grads: dict[str, Any], max_norm: float, norm_type: float) -> Any:
    leaves: list[torch.Tensor | None]
    leaves, spec = optree.tree_flatten(grads, none_is_leaf=True)  # type: ignore[arg-type]
    params = [torch.zeros_like(t).requires_grad_() if t is not None else None for t in leaves]
    for p, g in zip(params, leaves, strict=True):
        if p is not None and g is not None:
            p.grad = g.clone()
    present = [p for p in params if p is not None]
    norm = torch.nn.utils.clip_grad_norm_(present, max_norm, norm_type=norm_type)
    out = [None if p is None else p.grad for p in params]
    return optree.tree_unflatten(spec, out), norm


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, math.inf])
@pytest.mark.parametrize("scale", [0.01, 10.0], ids=["within", "clipped"])
def test_equals_torchs_clip_grad_norm(norm_type: float, scale: float) -> None:
    grads = grads_tree(scale)
    expected, expected_norm = torch_reference(grads, 1.0, norm_type)
    got, norm = fdp.optim.clip_by_global_norm(grads, 1.0, norm_type=norm_type)
    torch.testing.assert_close(norm, expected_norm)
    tree_allclose(got, expected)
    assert got["cl"].stride() == grads["cl"].stride()
    assert got["nested"][1] is None
    before = grads_tree(scale)
    tree_allclose(grads, before)  # pure: the inputs are unchanged


def test_composes_with_grad_vmap_and_compile() -> None:
    params = {"w": torch.randn(3, 2), "b": torch.randn(2)}
    x = torch.randn(4, 3)

    def loss(p: Any) -> torch.Tensor:
        out: torch.Tensor = ((x @ p["w"] + p["b"]) ** 2).sum()
        return out

    def clipped(p: Any) -> Any:
        return fdp.optim.clip_by_global_norm(torch.func.grad(loss)(p), 0.5)[0]

    expected, _ = torch_reference(torch.func.grad(loss)(params), 0.5, 2.0)
    tree_allclose(clipped(params), expected)
    compiled = torch.compile(clipped, backend="aot_eager", fullgraph=True)
    tree_allclose(compiled(params), expected)
    # Per-sample clipping (DP-SGD): vmap over a batch of gradient trees.
    batch = {"w": torch.randn(5, 3, 2), "b": torch.randn(5, 2)}
    per = torch.func.vmap(lambda g: fdp.optim.clip_by_global_norm(g, 1.0)[0])(batch)
    for i in range(5):
        one = {"w": batch["w"][i], "b": batch["b"][i]}
        tree_allclose({"w": per["w"][i], "b": per["b"][i]}, torch_reference(one, 1.0, 2.0)[0])


def test_differentiates_through_the_clip() -> None:
    g = torch.tensor([3.0, 4.0], dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda t: fdp.optim.clip_by_global_norm({"g": t}, 1.0)[0]["g"], (g,))


def test_bad_input_names_the_argument_and_leaf() -> None:
    with pytest.raises(ValueError, match=r"clip_by_global_norm: `max_norm` expected"):
        fdp.optim.clip_by_global_norm({"w": torch.ones(2)}, -1.0)
    with pytest.raises(ValueError, match=r"`norm_type` expected"):
        fdp.optim.clip_by_global_norm({"w": torch.ones(2)}, 1.0, norm_type=0.0)
    with pytest.raises(TypeError, match=r"`grads` leaf grads\['w'\]\[1\] expected a tensor"):
        fdp.optim.clip_by_global_norm({"w": [torch.ones(2), 3.0]}, 1.0)


def test_a_tree_of_none_has_norm_zero() -> None:
    got, norm = fdp.optim.clip_by_global_norm({"a": None}, 1.0)
    assert got == {"a": None}
    assert float(norm) == 0.0
