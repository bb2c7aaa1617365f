"""data_parallel and make_functional against one direct call on the whole batch."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, cast

import optree
import pytest
import torch

import fdp
from fdp import _data_parallel, _scatter_gather
from tests.helpers import (
    Pair,
    detached_copy,
    fake,
    label,
    mlp_params,
    plain,
    tensor_leaves,
    tree_allclose,
)


def make_params(seed: int = 0) -> dict[str, Any]:
    """The shared MLP with a head bias, a None leaf and a buffer that needs no grad."""
    params = mlp_params(seed, inputs=5, head_bias=True)
    return {**params, "unused_bias": None, "frozen": torch.ones(8)}


def model(
    p: dict[str, Any],
    batch: dict[str, Any],
    mask: torch.Tensor,
    k: int,
    *,
    scale: float = 1.0,
    offset: torch.Tensor | None = None,
) -> dict[str, Any]:
    h = batch["x"]
    for layer in p["layers"]:
        h = torch.tanh(h @ layer["w"] + layer["b"]) * p["frozen"]
    logits = h @ p["head"].first + p["head"].second
    if offset is not None:
        logits = logits + offset[:, None]
    return {
        "logits": logits * scale,
        "masked": Pair((logits * mask[:, None]).sum(1), None),
        "k": k,
        "tag": batch["tag"],
    }


def make_batch(n: int, seed: int = 1) -> tuple[tuple[Any, ...], dict[str, Any]]:
    g = torch.Generator().manual_seed(seed)
    inputs = ({"x": torch.randn(n, 5, generator=g), "tag": "digits"}, torch.rand(n, generator=g), 7)
    return inputs, {"scale": 0.5, "offset": torch.randn(n, generator=g)}


def loss_of(out: dict[str, Any]) -> torch.Tensor:
    logits: torch.Tensor = out["logits"]
    masked: torch.Tensor = out["masked"].first
    return (logits**2).sum() + masked.sum()


def assert_same_grads(out: Any, params: Any, ref: Any, ref_params: Any, **tol: float) -> None:
    """Backpropagates loss_of through both; every params leaf's grad equals the reference's."""
    torch.autograd.backward(loss_of(out))
    torch.autograd.backward(loss_of(ref))
    for got, want in zip(tensor_leaves(params), tensor_leaves(ref_params), strict=True):
        if not want.requires_grad:
            assert got.grad is None
            continue
        assert got.grad is not None
        assert want.grad is not None
        assert got.grad.device == got.device
        torch.testing.assert_close(
            got.grad.cpu(), want.grad, rtol=tol.get("rtol"), atol=tol.get("atol")
        )


@pytest.mark.parametrize("batch", [7, 2])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_outputs_and_grads_match_one_call(n: int, batch: int) -> None:
    params = make_params()
    ref_params = detached_copy(params)
    inputs, kwargs = make_batch(batch)
    out = fdp.data_parallel(model, params, inputs, devices=["cpu"] * n, kwargs=kwargs)
    ref = model(ref_params, *inputs, **kwargs)
    tree_allclose(out, ref)
    assert_same_grads(out, params, ref, ref_params)


PLAIN_PARAMS: dict[str, Callable[[torch.Tensor, torch.Tensor], dict[str, Any]]] = {
    # A flat dict of parameters is replicated without walking a tree, a nested
    # tree with optree; a buffer (no grad) gives each replica a private copy.
    "flat": lambda w, b: {"w": w, "b": b},
    "nested": lambda w, b: {"layer": [w, (b, None)]},
    "flat_with_buffer": lambda w, b: {"w": w, "b": b, "scale": torch.full((4,), 0.5)},
}


def weight_and_bias(p: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    return (p["w"], p["b"]) if "w" in p else (p["layer"][0], p["layer"][1][0])


def plain_model(p: dict[str, Any], x: torch.Tensor, *rest: torch.Tensor, dim: int) -> Any:
    w, b = weight_and_bias(p)
    h = torch.tanh(x.movedim(dim, 0) @ w + b) * p.get("scale", 1.0)
    for y in rest:
        h = h + y.movedim(dim, 0)[..., :1]
    return h.movedim(0, dim)


@pytest.mark.parametrize("calling", ["one tensor", "two tensors", "tuple out"])
@pytest.mark.parametrize("params_kind", list(PLAIN_PARAMS))
@pytest.mark.parametrize(("batch", "dim"), [(7, 0), (2, 0), (7, 1), (7, -1)])
@pytest.mark.parametrize("n", [2, 3])
def test_plain_tensor_calls_match_one_call(
    n: int, batch: int, dim: int, params_kind: str, calling: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Plain tensor inputs take a path of their own (no tree to walk), down to
    # a bare torch.cat of the outputs; each stage falls back to the general
    # one (here: fewer rows than replicas, a buffer, a tuple output).
    g = torch.Generator().manual_seed(batch)
    w = torch.randn(5, 4, generator=g, requires_grad=True)
    b = torch.randn(4, generator=g, requires_grad=True)
    params = PLAIN_PARAMS[params_kind](w, b)
    ref_params = detached_copy(params)
    shape = [3, 5, 5]
    shape[dim] = batch
    inputs = [torch.randn(*shape, generator=g) for _ in range(2 if calling == "two tensors" else 1)]

    def fn(p: dict[str, Any], *xs: torch.Tensor) -> Any:
        out = plain_model(p, *xs, dim=dim)
        return (out, xs[0].sum()) if calling == "tuple out" else out

    general: list[int] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        general.append(1)
        return _scatter_gather.scatter_kwargs_to(*args, **kwargs)

    monkeypatch.setattr(_data_parallel, "scatter_kwargs_to", counted)
    warns = pytest.warns(UserWarning, match="one entry per replica")
    with warns if calling == "tuple out" else contextlib.nullcontext():
        out = fdp.data_parallel(fn, params, tuple(inputs), devices=["cpu"] * n, dim=dim)
    assert general == ([1] if batch < n else [])
    ref = plain_model(ref_params, *inputs, dim=dim)
    got = out[0] if calling == "tuple out" else out
    torch.testing.assert_close(got, ref)
    grads = torch.autograd.grad((got**2).sum(), [w, b])
    expected = torch.autograd.grad((ref**2).sum(), weight_and_bias(ref_params))
    for got_grad, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got_grad, want)


@pytest.mark.parametrize("api", ["autograd.grad", "func.grad", "func.grad_and_value"])
def test_grads_through_functional_apis(api: str) -> None:
    params = make_params()
    params.pop("unused_bias")  # torch.func.grad refuses None in its argument
    params.pop("frozen")
    params["frozen"] = torch.ones(8)
    inputs, kwargs = make_batch(9)

    def loss(p: dict[str, Any], parallel: bool) -> torch.Tensor:
        if parallel:
            out = fdp.data_parallel(model, p, inputs, devices=["cpu"] * 3, kwargs=kwargs)
        else:
            out = model(p, *inputs, **kwargs)
        return loss_of(out)

    trainable = {k: v for k, v in params.items() if k != "frozen"}

    def split_loss(t: dict[str, Any], parallel: bool) -> torch.Tensor:
        return loss({**t, "frozen": params["frozen"]}, parallel)

    expected = torch.func.grad(split_loss)(detached_copy(trainable), False)
    if api == "autograd.grad":
        flat = tensor_leaves(trainable)
        got_flat = torch.autograd.grad(split_loss(trainable, True), flat)
        for g, e in zip(got_flat, tensor_leaves(expected), strict=True):
            torch.testing.assert_close(g, e)
        return
    if api == "func.grad":
        got = torch.func.grad(split_loss)(detached_copy(trainable), True)
    else:
        got, value = torch.func.grad_and_value(split_loss)(detached_copy(trainable), True)
        torch.testing.assert_close(value, split_loss(trainable, False))
    tree_allclose(got, expected)


def test_scalar_outputs_become_one_entry_per_replica() -> None:
    params = make_params()
    inputs, kwargs = make_batch(6)

    def summed(p: Any, *args: Any, **kw: Any) -> torch.Tensor:
        return loss_of(model(p, *args, **kw))

    with pytest.warns(UserWarning, match="one entry per replica"):
        per_replica = fdp.data_parallel(summed, params, inputs, devices=["cpu"] * 3, kwargs=kwargs)
    assert per_replica.shape == (3,)
    torch.testing.assert_close(per_replica.sum(), summed(params, *inputs, **kwargs))


def test_output_device_and_dim() -> None:
    params = {"w": torch.randn(4, 4, requires_grad=True)}
    x = torch.randn(3, 10, 4)  # batch along dim 1

    def fn(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return x @ p["w"]

    out = fdp.data_parallel(fn, params, x, devices=["cpu"] * 4, output_device=-1, dim=1)
    torch.testing.assert_close(out, fn(params, x))


def test_replicas_returning_different_structures() -> None:
    def fn(p: Any, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"big": x} if x.shape[0] > 2 else {"small": x}

    with pytest.raises(
        ValueError,
        match=r"fdp.data_parallel: `outputs` replicas returned different structures; "
        r"replica 1's against replica 0's: missing output\['big'\]; unexpected output\['small'\]$",
    ):
        fdp.data_parallel(fn, {}, torch.ones(5), devices=["cpu", "cpu"])


def test_errors_name_data_parallel() -> None:
    with pytest.raises(ValueError, match=r"fdp.data_parallel: `devices` expected at least one"):
        fdp.data_parallel(model, {}, torch.ones(2), devices=[])
    with pytest.raises(TypeError, match=r"fdp.data_parallel: `output_device` expected"):
        fdp.data_parallel(model, {}, torch.ones(2), devices=["cpu"], output_device=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"fdp.data_parallel: `dim` is out of range for leaf"):
        fdp.data_parallel(model, {}, torch.ones(2), devices=["cpu"], dim=3)


def test_fake_devices_place_everything_and_reduce_grads() -> None:
    cpu_params = {
        "w": torch.randn(5, 3, requires_grad=True),
        "b": torch.randn(3, requires_grad=True),
    }
    params = label(cpu_params, 0)
    x = torch.randn(8, 5)

    def fn(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ p["w"] + p["b"])

    out = fdp.data_parallel(fn, params, label(x, 0), devices=[fake(0), fake(1), fake(2)])
    ref = fn(cpu_params, x)
    assert out.device == fake(0)
    torch.testing.assert_close(plain(out), ref)
    grads = torch.autograd.grad((out**2).sum(), [params["w"], params["b"]])
    ref_grads = torch.autograd.grad((ref**2).sum(), [cpu_params["w"], cpu_params["b"]])
    for g, e in zip(grads, ref_grads, strict=True):
        assert g.device == fake(0)
        torch.testing.assert_close(plain(g), e)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_devices_match_cpu_reference() -> None:
    params = make_params()
    on_cuda = optree.tree_map(
        lambda t: (
            t.detach().cuda().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
        ),
        cast(Any, params),
        none_is_leaf=True,
    )
    inputs, kwargs = make_batch(11)  # on the CPU: scatter moves each chunk
    devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())] * 2
    out = fdp.data_parallel(model, on_cuda, inputs, devices=devices, kwargs=kwargs)
    ref = model(params, *inputs, **kwargs)
    assert out["logits"].device == torch.device("cuda", 0)
    torch.testing.assert_close(out["logits"].cpu(), ref["logits"], rtol=1e-4, atol=1e-5)
    assert_same_grads(out, on_cuda, ref, params, rtol=1e-4, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_replicas_compile_with_fullgraph() -> None:
    # Before: dynamo could not trace the devices' check (torch.cuda.device_count).
    g = torch.Generator().manual_seed(0)
    cpu = {"w": torch.randn(16, 8, generator=g), "b": torch.randn(8, generator=g)}
    params = {k: v.cuda().requires_grad_() for k, v in cpu.items()}
    ref_params = {k: v.clone().requires_grad_() for k, v in cpu.items()}
    x = torch.randn(12, 16, generator=g)

    def fn(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ p["w"] + p["b"])

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return fdp.data_parallel(fn, p, x, devices=["cuda:0", "cuda:0"]).square().mean()

    loss(params, x.cuda())  # eager first: the devices are checked there
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    out = compiled(params, x.cuda())
    grads = torch.autograd.grad(out, list(params.values()))
    ref = fn(ref_params, x).square().mean()  # one CPU device, the whole batch
    ref_grads = torch.autograd.grad(ref, list(ref_params.values()))
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-5)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_cuda_replicate_across_devices() -> None:
    w = torch.randn(100, 10, device="cuda:0", requires_grad=True)
    a, b = fdp.replicate({"w": w}, ["cuda:0", "cuda:1"])
    assert a["w"] is w
    assert b["w"].device == torch.device("cuda", 1)
    (a["w"].sum() + (b["w"] * 2).sum()).backward()
    assert w.grad is not None
    torch.testing.assert_close(w.grad, torch.full_like(w, 3.0))


def test_torch_habits_get_errors_that_say_what_to_do() -> None:
    # Before: the user's own TypeError (a list as one argument, a module as fn),
    # or "expected a tensor" with no way forward.
    net = torch.nn.Linear(3, 2)
    fn, state = fdp.make_functional(net)
    x = torch.randn(4, 3)
    cpus = ["cpu", "cpu"]
    with pytest.raises(TypeError, match=r"`inputs` is a list, passed to fn as one argument"):
        fdp.data_parallel(fn, state, [x], devices=cpus)
    with pytest.raises(TypeError, match=r"`fn` is a torch.nn.Module.*fdp.make_functional"):
        fdp.data_parallel(net, state, x, devices=cpus)
    with pytest.raises(TypeError, match=r"got Linear.*fn, state = fdp.make_functional\(module\)"):
        fdp.data_parallel(fn, net, x, devices=cpus)
    with pytest.raises(TypeError, match=r"An iterator \(module.parameters\(\)\?\)"):
        fdp.data_parallel(fn, net.parameters(), x, devices=cpus)
    # What the hints point to is right: the reference is the direct call.
    torch.testing.assert_close(fdp.data_parallel(fn, state, (x,), devices=cpus), net(x))
