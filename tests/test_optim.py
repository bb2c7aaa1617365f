"""fdp.optim against torch.optim (foreach=True) on the same trees and gradients (fdp.optim._base).

The default eager step runs torch's fused kernels (tests/test_optim_fused.py
compares it with torch's ``fused=True`` bitwise); here both of fdp's paths
are held to torch's foreach step to rounding.

Each step's gradient is a fixed function of the step and the current
parameters, so the two trajectories only agree if every update does. One
leaf has no gradient on odd steps (torch skips it and keeps its step).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import optree
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fdp
from tests.helpers import detached_copy, params_corpus, tensor_leaves, tree_allclose

STEPS = 10
SKIPPED = 1  # the index (in tensor_leaves order) of the leaf without grad on odd steps

CONFIGS: dict[str, tuple[Callable[..., Any], type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (fdp.optim.sgd, torch.optim.SGD, {"lr": 0.1}),
    "sgd_momentum": (
        fdp.optim.sgd,
        torch.optim.SGD,
        {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01, "nesterov": True},
    ),
    "sgd_heavy_ball": (fdp.optim.sgd, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "sgd_dampening": (
        fdp.optim.sgd,
        torch.optim.SGD,
        {"lr": 0.05, "momentum": 0.8, "dampening": 0.3},
    ),
    "adam": (fdp.optim.adam, torch.optim.Adam, {"lr": 0.01}),
    "adam_amsgrad": (
        fdp.optim.adam,
        torch.optim.Adam,
        {"lr": 0.01, "weight_decay": 0.1, "amsgrad": True, "betas": (0.8, 0.99)},
    ),
    "adamw": (fdp.optim.adamw, torch.optim.AdamW, {"lr": 0.01}),
    "sgd_maximize": (
        fdp.optim.sgd,
        torch.optim.SGD,
        {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01, "maximize": True},
    ),
    "adam_maximize": (
        fdp.optim.adam,
        torch.optim.Adam,
        {"lr": 0.01, "weight_decay": 0.1, "amsgrad": True, "maximize": True},
    ),
    "adam_decoupled": (
        fdp.optim.adam,
        torch.optim.Adam,
        {"lr": 0.01, "weight_decay": 0.1, "decoupled_weight_decay": True},
    ),
    "adamw_maximize": (fdp.optim.adamw, torch.optim.AdamW, {"lr": 0.01, "maximize": True}),
}


def grad_for(step: int, i: int, p: torch.Tensor) -> torch.Tensor | None:
    if i == SKIPPED and step % 2 == 1:
        return None
    return torch.sin(p.detach() * (step + 1)) + 0.1 * (i + 1)


def tolerance(t: torch.Tensor, *, fused_sgd: bool = False) -> dict[str, Any]:
    # float16 rounds each op to 1e-3; the two sides round in different places.
    if t.dtype == torch.float16:
        return {"rtol": 2e-3, "atol": 2e-3}
    # torch's own fused and foreach SGD steps with momentum 0.9 drift apart by up
    # to 3.3e-6 relative in float32 over these ten steps (sgd_heavy_ball).
    return {"rtol": 5e-6, "atol": 1e-7} if fused_sgd else {"rtol": 1e-6, "atol": 1e-7}


def torch_steps(name: str, tree: Any) -> list[torch.Tensor]:
    _, torch_cls, hyper = CONFIGS[name]
    leaves = tensor_leaves(tree)
    opt = torch_cls(leaves, foreach=True, **hyper)  # type: ignore[call-arg]
    for step in range(STEPS):
        for i, p in enumerate(leaves):
            p.grad = grad_for(step, i, p)
        opt.step()
    return leaves


def fdp_steps(
    name: str,
    tree: Any,
    *,
    opt: Any = None,
    compile_with: Any = None,
    lr: torch.Tensor | None = None,
    donate: bool = False,
) -> Any:
    """Ten updates; with ``lr``, it is halved in place after step 5 (a schedule)."""
    make, _, hyper = CONFIGS[name]
    opt = opt or make(**hyper)
    state = opt.init(tree)
    update = functools.partial(opt.update, donate=donate)
    update = update if compile_with is None else compile_with(update)
    for step in range(STEPS):
        leaves, spec = optree.tree_flatten(tree, none_is_leaf=True)
        index = {id(t): i for i, t in enumerate(tensor_leaves(tree))}
        grads = optree.tree_unflatten(
            spec, [None if t is None else grad_for(step, index[id(t)], t) for t in leaves]
        )
        tree, state = update(grads, state, tree)
        if lr is not None and step == STEPS // 2:
            lr.mul_(0.5)
    return tree


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donated"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_ten_steps_equal_torch_optim_over_the_tree_corpus(name: str, donate: bool) -> None:
    expected = torch_steps(name, params_corpus())
    got = tensor_leaves(fdp_steps(name, detached_copy(params_corpus()), donate=donate))
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == e.dtype
        fused_sgd = donate and name.startswith("sgd")  # donated, SGD runs its fused kernel
        torch.testing.assert_close(g, e.detach(), **tolerance(e, fused_sgd=fused_sgd))


def complex_tree() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    # Small values: sin of a large imaginary part (the test gradient) overflows.
    return {
        "z": (0.1 * torch.randn(3, 4, generator=g, dtype=torch.complex64)).requires_grad_(),
        "r": torch.randn(5, generator=g).requires_grad_(),
        "zd": (0.1 * torch.randn(2, generator=g, dtype=torch.complex128)).requires_grad_(),
    }


# Ascending the test's gradient (sin of the parameter) blows a complex leaf's
# imaginary part up, where rounding differences grow past any tolerance.
@pytest.mark.parametrize("name", [n for n in CONFIGS if "maximize" not in n])
def test_complex_leaves_step_as_real_pairs_like_torch(name: str) -> None:
    # torch views complex parameters as real pairs: Adam's second moment is
    # per component (re^2, im^2), not the complex g * g.
    expected = torch_steps(name, complex_tree())
    for donate in (False, True):
        got = tensor_leaves(fdp_steps(name, detached_copy(complex_tree()), donate=donate))
        for g, e in zip(got, expected, strict=True):
            assert g.dtype == e.dtype
            torch.testing.assert_close(g, e.detach(), rtol=1e-6, atol=1e-7)


def large_tree() -> dict[str, Any]:
    """Leaves over several of the eager step's runs of 4 MiB: one larger than a run,
    a complex one, runs cut between leaves of mixed sizes."""
    g = torch.Generator().manual_seed(0)
    return {
        "w": [(0.1 * torch.randn(512, 512, generator=g)).requires_grad_() for _ in range(5)],
        "big": (0.1 * torch.randn(1536, 1024, generator=g)).requires_grad_(),
        "z": (0.01 * torch.randn(300, 1000, generator=g, dtype=torch.complex64)).requires_grad_(),
        "b": [torch.zeros(512, requires_grad=True) for _ in range(3)],
    }


class _Denominators(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """The bytes of every foreach ``sqrt``: Adam's denominator, the step's temporary."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.nbytes: list[int] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._foreach_sqrt.default:
            self.nbytes.append(sum(t.numel() * t.element_size() for t in args[0]))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["adamw", "adam_amsgrad"])
def test_an_eager_cpu_step_makes_its_temporaries_run_by_run_and_equals_torch(name: str) -> None:
    """Adam's denominator for runs of leaves of at most 4 MiB, not for the whole tree
    (25 MiB here); the same trajectory as torch.optim's foreach step."""
    from fdp.optim._lists import RUN_BYTES

    expected = torch_steps(name, large_tree())
    make, _, hyper = CONFIGS[name]
    for donate in (False, True):
        with _Denominators() as made:  # the foreach step (the fused one makes no temporary)
            opt = make(**hyper, fused=False)
            got = tensor_leaves(
                fdp_steps(name, detached_copy(large_tree()), opt=opt, donate=donate)
            )
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g, e.detach(), rtol=1e-6, atol=1e-7)
        big = 1536 * 1024 * 4  # the one leaf larger than a run: a run of its own
        assert max(made.nbytes) == big
        assert max(n for n in made.nbytes if n != big) <= RUN_BYTES
        assert len(made.nbytes) == 4 * STEPS  # b.*; big; w.0-3; w.4 and z


class _Kernels(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """The bytes of each call to ``kernel`` (an op, any overload; its first list)."""

    def __init__(self, kernel: Any) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.kernel, self.nbytes = kernel, list[int]()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.overloadpacket is self.kernel:
            self.nbytes.append(sum(t.numel() * t.element_size() for t in args[0]))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("fused", [None, False], ids=["default", "foreach"])
@pytest.mark.parametrize("name", ["sgd_heavy_ball", "sgd_momentum", "sgd_dampening"])
def test_a_pure_eager_cpu_sgd_step_runs_run_by_run_and_equals_torch(
    name: str, fused: bool | None
) -> None:
    """A pure SGD step a run of at most 4 MiB at a time (its new buffer still in
    cache for the parameters' add; the fused kernel's copies likewise); donated, the
    fused kernel over the whole tree at once. Both the trajectory of torch's step."""
    from fdp.optim._lists import RUN_BYTES

    expected = torch_steps(name, large_tree())
    make, _, hyper = CONFIGS[name]
    heavy_ball = name == "sgd_heavy_ball"  # pure and undamped: foreach by default
    for donate in (False, True):
        by_kernel = fused is None and (donate or not heavy_ball)
        kernel = torch.ops.aten._fused_sgd_ if by_kernel else torch.ops.aten._foreach_mul
        kernel = torch.ops.aten._foreach_mul_ if donate and not by_kernel else kernel
        with _Kernels(kernel) as made:
            opt = make(**hyper, fused=fused)
            got = tensor_leaves(
                fdp_steps(name, detached_copy(large_tree()), opt=opt, donate=donate)
            )
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g, e.detach(), **tolerance(e, fused_sgd=by_kernel))
        big = 1536 * 1024 * 4  # the one leaf larger than a run: a run of its own
        if donate:
            assert len(made.nbytes) >= STEPS
            assert max(made.nbytes) > RUN_BYTES  # the whole tree in one call
        else:
            assert max(made.nbytes) == big
            assert max(n for n in made.nbytes if n != big) <= RUN_BYTES
            assert len(made.nbytes) >= 4 * STEPS  # b.*; big; w.0-3; w.4 and z


def test_runs_cut_where_the_bytes_add_up_to_more_than_a_run() -> None:
    """Consecutive runs that cover every leaf, each at most a run's bytes (or one leaf),
    each cut where the next leaf would not fit; a sparse leaf counts its dense size, a
    leaf on another device keeps one run."""
    from fdp.optim._lists import RUN_BYTES, runs

    quarter = RUN_BYTES // 4 // 4  # float32 elements in a quarter of a run
    cases = {  # leaves' element counts: the runs, as leaf indices, worked out by hand
        (1, 2, 3): [[0, 1, 2]],
        (quarter,) * 9: [[0, 1, 2, 3], [4, 5, 6, 7], [8]],
        (5 * quarter, 1, quarter, 3 * quarter, 1): [[0], [1, 2], [3, 4]],
        (1,): [[0]],
    }
    for counts, expected in cases.items():
        index = list(range(len(counts)))
        got = [index[r] for r in runs([torch.zeros(n) for n in counts])]
        assert got == expected
        assert [i for run in got for i in run] == index  # consecutive, every leaf once
        nbytes = [4 * sum(counts[i] for i in run) for run in got]
        assert all(n <= RUN_BYTES or len(r) == 1 for n, r in zip(nbytes, got, strict=True))
        for n, following in zip(nbytes, got[1:], strict=False):
            assert n + 4 * counts[following[0]] > RUN_BYTES  # the next leaf would not fit
    at = torch.tensor([[0]])
    checked = torch.sparse.check_sparse_tensor_invariants()  # type: ignore[no-untyped-call]
    with checked:  # torch 2.11 warns at the sparse tensor's making otherwise
        sparse = torch.sparse_coo_tensor(at, torch.ones(1), (3 * quarter,))
        assert runs([torch.zeros(3 * quarter), sparse]) == [slice(0, 1), slice(1, 2)]
    assert runs([torch.zeros(3 * quarter), torch.zeros(3 * quarter, device="meta")]) == [
        slice(None)
    ]


def test_sparse_gradients_step_as_torchs_sgd_or_are_refused_by_name() -> None:
    """SGD's ops take a sparse gradient, as torch's SGD does; other rules name the leaf,
    and ``init`` names a sparse parameter, instead of failing inside a kernel."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(4, 3, generator=g)
    rows = torch.tensor([[0, 2]])
    grads = [
        torch.sparse_coo_tensor(rows, torch.randn(2, 3, generator=g), (4, 3), check_invariants=True)
        for _ in "abc"
    ]
    opt = fdp.optim.sgd(0.1, momentum=0.9)
    params = {"w": w.clone()}
    state = opt.init(params)
    for grad in grads:
        params, state = opt.update({"w": grad}, state, params)
    reference = torch.nn.Parameter(w.clone())
    torch_opt = torch.optim.SGD([reference], lr=0.1, momentum=0.9)
    for grad in grads:
        reference.grad = grad.clone()
        torch_opt.step()
    torch.testing.assert_close(params["w"], reference.detach(), rtol=0, atol=0)
    for adam in (fdp.optim.adamw(0.1), fdp.optim.adamw(0.1, fused=False)):
        for donate in (False, True):
            with pytest.raises(ValueError, match=r"`grads` leaf grads\['w'\].*sparse_coo"):
                adam.update({"w": grads[0]}, adam.init({"w": w.clone()}), {"w": w.clone()},
                            donate=donate)  # fmt: skip
    sparse = {"b": torch.ones(2), "w": grads[0]}
    with pytest.raises(ValueError, match=r"sgd.init: `params` leaf params\['w'\].*sparse_coo"):
        opt.init(sparse)


def test_update_is_pure_and_skips_none_grads() -> None:
    opt = fdp.optim.adam(0.1)
    params = {"w": torch.ones(3), "b": torch.zeros(2), "n": None}
    state = opt.init(params)
    inputs: Any = (params, state)
    before = optree.tree_map(torch.clone, inputs)
    new, new_state = opt.update({"w": torch.ones(3), "b": None, "n": None}, state, params)
    assert optree.tree_all(  # the inputs are untouched
        optree.tree_map(torch.equal, inputs, before)
    )
    assert new["b"] is params["b"]
    assert new_state["exp_avg"]["b"] is state["exp_avg"]["b"]
    assert int(new_state["step"]["b"]) == 0
    assert int(new_state["step"]["w"]) == 1
    torch.testing.assert_close(new["w"], torch.full((3,), 0.9))


@pytest.mark.parametrize("name", ["sgd_heavy_ball", "adamw"])
def test_step_counts_are_each_leafs_own_in_its_dtype_and_shape(name: str) -> None:
    # A pure step makes the new counts as views of one stacked tensor: each
    # must still be a count of its own (written in place by a later donated
    # step, alone), keep its dtype and shape, and a stack that cannot hold
    # the counts (other dtypes, shapes) must not change them.
    make, _, hyper = CONFIGS[name]
    opt = make(**hyper)
    params = {k: torch.ones(3) for k in "abcd"}
    grads = {k: torch.ones(3) for k in "abcd"}
    state = opt.init(params)
    _, state = opt.update(grads, state, params)
    state["step"]["b"].add_(5)  # one count alone, in place
    assert [state["step"][k].item() for k in "abcd"] == [1.0, 6.0, 1.0, 1.0]
    p, state = opt.update(grads, state, params)
    p, state = opt.update(grads, state, p, donate=True)
    assert [state["step"][k].item() for k in "abcd"] == [3.0, 8.0, 3.0, 3.0]
    state["step"]["c"] = torch.tensor(4.0, dtype=torch.float32)  # a count of another dtype
    _, mixed = opt.update(grads, state, p)
    assert [mixed["step"][k].item() for k in "abcd"] == [4.0, 9.0, 5.0, 4.0]
    assert [mixed["step"][k].dtype for k in "abcd"] == [torch.float64] * 2 + [
        torch.float32,
        torch.float64,
    ]
    state["step"]["c"] = torch.tensor([4.0], dtype=torch.float64)  # another shape
    _, shaped = opt.update(grads, state, p)
    assert [tuple(shaped["step"][k].shape) for k in "abcd"] == [(), (), (1,), ()]
    assert [shaped["step"][k].item() for k in "abcd"] == [4.0, 9.0, 5.0, 4.0]
    # Donated from init: the counts all at once, or each alone while a leaf
    # has no gradient (its count stays).
    p, state = {k: torch.ones(3) for k in "abcd"}, opt.init(params)
    for left_out in (None, "b", "d", None):
        step = grads | ({} if left_out is None else {left_out: None})
        p, state = opt.update(step, state, p, donate=True)
    assert [state["step"][k].item() for k in "abcd"] == [4.0, 3.0, 4.0, 3.0]
    p, state = opt.update(grads, state, p)  # and a pure step after them
    assert [state["step"][k].item() for k in "abcd"] == [5.0, 4.0, 5.0, 4.0]
    # One count at two leaves (the other element of its tensor at none): added
    # to twice, as the foreach add does, and the orphan left alone.
    p, state = {k: torch.ones(3) for k in "abcd"}, opt.init(params)
    orphan, state["step"]["b"] = state["step"]["b"], state["step"]["a"]
    _, state = opt.update(grads, state, p, donate=True)
    assert [state["step"][k].item() for k in "abcd"] + [orphan.item()] == [2, 2, 1, 1, 0]


@pytest.mark.compile
def test_compiled_update_matches_eager_and_compiles_once() -> None:
    torch._dynamo.reset()
    frames = []

    def backend(gm: torch.fx.GraphModule, example: Any) -> Any:
        frames.append(gm)
        return gm.forward

    def run(compile_with: Any) -> list[torch.Tensor]:
        lr = torch.tensor(0.01)
        # Functional-style parameters (torch.func.grad loops): no requires_grad.
        tree = optree.tree_map(torch.Tensor.detach, params_corpus())  # type: ignore[arg-type]
        opt = fdp.optim.adamw(lr, amsgrad=True)
        return tensor_leaves(fdp_steps("adamw", tree, opt=opt, compile_with=compile_with, lr=lr))

    got = run(lambda f: torch.compile(f, backend=backend, fullgraph=True))
    expected = run(None)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, **tolerance(e))
    # One graph for all ten steps and both learning rates, per pattern of
    # None gradients (the skipped leaf's two).
    assert len(frames) == 2


@pytest.mark.compile
@pytest.mark.parametrize("name", ["sgd_heavy_ball", "adamw"])
def test_a_compiled_donated_update_steps_inits_counts_as_eager(name: str) -> None:
    # init's counts are views of one tensor: compiled and donated, they are
    # inputs that alias and are written in place (AOTAutograd's synthetic base).
    make, _, hyper = CONFIGS[name]
    opt = make(**{**hyper, "lr": torch.tensor(hyper["lr"])})
    update: Any = torch.compile(opt.update, backend="aot_eager", fullgraph=True)
    g = torch.Generator().manual_seed(0)
    grads = [{k: torch.randn(3, generator=g) for k in "abcd"} for _ in range(3)]
    got = {k: torch.randn(3, generator=g) for k in "abcd"}
    want = {k: v.clone() for k, v in got.items()}
    got_state, want_state = opt.init(got), opt.init(want)
    for step in grads:
        got, got_state = update(step, got_state, got, donate=True)
        want, want_state = opt.update(step, want_state, want, donate=True)
    tree_allclose(got, want, rtol=1e-6, atol=1e-7)
    tree_allclose(got_state, want_state, rtol=1e-6, atol=1e-7)
    assert [got_state["step"][k].item() for k in "abcd"] == [3.0] * 4


def test_donated_update_writes_into_the_inputs_and_returns_them() -> None:
    opt = fdp.optim.adamw(0.1, amsgrad=True)
    params = {"w": torch.ones(3, requires_grad=True), "skip": torch.ones(2)}
    state = opt.init(params)
    expected = opt.update({"w": torch.ones(3), "skip": None}, state, params)
    got = opt.update({"w": torch.ones(3), "skip": None}, state, params, donate=True)
    tree_allclose(got, expected, rtol=0, atol=0)
    assert got[0]["w"] is params["w"]  # the same leaf, still requiring grad
    assert got[0]["w"].requires_grad
    assert got[1]["exp_avg"]["w"] is state["exp_avg"]["w"]
    assert got[1]["step"]["w"] is state["step"]["w"]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_donated_step_steps_a_tied_tensor_once(name: str) -> None:
    # One tensor at two leaves (and overlapping slices of one, a strided one
    # and an empty one among them): written in
    # place it was stepped twice. Reference: torch's optimizer on separate
    # copies, each with its leaf's gradient, as the pure step computes.
    make, torch_cls, hyper = CONFIGS[name]
    base = torch.linspace(-1, 1, 6)
    results = []
    for donate in (False, True):
        w = base.clone()
        tree = {"a": w, "b": w, "head": w[:4], "tail": w[2:], "odd": w[1::2], "none": w[6:]}
        opt = make(**hyper)
        state = opt.init(tree)
        for step in range(3):
            grads = {
                k: torch.cos(v.detach() * (step + 1 + j)) for j, (k, v) in enumerate(tree.items())
            }
            tree, state = opt.update(grads, state, tree, donate=donate)
        results.append(tree)
    separate = [base.clone().requires_grad_(), base.clone().requires_grad_(),
                base[:4].clone().requires_grad_(), base[2:].clone().requires_grad_(),
                base[1::2].clone().requires_grad_(), base[6:].clone().requires_grad_()]  # fmt: skip
    ref = torch_cls(separate, **hyper)
    for step in range(3):
        for j, t in enumerate(separate):
            t.grad = torch.cos(t.detach() * (step + 1 + j))
        ref.step()
    for got in results:
        for key, expected in zip(("a", "b", "head", "tail", "odd", "none"), separate, strict=True):
            torch.testing.assert_close(got[key], expected.detach(), rtol=1e-6, atol=1e-7)


def test_a_tensor_learning_rate_changed_in_place_takes_effect() -> None:
    lr = torch.tensor(0.5)
    opt = fdp.optim.sgd(lr)
    params = {"w": torch.ones(2, requires_grad=True)}
    state = opt.init(params)
    params, state = opt.update({"w": torch.ones(2)}, state, params)
    lr.fill_(0.25)
    params, state = opt.update({"w": torch.ones(2)}, state, params)
    torch.testing.assert_close(params["w"].detach(), torch.full((2,), 0.25))
    # Eagerly the new parameter is a leaf that requires grad, like the old one.
    assert params["w"].requires_grad
    assert params["w"].is_leaf


def test_bad_input_is_refused_with_the_leaf_path() -> None:
    opt = fdp.optim.sgd(0.1)
    params = {"a": torch.ones(2), "b": [torch.ones(3)]}
    state = opt.init(params)
    with pytest.raises(
        ValueError, match=r"`grads` leaf grads\['b'\]\[0\] expected a tensor of shape \(3,\)"
    ):
        opt.update({"a": torch.ones(2), "b": [torch.ones(4)]}, state, params)
    with pytest.raises(ValueError, match=r"`grads` expected the structure of `params`"):
        opt.update({"a": torch.ones(2)}, state, params)
    with pytest.raises(
        ValueError, match=r"fdp.optim.adam: `betas\[1\]` expected in \[0, 1\); got 1.0"
    ):
        fdp.optim.adam(0.1, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match=r"fdp.optim.sgd: `lr` expected >= 0; got -1"):
        fdp.optim.sgd(-1)
    with pytest.raises(ValueError, match=r"`nesterov=True` expected momentum > 0"):
        fdp.optim.sgd(0.1, nesterov=True)


def test_tensor_betas_step_as_torch_does() -> None:
    # torch accepts 0-d tensors as betas; fdp reads them once, as floats.
    betas = (torch.tensor(0.8), torch.tensor(0.99))
    w = torch.linspace(-1, 1, 5)
    ref = w.clone().requires_grad_()
    torch_opt = torch.optim.Adam([ref], lr=0.1, betas=betas)
    opt = fdp.optim.adam(0.1, betas=betas)
    params = {"w": w}
    state = opt.init(params)
    for step in range(3):
        g = torch.cos(w * (step + 1))
        params, state = opt.update({"w": g}, state, params)
        ref.grad = g
        torch_opt.step()
    torch.testing.assert_close(params["w"], ref.detach(), rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match=r"`betas\[0\]` expected a float or a 1-element tensor"):
        fdp.optim.adam(0.1, betas=(torch.tensor(0.9, requires_grad=True), 0.999))


@pytest.mark.parametrize("donate", [False, True])
def test_a_corrupt_state_is_named(donate: bool) -> None:
    opt = fdp.optim.adam(0.1)
    params = {"w": torch.ones(3)}
    state = opt.init(params)
    wrong = r"`state` leaf state\['{}'\]\['w'\] expected "
    cases = {
        wrong.format("exp_avg") + r"shape \(3,\) and dtype torch.float32": {
            **state,
            "exp_avg": {"w": torch.zeros(4)},
        },
        wrong.format("exp_avg") + r".* got a tensor of shape \(3,\), dtype torch.float64": {
            **state,
            "exp_avg": {"w": torch.zeros(3, dtype=torch.float64)},
        },
        # Before: promoted silently, returning a float64 parameter.
        wrong.format("exp_avg_sq") + r".* got a tensor of shape \(3,\), dtype torch.float64": {
            **state,
            "exp_avg_sq": {"w": torch.zeros(3, dtype=torch.float64)},
        },
        wrong.format("exp_avg_sq") + r".* got a tensor of shape \(3,\), dtype torch.bfloat16": {
            **state,
            "exp_avg_sq": {"w": torch.zeros(3, dtype=torch.bfloat16)},
        },
        wrong.format("step") + r"a 1-element tensor \(the step count\); got None": {
            **state,
            "step": {"w": None},
        },
    }
    for pattern, bad in cases.items():
        with pytest.raises(ValueError, match=pattern):
            opt.update({"w": torch.ones(3)}, bad, params, donate=donate)
        assert torch.equal(params["w"], torch.ones(3))  # nothing written before the refusal


TORCH_OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], Callable[..., Any]]] = {
    "sgd": (torch.optim.SGD, fdp.optim.sgd),
    "adam": (torch.optim.Adam, fdp.optim.adam),
    "adamw": (torch.optim.AdamW, fdp.optim.adamw),
}
REFUSED = {"capturable": True}


@pytest.mark.parametrize("name", list(TORCH_OPTIMIZERS))
def test_every_torch_optim_option_is_taken_or_refused_with_fdps_message(name: str) -> None:
    # Before, fdp.optim.adam(1e-3, maximize=True) got Python's bare TypeError.
    torch_cls, make = TORCH_OPTIMIZERS[name]
    options = {
        k: p.default
        for k, p in inspect.signature(torch_cls).parameters.items()
        if k != "params" and p.default is not inspect.Parameter.empty
    }
    for key, default in options.items():
        make(**{key: default})  # torch's default: what torch does, fdp does
    for key, value in REFUSED.items():
        if key in options:
            with pytest.raises(ValueError, match=rf"fdp.optim.{name}: `{key}` expected"):
                make(**{key: value})
    with pytest.raises(TypeError, match=rf"fdp.optim.{name}: got an unexpected keyword"):
        make(momentum_typo=0.9)


class _Lion(fdp.optim.Optimizer):
    """Lion (Chen et al., 2023) through the extension point: a sign step and one slot."""

    name = "lion"
    slots = ("exp_avg",)

    def __init__(self, lr: float, betas: tuple[float, float] = (0.9, 0.99)) -> None:
        super().__init__(lr)
        self.betas = betas

    def rule(
        self,
        ops: Any,
        params: Any,
        grads: Any,
        slots: Any,
        steps: Any,
        donate: bool,
        lr: Any,
    ) -> tuple[Any, Any]:
        beta1, beta2 = self.betas
        direction = ops("sign", ops("lerp", slots["exp_avg"], grads, 1 - beta1))
        new_params = ops("sub", params, ops("mul", direction, lr, own=True), own=donate)
        return new_params, {"exp_avg": ops("lerp", slots["exp_avg"], grads, 1 - beta2, own=donate)}


def _lion_reference(params: list[Any], grads: list[list[Any]]) -> Any:
    """Lion in plain torch, leaf by leaf."""
    m = [torch.zeros_like(p) for p in params]
    for step in grads:
        for j, g in enumerate(step):
            params[j] = params[j] - 0.1 * torch.sign(m[j] + 0.1 * (g - m[j]))
            m[j] = m[j] + 0.01 * (g - m[j])
    return params, m


@pytest.mark.parametrize("differentiable", [False, True], ids=["foreach", "plain"])
def test_an_optimizer_of_ones_own_through_the_rule_extension_point(differentiable: bool) -> None:
    g = torch.Generator().manual_seed(3)
    params = {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g), "n": None}
    grads = [{"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g), "n": None}]
    grads.append({"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g), "n": None})
    opt = _Lion(0.1)
    state, p = opt.init(params), dict(params)
    for step in grads:
        if differentiable:  # gradients that require grad: the step runs the plain ops
            step = {k: None if v is None else v.clone().requires_grad_() for k, v in step.items()}
        p, state = opt.update(step, state, p)
    assert (getattr(p["w"], "grad_fn", None) is not None) is differentiable
    plain = [[s["w"], s["b"]] for s in grads]
    want, m = _lion_reference([params["w"], params["b"]], plain)
    got = {"w": p["w"], "b": p["b"], "mw": state["exp_avg"]["w"], "mb": state["exp_avg"]["b"]}
    got = {k: v.detach() for k, v in got.items()}
    tree_allclose(got, {"w": want[0], "b": want[1], "mw": m[0], "mb": m[1]})
    assert state["step"]["w"].item() == 2.0
    assert p["n"] is None


def test_the_rule_extension_point_refuses_a_wrong_subclass_by_name() -> None:
    with pytest.raises(TypeError, match=r"subclass .*NoRule: expected a `rule` method"):

        class NoRule(fdp.optim.Optimizer):
            name = "no_rule"

    with pytest.raises(ValueError, match=r"subclass .*StepSlot: `slots` must not name \"step\""):

        class StepSlot(_Lion):
            slots = ("step",)

    class Misspelt(_Lion):
        def rule(self, ops: Any, params: Any, *args: Any) -> tuple[Any, Any]:
            return ops("sgin", params), {"exp_avg": params}

    p = {"w": torch.ones(2)}
    opt = Misspelt(0.1)
    with pytest.raises(ValueError, match=r"op `name` expected one of \[.*'sign'.*\]; got 'sgin'"):
        opt.update({"w": torch.ones(2)}, opt.init(p), p)
