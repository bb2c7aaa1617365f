"""fdp.grad and fdp.grad_and_value (fdp._grad) against torch.func.grad and one process.

Outside other transforms they run ``torch.autograd.grad``; inside (and
compiled) they are ``torch.func.grad``. Each case checks the gradient
against ``torch.func.grad`` of the same function, or, across ranks, against
one process on the whole batch.
"""

from __future__ import annotations

from typing import Any

import optree
import pytest
import torch

import fdp
from tests import ranks
from tests.helpers import (
    PER_RANK,
    TOL,
    batch,
    detached_copy,
    mlp,
    mlp_params,
    params_corpus,
    shard,
    tree_allclose,
)


def corpus_loss(params: Any, x: torch.Tensor) -> torch.Tensor:
    leaves = [t for t in optree.tree_leaves(params) if t is not None]
    terms = [(t.double() * x[: t.numel()].reshape(t.shape)).sin().sum() for t in leaves]
    return torch.stack(terms).sum()


def test_the_gradient_over_the_tree_corpus_is_torch_func_grads() -> None:
    # torch.func.grad refuses None leaves, and so does fdp.grad (tested below).
    corpus = {k: v for k, v in params_corpus().items() if k != "none_leaves"}
    params, x = detached_copy(corpus), torch.linspace(-1, 1, 64, dtype=torch.float64)
    got = fdp.grad(corpus_loss)(params, x)
    tree_allclose(got, torch.func.grad(corpus_loss)(params, x), rtol=0, atol=0)
    for t in optree.tree_leaves(got):
        assert not t.requires_grad


def test_it_is_pure_argnums_aux_and_unused_leaves_as_torch_func() -> None:
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(3, 2, generator=g).requires_grad_(), torch.randn(2, generator=g)
    unused = torch.randn(4, generator=g).requires_grad_()
    x = torch.randn(5, 3, generator=g)

    def f(p: dict[str, torch.Tensor], bias: torch.Tensor, *, x: torch.Tensor) -> Any:
        out = x @ p["w"] + bias
        return out.square().mean(), {"out": out}

    for fn in (fdp.grad_and_value, torch.func.grad_and_value):
        got = fn(f, argnums=(0, 1), has_aux=True)({"w": w, "u": unused}, b, x=x)
        if fn is fdp.grad_and_value:
            mine = got
        else:
            tree_allclose(mine, got, rtol=0, atol=0)
    (grads, _), (loss, aux) = mine
    assert torch.equal(grads["u"], torch.zeros(4))  # unused: zeros, as torch.func.grad
    assert not aux["out"].requires_grad
    assert not loss.requires_grad
    assert w.grad is None  # no .grad touched, nothing connected to the caller's graph
    assert unused.grad is None
    only_aux = fdp.grad(f, has_aux=True)({"w": w, "u": unused}, b, x=x)
    tree_allclose(only_aux, (grads, aux), rtol=0, atol=0)
    constant = fdp.grad(lambda p: torch.tensor(2.0))({"w": w})  # no leaf reaches it
    assert torch.equal(constant["w"], torch.zeros(3, 2))


def inner_loss(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return (torch.tanh(x @ w) ** 2).sum()


@pytest.mark.parametrize("where", ["vmap", "jvp", "grad", "jacrev", "vmap_grad", "itself"])
def test_inside_a_transform_it_is_torch_func_grad(where: str) -> None:
    g = torch.Generator().manual_seed(1)
    w, xs, t = torch.randn(3, 2, generator=g), torch.randn(4, 5, 3, generator=g), torch.ones(3, 2)

    def run(grad: Any) -> Any:
        per = grad(inner_loss)
        if where == "vmap":  # per-example gradients
            return torch.func.vmap(per, in_dims=(None, 0))(w, xs)
        if where == "jvp":
            return torch.func.jvp(lambda v: per(v, xs[0]), (w,), (t,))
        if where == "grad":  # a second derivative through it
            return torch.func.grad(lambda v: per(v, xs[0]).sum())(w)
        if where == "jacrev":
            return torch.func.jacrev(lambda v: per(v, xs[0]))(w)
        if where == "itself":  # a gradient penalty: fdp.grad of fdp.grad gave zeros before
            return grad(lambda v: per(v, xs[0]).square().sum())(w)
        return torch.func.vmap(torch.func.grad(lambda v, x: per(v, x).sum()), (None, 0))(w, xs)

    tree_allclose(run(fdp.grad), run(torch.func.grad), rtol=0, atol=0)


def test_bad_input_is_refused_as_torch_func_refuses() -> None:
    x = torch.ones(3)
    with pytest.raises(RuntimeError, match=r"expected f\(\*args\) to return a scalar tensor"):
        fdp.grad(lambda v: v * 2)(x)
    with pytest.raises(RuntimeError, match=r"has_aux=True.*expected f\(\*args\) to return a tuple"):
        fdp.grad(lambda v: v.sum(), has_aux=True)(x)
    for bad in (
        {"n": torch.tensor([1, 2])},
        {"n": 3},
        {"w": x, "b": None},
    ):  # torch.func.grad's own refusal
        with pytest.raises((RuntimeError, ValueError)) as mine:
            fdp.grad(lambda p: x.sum())(bad)
        with pytest.raises((RuntimeError, ValueError)) as theirs:
            torch.func.grad(lambda p: x.sum())(bad)
        assert (type(mine.value), str(mine.value)) == (type(theirs.value), str(theirs.value))
    with pytest.raises(TypeError, match=r"fdp.grad: `argnums` expected an int .*; got \(\)"):
        fdp.grad(lambda v: v.sum(), argnums=())
    with pytest.raises(TypeError, match=r"fdp.grad: `has_aux` expected a bool; got 1"):
        fdp.grad(lambda v: v.sum(), has_aux=1)  # type: ignore[arg-type]


def test_compiled_it_is_torch_func_grad_in_one_graph() -> None:
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("eager")
    params = mlp_params(0, head_bias=True)
    x, y = batch(8)

    def loss(p: Any) -> torch.Tensor:
        return (mlp(p, x) - y).square().mean()

    compiled = torch.compile(fdp.grad(loss), backend=counter, fullgraph=True)
    tree_allclose(compiled(params), torch.func.grad(loss)(params), **TOL)
    assert counter.frame_count == 1


def test_a_module_through_make_functional_as_torch_func_grad() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.GELU(), torch.nn.Linear(8, 2)
    )
    fn, params = fdp.make_functional(model)
    x = torch.randn(6, 4)

    def loss(p: Any) -> torch.Tensor:
        out: torch.Tensor = fn(p, x).logsumexp(-1).mean()
        return out

    got = fdp.grad(loss)(params)
    tree_allclose(got, torch.func.grad(loss)(params), rtol=0, atol=0)
    assert all(p.grad is None for p in model.parameters())


# --- across ranks: the reduced gradient, as one process on the whole batch ---------------


def test_under_inference_mode_it_differentiates_as_outside_it() -> None:
    # inference_mode records nothing, even under enable_grad: autograd.grad would see a
    # loss that needs no gradient and fdp.grad returned zeros, silently (torch.func.grad
    # too before torch 2.13: the reference is the gradient outside inference_mode)
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(3, 2, generator=g), "b": torch.randn(2, generator=g)}
    x = torch.randn(5, 3, generator=g)

    def f(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return (x @ p["w"] + p["b"]).square().mean()

    expected, value = torch.func.grad_and_value(f)(params)
    with torch.inference_mode():
        got, got_value = fdp.grad_and_value(f)(params)
        made_here = {k: v.clone() for k, v in params.items()}  # inference tensors
        from_inference_tensors = fdp.grad(f)(made_here)
    tree_allclose(got, expected, rtol=0, atol=0)
    torch.testing.assert_close(got_value, value, rtol=0, atol=0)
    tree_allclose(from_inference_tensors, expected, rtol=0, atol=0)
    assert all(made_here[k].is_inference() for k in made_here)  # the caller's, untouched


def _mlp_loss(p: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (mlp(p, x) - y).square().mean()


def _ddp_grads(rank: int, size: int) -> Any:
    params = mlp_params(0, head_bias=True)
    ddp = fdp.DistributedDataParallel(params, bucket_cap_mb=1e-6, first_bucket_cap_mb=1e-6)
    x, y = (shard(t, rank) for t in batch(size * PER_RANK))
    out = []
    for _ in range(2):  # again: nothing stale carries over
        out.append(fdp.grad(lambda p: _mlp_loss(ddp(p), x, y))(params))
    with torch.inference_mode():  # an evaluation loop's (saliency, gradient norms)
        out.append(fdp.grad(lambda p: _mlp_loss(ddp(p), x, y))(params))
    return out


def _different_leaves(rank: int, size: int) -> Any:
    g = torch.Generator().manual_seed(0)
    params = {name: torch.randn(5, generator=g) for name in "abcd"}
    used = {0: "a", 1: "ab", 2: "bc"}[rank]  # d: used by no rank
    ddp = fdp.DistributedDataParallel(params, bucket_cap_mb=1e-6, first_bucket_cap_mb=1e-6)

    def loss(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return sum((p[k] * (rank + 1)).sin().sum() for k in used)  # type: ignore[return-value]

    return fdp.grad(lambda p: loss(ddp(p)))(params), torch.func.grad(lambda p: loss(ddp(p)))(params)


def _with_a_closure_leaf(rank: int, size: int, first: bool) -> Any:
    """fdp.grad's inputs share one bucket with a leaf that is not an input (a closure's)."""
    params = mlp_params(0, head_bias=True)
    w = torch.ones(3, requires_grad=True)

    def tree(p: Any) -> dict[str, Any]:
        return {"w": w, **p} if first else {**p, "w": w}

    ddp = fdp.DistributedDataParallel(tree(params))  # default caps: one bucket
    x, y = (shard(t, rank) for t in batch(size * PER_RANK))

    def loss(p: Any) -> torch.Tensor:
        q = ddp(tree(p))
        extra: torch.Tensor = (q.pop("w") * (rank + 1)).sum()
        return _mlp_loss(q, x, y) + extra

    got, value = fdp.grad_and_value(loss)(params)
    plain = _mlp_loss(params, x, y) + (w.detach() * (rank + 1)).sum()  # no DDP, this shard
    return got, value, plain.detach(), w.grad


def _fsdp_grads(rank: int, size: int) -> Any:
    params = mlp_params(0, head_bias=True)
    fsdp = fdp.FullyShardedDataParallel(params)
    shards = {k: tuple(t.detach() for t in ts) for k, ts in fsdp.shard(params).items()}
    x, y = (shard(t, rank) for t in batch(size * PER_RANK))

    def loss(s: Any) -> torch.Tensor:
        return _mlp_loss(fsdp(s), x, y)

    with torch.inference_mode():
        inferred = fsdp.full(fdp.grad(loss)(shards))
    return fsdp.full(fdp.grad(loss)(shards)), fsdp.full(torch.func.grad(loss)(shards)), inferred


def test_ddp_gives_the_whole_batchs_gradient() -> None:
    expected = torch.func.grad(_mlp_loss)(mlp_params(0, head_bias=True), *batch(2 * PER_RANK))
    for per_rank in ranks.world(2).run(_ddp_grads):
        for got in per_rank:
            tree_allclose(got, expected, **TOL)


def test_ddp_leaves_a_rank_did_not_use_get_the_average_as_torch_func_grad() -> None:
    for mine, theirs in ranks.world(3).run(_different_leaves):
        tree_allclose(mine, theirs, rtol=0, atol=0)


@pytest.mark.parametrize("first", [True, False], ids=["closure_leaf_first", "closure_leaf_last"])
def test_ddp_bucket_shared_with_a_leaf_that_is_not_an_input(first: bool) -> None:
    # The bucket's delivery is decided from its leaves: fdp.grad's inputs are
    # returned, the closure's leaf is not asked for and keeps .grad None.
    expected = torch.func.grad(_mlp_loss)(mlp_params(0, head_bias=True), *batch(2 * PER_RANK))
    for got, value, plain, closure_grad in ranks.world(2).run(_with_a_closure_leaf, first):
        tree_allclose(got, expected, **TOL)
        torch.testing.assert_close(value, plain, rtol=0, atol=0)  # the rank's own loss
        assert closure_grad is None


def test_fully_sharded_gives_the_whole_batchs_gradient() -> None:
    params = mlp_params(0, head_bias=True)
    expected = torch.func.grad(_mlp_loss)(detached_copy(params), *batch(2 * PER_RANK))
    for mine, theirs, inferred in ranks.world(2).run(_fsdp_grads):
        tree_allclose(mine, expected, **TOL)
        tree_allclose(mine, theirs, **TOL)
        tree_allclose(inferred, expected, **TOL)
