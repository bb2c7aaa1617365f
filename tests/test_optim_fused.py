"""fdp.optim's eager step through torch's fused kernels (fdp.optim._fused).

The reference is torch.optim with ``fused=True`` on the same leaves and
gradients (bitwise), and torch's foreach step where a leaf cannot be fused.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils._python_dispatch import TorchDispatchMode

import fdp
from tests.helpers import detached_copy, tensor_leaves
from tests.test_optim import CONFIGS, STEPS, fdp_steps, grad_for


def float_tree() -> dict[str, Any]:
    """Every dtype the kernels take, a channels_last leaf, a leaf of no elements."""
    g = torch.Generator().manual_seed(0)

    def p(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (0.5 * torch.randn(*shape, generator=g)).to(dtype).requires_grad_()

    conv = p(2, 3, 4, 5).detach().to(memory_format=torch.channels_last).requires_grad_()
    return {
        "w": [p(8, 4), p(4)],
        "f64": p(3, 2, dtype=torch.float64),
        "bf16": p(6, dtype=torch.bfloat16),
        "f16": p(5, dtype=torch.float16),
        "conv": conv,
        "empty": p(0, 3),
        "none": None,
    }


def torch_steps(name: str, tree: Any, **how: Any) -> list[torch.Tensor]:
    _, torch_cls, hyper = CONFIGS[name]
    leaves = tensor_leaves(tree)
    opt = torch_cls(leaves, **how, **hyper)
    for step in range(STEPS):
        for i, p in enumerate(leaves):
            p.grad = grad_for(step, i, p)
        opt.step()
    return leaves


class _Kernels(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """The names of the optimizer kernels a step runs."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.__name__
        if name.startswith(("_fused_", "_foreach_sqrt")):
            self.names.append(name.split(".")[0])
        return func(*args, **(kwargs or {}))


# Pure, SGD without weight decay, dampening, Nesterov or maximize runs torch's
# foreach rule: the fused kernel would need copies first (docs/optim.md).
FOREACH_WHEN_PURE = ("sgd", "sgd_heavy_ball")


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donated"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_default_eager_step_is_torchs_fused_or_foreach_step_bitwise(
    name: str, donate: bool
) -> None:
    foreach = not donate and name in FOREACH_WHEN_PURE
    expected = torch_steps(
        name, float_tree(), **({"foreach": True} if foreach else {"fused": True})
    )
    before = detached_copy(float_tree())
    with _Kernels() as seen:
        got = tensor_leaves(fdp_steps(name, before, donate=donate))
    kernel = "_fused_sgd_" if name.startswith("sgd") else "_fused_adam"
    if foreach:
        assert not any(n.startswith("_fused_") for n in seen.names), seen.names
    else:
        assert seen.names
        assert all(n.startswith(kernel) for n in seen.names), seen.names
    for g, e in zip(got, expected, strict=True):
        assert (g.dtype, g.stride()) == (e.dtype, e.stride())
        torch.testing.assert_close(g, e.detach(), rtol=0, atol=0)
    if not donate:  # the caller's tensors untouched
        torch.testing.assert_close(tensor_leaves(before), tensor_leaves(float_tree()))


def test_the_fused_step_keeps_the_pure_contract() -> None:
    """New tensors that require grad as the old did; the old state untouched; steps counted."""
    opt = fdp.optim.adamw(0.1)
    params = {"w": torch.ones(3, requires_grad=True), "b": torch.ones(2)}
    state = opt.init(params)
    grads = {"w": torch.full((3,), 0.5), "b": None}
    new, new_state = opt.update(grads, state, params)
    assert new["w"] is not params["w"]
    assert new["w"].requires_grad
    assert new["w"].is_leaf
    assert new["b"] is params["b"]
    assert torch.equal(params["w"], torch.ones(3))
    assert torch.equal(state["exp_avg"]["w"], torch.zeros(3))
    assert (state["step"]["w"].item(), new_state["step"]["w"].item()) == (0.0, 1.0)
    assert new_state["step"]["b"].item() == 0.0


def test_leaves_the_kernel_would_misread_take_the_foreach_step() -> None:
    """A gradient expanded from a sum (stride 0) or in another memory format than its
    parameter: torch's CPU kernel walks memory in order and would misread it."""
    g = torch.Generator().manual_seed(1)
    conv = torch.randn(2, 3, 4, 5, generator=g).to(memory_format=torch.channels_last)
    params = {"fused": torch.randn(4, 3, generator=g), "wide": torch.randn(4, 3, generator=g)}
    params["conv"] = conv
    grads = {
        "fused": torch.randn(4, 3, generator=g),
        "wide": torch.randn(1, 3, generator=g).expand(4, 3),
        "conv": torch.randn(2, 3, 4, 5, generator=g),  # contiguous: another layout
    }
    opt = fdp.optim.adam(0.1, weight_decay=0.1)
    new, state = opt.update(grads, opt.init(params), params)
    new, state = opt.update(grads, state, new)
    for key, p in params.items():
        ref = p.clone().requires_grad_()
        reference = torch.optim.Adam([ref], lr=0.1, weight_decay=0.1, foreach=True)
        for _ in range(2):
            ref.grad = grads[key].contiguous()
            reference.step()
        torch.testing.assert_close(new[key], ref.detach(), rtol=1e-6, atol=1e-7)
    with pytest.raises(
        ValueError,
        match=r"params\['conv'\] expected .*strides \(60, 1, 15, 3\), gradient strides \(60, 20",
    ):
        fdp.optim.adam(0.1, fused=True).update(grads, state, new)


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donated"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_foreach_true_is_torchs_foreach_step_bitwise(name: str, donate: bool) -> None:
    """Every dtype, float16 and bfloat16 included: a pure step's new lists round as
    torch's in-place kernels do."""
    expected = torch_steps(name, float_tree(), foreach=True)
    make, _, hyper = CONFIGS[name]
    opt = make(**hyper, foreach=True)
    with _Kernels() as seen:
        got = tensor_leaves(fdp_steps(name, detached_copy(float_tree()), opt=opt, donate=donate))
    assert not any(n.startswith("_fused_") for n in seen.names), seen.names
    for g, e in zip(got, expected, strict=True):
        assert (g.dtype, g.stride()) == (e.dtype, e.stride())
        torch.testing.assert_close(g, e.detach(), rtol=0, atol=0)


def test_complex_leaves_fuse_as_real_pairs() -> None:
    g = torch.Generator().manual_seed(2)
    z = 0.1 * torch.randn(3, 4, generator=g, dtype=torch.complex64)
    grad = 0.1 * torch.randn(3, 4, generator=g, dtype=torch.complex64)
    opt = fdp.optim.adamw(0.01)
    with _Kernels() as seen:
        new, _ = opt.update({"z": grad}, opt.init({"z": z}), {"z": z})
    assert seen.names == ["_fused_adamw_"]
    ref = z.clone().requires_grad_()
    ref.grad = grad
    torch.optim.AdamW([ref], lr=0.01, foreach=True).step()
    torch.testing.assert_close(new["z"], ref.detach(), rtol=1e-6, atol=1e-7)


def test_fused_is_refused_where_it_cannot_apply() -> None:
    p = {"w": torch.ones(2, requires_grad=True)}
    lr = torch.tensor(0.1, requires_grad=True)  # a hypergradient: the step carries derivatives
    opt = fdp.optim.sgd(lr, fused=True)
    with pytest.raises(ValueError, match=r"sgd.update: `fused=True` runs torch's fused kernel"):
        opt.update({"w": torch.ones(2)}, opt.init(p), p)
    new, _ = fdp.optim.sgd(lr).update({"w": torch.ones(2)}, opt.init(p), p)  # default: plain
    assert new["w"].grad_fn is not None
    with pytest.raises(ValueError, match=r"adamw: `foreach` and `fused` expected at most one"):
        fdp.optim.adamw(foreach=True, fused=True)
    with pytest.raises(TypeError, match=r"sgd: `fused` expected a bool or None; got 'yes'"):
        fdp.optim.sgd(fused="yes")  # type: ignore[arg-type]

    class Sign(fdp.optim.Optimizer):
        name = "sign"

        def rule(self, ops: Any, params: Any, grads: Any, *rest: Any) -> tuple[Any, Any]:
            return ops("sub", params, ops("sign", grads)), {}

    with pytest.raises(ValueError, match=r"fdp.optim.sign: `fused=True` expected an optimizer"):
        Sign(0.1, fused=True)
    new, _ = Sign(0.1).update({"w": torch.ones(2)}, {"step": {"w": torch.zeros(())}}, p)
    assert torch.equal(new["w"], torch.zeros(2))  # no kernel: the foreach rule


def test_a_compiled_step_traces_the_foreach_rule_once() -> None:
    """Under torch.compile the rule is traced (inductor fuses it): one graph for ten steps."""
    torch._dynamo.reset()  # counted from a clean cache: earlier tests compiled update too
    counts = CompileCounterWithBackend("eager")
    opt = fdp.optim.adamw(fdp.optim.linear_schedule(0.1, 0.01, 10))
    update = torch.compile(opt.update, backend=counts, fullgraph=True)
    params = {"w": torch.ones(4), "b": torch.ones(2)}
    state = opt.init(params)
    eager_p, eager_s = params, opt.init(params)
    for step in range(STEPS):
        grads = {k: torch.sin(v.detach() * (step + 1)) for k, v in params.items()}
        params, state = update(grads, state, params)
        eager_p, eager_s = opt.update(grads, eager_s, eager_p)
    assert counts.frame_count == 1
    for key in params:
        torch.testing.assert_close(params[key], eager_p[key], rtol=1e-6, atol=1e-7)
