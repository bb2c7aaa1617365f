"""fdp.optim.param_groups against torch.optim's parameter groups (fdp.optim._param_groups)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import fdp
from tests.helpers import Pair, tensor_leaves, tree_allclose

STEPS = 5


def params_tree() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "layers": [{"weight": torch.randn(4, 3, generator=g), "bias": torch.randn(3, generator=g)}],
        "norm": Pair(first=torch.randn(3, generator=g), second=None),
        "head": torch.randn(3, 2, generator=g),
    }


def grads_for(params: Any, step: int) -> Any:
    return {
        "layers": [{k: torch.sin(v * (step + 1)) for k, v in params["layers"][0].items()}],
        "norm": Pair(first=torch.cos(params["norm"].first * step), second=None),
        "head": None if step % 2 else torch.sin(params["head"]),
    }


def by_name(name: str, t: torch.Tensor) -> str:
    if name.startswith("head"):
        return "head"
    return "no_decay" if name.endswith("bias") or name.startswith("norm") else "decay"


def fdp_groups() -> fdp.optim.ParamGroups:
    return fdp.optim.param_groups(
        by_name,
        {
            "decay": fdp.optim.adamw(0.01, weight_decay=0.1),
            "no_decay": fdp.optim.adamw(0.01, weight_decay=0.0),
            "head": fdp.optim.adamw(0.001, weight_decay=0.1, betas=(0.8, 0.9)),
        },
    )


def torch_reference() -> list[torch.Tensor]:
    params = params_tree()
    leaves = {
        "decay": [params["layers"][0]["weight"]],
        "no_decay": [params["layers"][0]["bias"], params["norm"].first],
        "head": [params["head"]],
    }
    opt = torch.optim.AdamW(
        [
            {"params": leaves["decay"], "lr": 0.01, "weight_decay": 0.1},
            {"params": leaves["no_decay"], "lr": 0.01, "weight_decay": 0.0},
            {"params": leaves["head"], "lr": 0.001, "weight_decay": 0.1, "betas": (0.8, 0.9)},
        ],
        foreach=True,
    )
    for step in range(STEPS):
        grads = grads_for(params, step)
        params["layers"][0]["weight"].grad = grads["layers"][0]["weight"]
        params["layers"][0]["bias"].grad = grads["layers"][0]["bias"]
        params["norm"].first.grad = grads["norm"].first
        params["head"].grad = grads["head"]
        opt.step()
    return tensor_leaves(params)


@pytest.mark.parametrize("donate", [False, True])
def test_groups_step_as_torch_param_groups(donate: bool) -> None:
    expected = torch_reference()
    opt = fdp_groups()
    params = params_tree()
    state = opt.init(params)
    for step in range(STEPS):
        params, state = opt.update(grads_for(params, step), state, params, donate=donate)
    tree_allclose(tensor_leaves(params), expected)
    assert sorted(state) == ["exp_avg", "exp_avg_sq", "step"]  # the single optimizer's format


def test_a_tree_of_labels_works_as_the_function_does() -> None:
    params = params_tree()
    labels = {
        "layers": [{"weight": "decay", "bias": "no_decay"}],
        "norm": Pair(first="no_decay", second=None),
        "head": "head",
    }
    by_tree = fdp.optim.param_groups(labels, fdp_groups().optimizers)
    a, b = fdp_groups(), by_tree
    pa, sa, pb, sb = params, a.init(params), params, b.init(params)
    for step in range(STEPS):
        pa, sa = a.update(grads_for(pa, step), sa, pa)
        pb, sb = b.update(grads_for(pb, step), sb, pb)
    tree_allclose(pa, pb)


def test_compiles_to_one_graph() -> None:
    opt = fdp_groups()
    params = params_tree()
    state = opt.init(params)
    update = torch.compile(opt.update, backend="eager", fullgraph=True)
    eager_p, eager_s = opt.update(grads_for(params, 0), state, params)
    got_p, got_s = update(grads_for(params, 0), state, params)
    tree_allclose(got_p, eager_p)
    tree_allclose(got_s, eager_s)


def test_bad_labels_and_optimizers_are_named() -> None:
    params = params_tree()
    opt = fdp.optim.param_groups(lambda n, t: "decay", {"decay": fdp.optim.sgd(0.1)})
    opt.update(grads_for(params, 0), opt.init(params), params)
    wrong = fdp.optim.param_groups(lambda n, t: "other", {"decay": fdp.optim.sgd(0.1)})
    with pytest.raises(ValueError, match=r"gave leaf params\['head'\] the label 'other'"):
        wrong.update(grads_for(params, 0), wrong.init(params), params)
    with pytest.raises(TypeError, match=r"`optimizers\['x'\]` expected an fdp.optim optimizer"):
        fdp.optim.param_groups(by_name, {"x": object()})
    with pytest.raises(
        ValueError,
        match=r"`label` expected a tree of labels shaped like `params`, or a function "
        r"\(name, tensor\) -> label; expected 5 leaves, got 1; missing label\['head'\], "
        r"label\['layers'\]\[0\]\['bias'\], label\['layers'\]\[0\]\['weight'\] and 2 more; "
        r"unexpected label\['a'\]$",
    ):
        fdp.optim.param_groups({"a": "decay"}, {"decay": fdp.optim.sgd(0.1)}).labels(params)
    # the labels' own container types count: where it differs, that container is named
    labels = {"layers": [{"weight": "d", "bias": "d"}], "norm": ("d", None), "head": "d"}
    with pytest.raises(ValueError, match=r"label\['norm'\] is a tuple where a Pair was expected$"):
        fdp.optim.param_groups(labels, {"d": fdp.optim.sgd(0.1)}).labels(params)


def test_names_are_dotted_as_named_parameters_gives_them() -> None:
    seen: list[str] = []

    def record(name: str, t: torch.Tensor) -> str:
        seen.append(name)
        return "all"

    fdp.optim.param_groups(record, {"all": fdp.optim.sgd(0.1)}).labels(params_tree())
    assert seen == ["head", "layers.0.bias", "layers.0.weight", "norm.first"]


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donated"])
def test_one_tensor_in_two_groups_is_refused_as_torch_optim_does(donate: bool) -> None:
    # Before, a donated step stepped the tied tensor twice (1.2662 vs 1.2258/1.2386).
    w = torch.ones(3)
    params = {"a": w, "b": w}
    opt = fdp.optim.param_groups(
        {"a": "x", "b": "y"}, {"x": fdp.optim.adam(0.1), "y": fdp.optim.adam(0.2)}
    )
    with pytest.raises(ValueError, match=r"one tensor \(tied\) two labels: leaf params\['a'\]"):
        opt.update(
            {"a": torch.ones(3), "b": torch.ones(3)}, opt.init(params), params, donate=donate
        )
    with pytest.raises(ValueError, match="more than one parameter group"):
        torch.optim.Adam([{"params": [w.requires_grad_()]}, {"params": [w]}])  # torch's refusal
    # One label for both leaves: the tensor steps once with its summed gradient, as torch.
    same = fdp.optim.param_groups({"a": "x", "b": "x"}, {"x": fdp.optim.adam(0.1)})
    tied = torch.ones(3)
    new, _ = same.update(
        {"a": torch.ones(3), "b": torch.ones(3)},
        same.init({"a": tied, "b": tied}),
        {"a": tied, "b": tied},
    )
    ref = torch.ones(3, requires_grad=True)
    ref.grad = torch.full((3,), 2.0)
    torch.optim.Adam([ref], lr=0.1, foreach=True).step()
    torch.testing.assert_close(new["a"], ref.detach())
