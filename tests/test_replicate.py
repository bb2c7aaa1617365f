"""replicate against plain single-device references: values, identity, and summed gradients."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import pytest
import torch

import fdp
from tests.helpers import (
    count_copies,
    detached_copy,
    fake,
    label,
    leaves,
    params_corpus,
    plain,
    tensor_leaves,
    tree_allclose,
)

CORPUS = list(params_corpus())


def weighted_loss(trees: list[Any]) -> torch.Tensor:
    """sum_r (r + 1) * sum_leaves (leaf ** 2).sum(): a different weight per replica."""
    total = torch.zeros((), dtype=torch.float64)
    for r, tree in enumerate(trees):
        for t in tensor_leaves(tree):
            total = total + (r + 1) * (plain_device(t).double() ** 2).sum()
    return total


def plain_device(t: torch.Tensor) -> torch.Tensor:
    # Labelled tensors on several fake devices cannot meet in one op; bring
    # each to fake:0 where the loss is summed.
    return t.to(fake(0)) if t.device.type == "meta" else t


def reference_grads(params: Any, n: int) -> list[torch.Tensor]:
    """d/dp of weighted_loss([p] * n) computed without fdp: 2 p * sum_r (r + 1)."""
    scale = sum(range(1, n + 1))
    return [(2 * scale * plain(t).double()).to(t.dtype) for t in tensor_leaves(params)]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("name", CORPUS)
def test_cpu_replicas_share_leaves_and_sum_grads(name: str, n: int) -> None:
    params = params_corpus()[name]
    replicas = fdp.replicate(params, ["cpu"] * n)
    assert len(replicas) == n
    for replica in replicas:
        tree_allclose(replica, params)
        assert replica is not params
        # Same device: the replica holds the leaf itself, no copy.
        assert all(a is b for a, b in zip(leaves(replica), leaves(params), strict=True))
    torch.autograd.backward(weighted_loss(replicas))
    for leaf, expected in zip(tensor_leaves(params), reference_grads(params, n), strict=True):
        assert leaf.grad is not None
        torch.testing.assert_close(leaf.grad, expected)


@pytest.mark.parametrize("grad_api", ["autograd.grad", "func.grad"])
@pytest.mark.parametrize("name", CORPUS)
def test_grads_through_functional_apis(name: str, grad_api: str) -> None:
    params = params_corpus()[name]
    flat = tensor_leaves(params)
    if grad_api == "autograd.grad":
        grads = list(torch.autograd.grad(weighted_loss(fdp.replicate(params, ["cpu"] * 3)), flat))
    else:
        if name == "none_leaves":
            pytest.skip("torch.func.grad refuses None inside its differentiated argument")

        def loss(p: Any) -> torch.Tensor:
            return weighted_loss(fdp.replicate(p, ["cpu"] * 3))

        grads = tensor_leaves(torch.func.grad(loss)(detached_copy(params)))
    for got, expected in zip(grads, reference_grads(params, 3), strict=True):
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("on_fake_devices", [False, True])
def test_tied_weights_stay_tied_and_get_both_grads(on_fake_devices: bool) -> None:
    w = torch.randn(3, requires_grad=True)
    devices: list[Any] = ["cpu", "cpu"]
    if on_fake_devices:
        w, devices = label(w, 0), [fake(0), fake(1)]
    replicas = fdp.replicate({"embed": w, "head": w, "other": [w]}, devices)
    for replica in replicas:
        assert replica["embed"] is replica["head"] is replica["other"][0]
    loss = sum((plain_device(r["embed"]) * 1 + plain_device(r["head"]) * 2).sum() for r in replicas)
    assert isinstance(loss, torch.Tensor)
    (grad,) = torch.autograd.grad(loss, [w])
    # Each of the two replicas contributes 1 + 2 through the two uses.
    torch.testing.assert_close(plain(grad), torch.full((3,), 6.0))


def test_non_tensor_leaf_in_params_is_a_type_error() -> None:
    with pytest.raises(
        TypeError,
        match=r"fdp.replicate: `params` leaf params\['layers'\]\[1\]\['scale'\] expected a tensor "
        r"or None; got float 0.5",
    ):
        fdp.replicate({"layers": [{"w": torch.ones(1)}, {"scale": 0.5}]}, ["cpu"])


@pytest.mark.parametrize("with_state", [False, True])
def test_replicas_on_the_source_device_hold_the_leaves_in_trees_of_their_own(
    with_state: bool,
) -> None:
    w = torch.randn(3, requires_grad=True)
    params: dict[str, Any] = {"w": w, "tied": w, "none": None}
    if with_state:
        params["mean"] = torch.zeros(3)
    replicas = fdp.replicate(params, ["cpu", "cpu", "cpu"])
    assert len({id(r) for r in replicas}) == 3  # a user's function may change its own tree
    for i, r in enumerate(replicas):
        assert r["w"] is w
        assert r["tied"] is w
        assert r["none"] is None
        if with_state:  # only replica 0 holds the buffer itself
            assert (r["mean"] is params["mean"]) == (i == 0)
            torch.testing.assert_close(r["mean"], params["mean"])
    grads = torch.autograd.grad(sum(r["w"].sum() * (i + 1) for i, r in enumerate(replicas)), w)
    torch.testing.assert_close(grads[0], torch.full((3,), 6.0))


def test_no_grad_mode_builds_no_graph() -> None:
    params = label({"w": torch.randn(3, requires_grad=True)}, 0)
    with torch.no_grad():
        a, b = fdp.replicate(params, [fake(0), fake(1)])
    assert a["w"] is params["w"]
    assert b["w"].grad_fn is None
    assert not b["w"].requires_grad


def test_fake_devices_copy_once_per_dtype_and_reduce_grads_to_the_source() -> None:
    torch.manual_seed(0)
    cpu_params = {
        "f32": [torch.randn(5, 3, requires_grad=True) for _ in range(20)],
        "f64": [torch.randn(4, dtype=torch.float64, requires_grad=True) for _ in range(10)],
        "buffers": {"mean": torch.zeros(3), "steps": torch.tensor(0)},
        "none": None,
    }
    params = label(cpu_params, 0)
    devices = [fake(0), fake(1), fake(1), fake(2)]
    with count_copies() as copies:
        replicas = fdp.replicate(params, devices)
    # Two devices other than the source; per device one coalesced copy for each
    # dtype group of grad leaves (f32, f64) and one per non-grad group (f32, i64).
    assert copies() == 2 * 4
    assert all(a is b for a, b in zip(leaves(replicas[0]), leaves(params), strict=True))
    for replica, device in zip(replicas, devices, strict=True):
        for got, src in zip(tensor_leaves(replica), tensor_leaves(params), strict=True):
            assert got.device == device
            assert got.dtype == src.dtype
            assert got.requires_grad == src.requires_grad
            torch.testing.assert_close(plain(got), plain(src))
        assert replica["none"] is None
    # Replicas on one device share the copy; buffers are copied without autograd.
    assert replicas[1]["f32"][0] is replicas[2]["f32"][0]
    assert replicas[1]["buffers"]["mean"].grad_fn is None

    loss = weighted_loss(replicas)
    flat = [t for t in tensor_leaves(params) if t.requires_grad]
    grads = torch.autograd.grad(loss, flat)
    expected = [
        g
        for g, t in zip(reference_grads(params, 4), tensor_leaves(params), strict=True)
        if t.requires_grad
    ]
    for got, src, want in zip(grads, flat, expected, strict=True):
        assert got.device == src.device
        torch.testing.assert_close(plain(got), want)


def test_fake_devices_copy_complex_with_real_and_keep_memory_formats() -> None:
    torch.manual_seed(0)
    cpu_params = {
        "conv": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last).requires_grad_(),
        "odd": torch.randn(3, requires_grad=True),  # puts the complex leaf at an odd offset
        "z": torch.randn(2, 3, dtype=torch.complex64, requires_grad=True),
        "zt": torch.randn(3, 2, dtype=torch.complex64).t().requires_grad_(),
    }
    params = label(cpu_params, 0)
    devices = [fake(0), fake(1), fake(2)]
    with count_copies() as copies:
        replicas = fdp.replicate(params, devices)
    # complex64 travels as float32: one coalesced copy per other device.
    assert copies() == 2
    for replica, device in zip(replicas, devices, strict=True):
        for got, src in zip(tensor_leaves(replica), tensor_leaves(params), strict=True):
            assert (got.device, got.dtype, got.stride()) == (device, src.dtype, src.stride())
            torch.testing.assert_close(plain(got), plain(src))

    def loss(tree: dict[str, torch.Tensor]) -> torch.Tensor:
        return sum((t.abs() ** 3).sum() for t in tree.values())  # type: ignore[return-value]

    total = sum(
        (r + 1) * loss({k: plain_device(v) for k, v in tree.items()})
        for r, tree in enumerate(replicas)
    )
    grads = torch.autograd.grad(total, list(params.values()))  # type: ignore[arg-type]
    reference = {k: v.detach().clone().requires_grad_() for k, v in cpu_params.items()}
    expected = torch.autograd.grad(sum(range(1, 4)) * loss(reference), list(reference.values()))
    for got, want, src in zip(grads, expected, params.values(), strict=True):
        assert got.device == src.device
        torch.testing.assert_close(plain(got), want)


def test_fake_devices_under_backward_accumulate_on_leaves() -> None:
    params = label({"w": torch.randn(2, 3, requires_grad=True)}, 1)
    replicas = fdp.replicate(params, [fake(0), fake(1), fake(2)])
    loss: Callable[[torch.Tensor], torch.Tensor] = lambda t: (t.to(fake(1)) ** 3).sum()  # noqa: E731
    sum(loss(r["w"]) for r in replicas).backward()  # type: ignore[union-attr]
    w = params["w"]
    assert w.grad is not None
    assert w.grad.device == fake(1)
    torch.testing.assert_close(plain(w.grad), 3 * 3 * plain(w) ** 2)


def test_structure_and_none_preserved() -> None:
    params = params_corpus()["none_leaves"]
    (replica,) = fdp.replicate(params, ["cpu"])
    assert optree.tree_structure(replica, none_is_leaf=True) == optree.tree_structure(
        params, none_is_leaf=True
    )
    assert replica["bias"] is None
    assert replica["more"][0] is None


def test_module_parameters_are_shared_like_plain_tensors() -> None:
    net = torch.nn.Linear(3, 2)
    fn, state = fdp.make_functional(net)
    replicas = fdp.replicate(state, ["cpu", "cpu"])
    for r in replicas:
        assert r is not state
        assert all(r[name] is leaf for name, leaf in state.items())
    x = torch.randn(4, 3)
    ref = torch.nn.Linear(3, 2)
    ref.load_state_dict(net.state_dict())
    loss = sum((fn(r, x) * (i + 1)).sum() for i, r in enumerate(replicas))
    assert isinstance(loss, torch.Tensor)
    torch.autograd.backward(loss)
    torch.autograd.backward(ref(x).sum() * 3)
    for name, leaf in state.items():
        torch.testing.assert_close(leaf.grad, dict(ref.named_parameters())[name].grad)
