"""broadcast_params, all_reduce_grads and DistributedDataParallel on 2-4 gloo ranks.

Every rank runs a module-level ``_body(rank, size, ...)`` in a spawned process
(see tests/ranks.py); the test process computes the reference in one plain
single-process, full-batch computation and compares every rank's results.
"""

from __future__ import annotations

import collections
import contextlib
import os
import time
from collections.abc import Callable
from typing import Any

import optree
import pytest
import torch
import torch.distributed as dist

import fdp
from tests import ranks
from tests.helpers import (
    PER_RANK,
    TINY,
    TOL,
    Pair,
    batch,
    leaves,
    mlp,
    mlp_params,
    params_corpus,
    shard,
    tree_allclose,
)

SMALL: dict[str, Any] = {
    "bucket_cap_mb": 2e-4,
    "first_bucket_cap_mb": 1e-4,
}  # a few leaves per bucket
DEFAULT: dict[str, Any] = {}
CAPS: dict[str, dict[str, Any]] = {"tiny": TINY, "small": SMALL, "default": DEFAULT}


def make_params(seed: int = 0) -> dict[str, Any]:
    """The shared MLP, a float64 leaf and an int buffer (a namedtuple and a None leaf inside)."""
    scale = torch.randn((), generator=torch.Generator().manual_seed(seed + 100))
    return {
        **mlp_params(seed),
        "scale": scale.double().requires_grad_(),
        "steps": torch.tensor(7),
    }


def model(params: dict[str, Any], x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = mlp(params, x) * params["scale"].float() + params["steps"]
    return out


def loss_fn(params: dict[str, Any], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(params, x) - y).square().mean()


def data(size: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    return batch(size * PER_RANK, seed=seed)


def grad_tree(params: Any) -> Any:
    """params' structure, each leaf replaced by its .grad (None where none)."""

    def grad(t: Any) -> Any:
        return t.grad if isinstance(t, torch.Tensor) else None

    return optree.tree_map(grad, params, none_is_leaf=True)


def reference_grads(size: int, *, seed: int = 0) -> Any:
    """Full-batch grads in one process: what the averaged per-rank grads must equal."""
    params = make_params(seed)
    x, y = data(size)
    torch.autograd.backward(loss_fn(params, x, y))
    return grad_tree(params)


def detached(params: Any) -> Any:
    return optree.tree_map(
        lambda t: t.detach() if isinstance(t, torch.Tensor) else t, params, none_is_leaf=True
    )


def float_paths(params: Any) -> list[int]:
    return [
        i
        for i, t in enumerate(leaves(params))
        if isinstance(t, torch.Tensor) and t.is_floating_point()
    ]


# --------------------------------------------------------------------------- bodies


def _setup(
    rank: int, size: int, caps: dict[str, Any], *, detach: bool = False
) -> tuple[Any, fdp.DistributedDataParallel, torch.Tensor, torch.Tensor]:
    params: Any = make_params()
    if detach:
        params = detached(params)
    x, y = (shard(t, rank) for t in data(size))
    return params, fdp.DistributedDataParallel(params, **caps), x, y


def _grads_by_backward(rank: int, size: int, caps: dict[str, Any]) -> Any:
    params, ddp, x, y = _setup(rank, size, caps)
    torch.autograd.backward(loss_fn(ddp(params), x, y))
    return grad_tree(params), ddp.buckets


def _grads_by_backward_inputs(rank: int, size: int, caps: dict[str, Any]) -> Any:
    params, ddp, x, y = _setup(rank, size, caps)
    ws = [layer["w"] for layer in params["layers"]]
    torch.autograd.backward(loss_fn(ddp(params), x, y), inputs=ws)
    return grad_tree(params), ddp.buckets


def _grads_by_autograd_grad(rank: int, size: int, caps: dict[str, Any]) -> Any:
    params, ddp, x, y = _setup(rank, size, caps)
    flat, spec = optree.tree_flatten(params, none_is_leaf=True)
    indices = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
    got = torch.autograd.grad(loss_fn(ddp(params), x, y), [flat[i] for i in indices])
    out: list[Any] = [None] * len(flat)
    for i, g in zip(indices, got, strict=True):
        out[i] = g
    return optree.tree_unflatten(spec, out), ddp.buckets


def _differentiable(params: dict[str, Any]) -> dict[str, Any]:
    """``make_params``' float leaves: torch.func.grad refuses None and integer leaves."""
    return {"layers": params["layers"], "first": params["head"].first, "scale": params["scale"]}


def _whole(d: dict[str, Any], steps: torch.Tensor) -> dict[str, Any]:
    """``make_params``' tree again from :func:`_differentiable`'s and the integer buffer."""
    head = Pair(first=d["first"], second=None)
    return {"layers": d["layers"], "head": head, "scale": d["scale"], "steps": steps}


def _func_grads(rank: int, size: int, caps: dict[str, Any], *, with_value: bool) -> Any:
    params, ddp, x, y = _setup(rank, size, caps, detach=True)
    diff = _differentiable(params)

    def full(d: dict[str, Any]) -> dict[str, Any]:
        return _whole(d, params["steps"])

    def loss(d: dict[str, Any]) -> torch.Tensor:
        return loss_fn(ddp(full(d)), x, y)

    if with_value:
        grads, value = torch.func.grad_and_value(loss)(diff)
        torch.testing.assert_close(value, loss_fn(params, x, y))
    else:
        grads = torch.func.grad(loss)(diff)
    return {**full(grads), "steps": None}, ddp.buckets


def _grads_by_func_grad(rank: int, size: int, caps: dict[str, Any]) -> Any:
    return _func_grads(rank, size, caps, with_value=False)


def _grads_by_grad_and_value(rank: int, size: int, caps: dict[str, Any]) -> Any:
    return _func_grads(rank, size, caps, with_value=True)


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("caps", ["tiny", "small", "default"])
def test_backward_grads_equal_full_batch_reference(size: int, caps: str) -> None:
    results = ranks.world(size).run(_grads_by_backward, CAPS[caps])
    expected = reference_grads(size)
    for grads, buckets in results:
        tree_allclose(grads, expected, **TOL)
        assert buckets == results[0][1]
    n_float = len(float_paths(make_params()))
    n_buckets = len(results[0][1])
    if caps == "tiny":  # a bucket per leaf
        assert n_buckets == n_float
    elif caps == "default":  # one per dtype (float64 'scale', the float32 rest)
        assert n_buckets == 2
    else:  # a few leaves per bucket
        assert 2 < n_buckets < n_float


@pytest.mark.parametrize(
    "body",
    [_grads_by_autograd_grad, _grads_by_func_grad, _grads_by_grad_and_value],
    ids=["autograd_grad", "func_grad", "grad_and_value"],
)
def test_returned_grads_equal_full_batch_reference(body: Callable[..., Any]) -> None:
    results = ranks.world(3).run(body, TINY)
    expected = reference_grads(3)
    for grads, _ in results:
        tree_allclose(grads, expected, **TOL)


def _alternating(rank: int, size: int) -> list[Any]:
    """loss.backward() (its last bucket carries the usage counts), autograd.grad, again."""
    params, ddp, x, y = _setup(rank, size, {})
    flat, spec = optree.tree_flatten(params, none_is_leaf=True)
    indices = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
    out: list[Any] = []
    for step in range(4):
        if step % 2 == 0:
            torch.autograd.backward(loss_fn(ddp(params), x, y))
            out.append(optree.tree_map(lambda g: g.clone(), grad_tree(params)))
            for i in indices:
                flat[i].grad = None  # the bucket's views released: its buffer is reusable
        else:
            got = torch.autograd.grad(loss_fn(ddp(params), x, y), [flat[i] for i in indices])
            leaves_: list[Any] = [None] * len(flat)
            for i, g in zip(indices, got, strict=True):
                leaves_[i] = g.clone()
            out.append(optree.tree_unflatten(spec, leaves_))
    return out


def test_backward_and_returned_gradients_alternate_on_one_ddp() -> None:
    # The last bucket's buffer is longer under loss.backward() (the usage
    # counts' tail) than under autograd.grad: one buffer serves both.
    results = ranks.world(2).run(_alternating)
    expected = reference_grads(2)
    for per_rank in results:
        for grads in per_rank:
            tree_allclose(grads, expected, **TOL)


def test_backward_with_inputs_treats_the_other_leaves_as_unused() -> None:
    # backward(inputs=...) computes grads for the named leaves only; the others
    # are unused on every rank, so their .grad stays None as in local training.
    results = ranks.world(2).run(_grads_by_backward_inputs, SMALL)
    expected = reference_grads(2)
    for grads, _ in results:
        for layer, ref in zip(grads["layers"], expected["layers"], strict=True):
            torch.testing.assert_close(layer["w"], ref["w"], **TOL)
            assert layer["b"] is None
        assert grads["head"].first is None


def _a_rank_without_data_reaches_the_outputs(rank: int, size: int, how: str) -> Any:
    """Rank 0 has no batch in step 0 and takes a zero-weighted loss; then a step with data.

    Each step's loss and gradients. docs/guarantees.md (Known limits): a
    rank whose backward reaches no output of ``ddp(params)`` skips that
    step's all-reduces; scaling a loss that reaches them by zero keeps the
    ranks' collectives paired.
    """
    params, ddp, x, y = _setup(rank, size, SMALL, detach=how == "fdp.grad")
    steps = []
    for step in range(2):
        weight = 0.0 if rank == 0 and step == 0 else 1.0
        if how == "backward":
            loss = weight * loss_fn(ddp(params), x, y)
            torch.autograd.backward(loss)
            got = grad_tree(params)
            for t in leaves(params):
                if isinstance(t, torch.Tensor):
                    t.grad = None
        else:
            grads, loss = fdp.grad_and_value(
                lambda d, w=weight: w * loss_fn(ddp(_whole(d, params["steps"])), x, y)
            )(_differentiable(params))
            got = _whole(grads, params["steps"])
        steps.append((loss.detach(), {k: got[k] for k in ("layers", "head", "scale")}))
    return steps


@pytest.mark.parametrize("how", ["backward", "fdp.grad"])
def test_a_rank_without_data_that_scales_its_loss_by_zero_stays_paired(how: str) -> None:
    # Step 0: the mean over ranks with rank 0's gradient zero; step 1: the
    # whole batch's. A rank that skipped ddp's outputs instead would reduce
    # its step 1 with the other rank's step 0.
    params = make_params()
    x, y = data(2)
    torch.autograd.backward(loss_fn(params, shard(x, 1), shard(y, 1)) / 2)
    only_rank_1 = grad_tree(params)
    for rank, per_rank in enumerate(
        ranks.world(2).run(_a_rank_without_data_reaches_the_outputs, how)
    ):
        own = loss_fn(make_params(), shard(x, rank), shard(y, rank)).detach()
        losses = (own * 0 if rank == 0 else own, own)
        grads = (only_rank_1, reference_grads(2))
        for (loss, got), want, expected in zip(per_rank, losses, grads, strict=True):
            torch.testing.assert_close(loss, want)
            tree_allclose(got, {k: expected[k] for k in ("layers", "head", "scale")}, **TOL)


def test_bucket_order_and_default_first_bucket() -> None:
    (_, buckets), *_ = ranks.world(2).run(_grads_by_backward, DEFAULT)
    # The reverse of the order the leaves were put in the tree (each dict's
    # insertion order, as torch's DDP reverses model.parameters(); optree
    # sorts the keys): float64 'scale' comes first, then the float32
    # leaves, all within the 1 MiB first bucket.
    assert buckets == [
        ("params['scale']",),
        (
            "params['head'].first",
            "params['layers'][1]['b']",
            "params['layers'][1]['w']",
            "params['layers'][0]['b']",
            "params['layers'][0]['w']",
        ),
    ]


def _training(rank: int, size: int, steps: int) -> Any:
    params = make_params(seed=rank)  # deliberately different: broadcast fixes it
    fdp.broadcast_params(params)
    ddp = fdp.DistributedDataParallel(params, **SMALL)
    float_leaves = [t for t in leaves(params) if isinstance(t, torch.Tensor) and t.requires_grad]
    opt = torch.optim.SGD(float_leaves, lr=0.1, momentum=0.9)
    for step in range(steps):
        x, y = (shard(t, rank) for t in data(size, seed=10 + step))
        opt.zero_grad()
        torch.autograd.backward(loss_fn(ddp(params), x, y))
        opt.step()
    return detached(params)


def test_sgd_training_matches_full_batch_training() -> None:
    size, steps = 2, 4
    results = ranks.world(size).run(_training, steps)
    params = make_params(seed=0)
    float_leaves = [t for t in leaves(params) if isinstance(t, torch.Tensor) and t.requires_grad]
    opt = torch.optim.SGD(float_leaves, lr=0.1, momentum=0.9)
    for step in range(steps):
        x, y = data(size, seed=10 + step)
        opt.zero_grad()
        torch.autograd.backward(loss_fn(params, x, y))
        opt.step()
    for result in results:
        tree_allclose(result, detached(params), **TOL)


def _no_sync(rank: int, size: int) -> Any:
    params = make_params()
    ddp = fdp.DistributedDataParallel(params, **SMALL)
    x, y = data(3 * size)
    micro = [(x[i::3], y[i::3]) for i in range(3)]  # three micro-batches per rank
    local = []
    with ddp.no_sync():
        for mx, my in micro[:2]:
            torch.autograd.backward(loss_fn(ddp(params), shard(mx, rank), shard(my, rank)))
            local.append(grad_tree(detached_grads(params)))
    mx, my = micro[2]
    torch.autograd.backward(loss_fn(ddp(params), shard(mx, rank), shard(my, rank)))
    return local, grad_tree(params)


def detached_grads(params: Any) -> Any:
    """A copy of params whose .grad are snapshots."""

    def snap(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        c = t.detach().clone()
        if t.grad is not None:
            c.grad = t.grad.clone()
        return c

    return optree.tree_map(snap, params, none_is_leaf=True)


def test_no_sync_accumulates_locally_then_reduces_the_total() -> None:
    size = 2
    results = ranks.world(size).run(_no_sync)
    x, y = data(3 * size)
    micro = [(x[i::3], y[i::3]) for i in range(3)]

    def local_total(rank: int, upto: int) -> Any:
        params = make_params()
        for mx, my in micro[:upto]:
            torch.autograd.backward(loss_fn(params, shard(mx, rank), shard(my, rank)))
        return grad_tree(params)

    totals = [local_total(r, 3) for r in range(size)]
    average = optree.tree_map(
        lambda *gs: None if gs[0] is None else sum(gs) / size, *totals, none_is_leaf=True
    )
    for rank, (local, synced) in enumerate(results):
        # Inside no_sync: purely local accumulation, nothing reduced.
        tree_allclose(local[1], local_total(rank, 2))
        tree_allclose(synced, average, **TOL)


def _mixed_params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    # w first: the last bucket (buckets follow the insertion order backwards);
    # a and b: one run of the first bucket, which launches before backward ends.
    shapes = {"w": (64,), "a": (16,), "b": (16,)}
    return {k: torch.randn(*s, generator=g).requires_grad_() for k, s in shapes.items()}


def _mixed_losses(params: Any, x: torch.Tensor, accumulated: str) -> list[torch.Tensor]:
    w = params["w"].sum()
    return [
        (params[accumulated] * x).sum() * w,
        ((params["a"] * x).sum() ** 2 + (params["b"] * x * 2).sum() ** 2) * w,
    ]


def _snapshot_hook(group: Any, bucket: fdp.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Reads the bucket when it launches: a slot packed later would be missed."""
    averaged = bucket.buffer() / dist.get_world_size(group)
    dist.all_reduce(averaged, group=group)
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(averaged)
    return done


def _mixed_run(rank: int, size: int, accumulated: str) -> Any:
    """One alias run: one leaf carries a ``.grad`` from ``no_sync``, the other none."""
    params = _mixed_params()
    ddp = fdp.DistributedDataParallel(params, comm_hook=_snapshot_hook, **SMALL)
    buckets = [list(b.indices) for b in ddp._layout.buckets]
    x = torch.arange(1.0, 17.0) * (rank + 1)
    with ddp.no_sync():
        torch.autograd.backward(_mixed_losses(ddp(params), x, accumulated)[0])
    torch.autograd.backward(_mixed_losses(ddp(params), x, accumulated)[1])
    return buckets, {k: v.grad for k, v in params.items()}


@pytest.mark.parametrize("accumulated", ["a", "b"])
def test_a_run_with_one_leaf_accumulated_under_no_sync(accumulated: str) -> None:
    """Each leaf of the run is packed before its bucket launches, whichever comes first."""
    size = 2
    results = ranks.world(size).run(_mixed_run, accumulated)
    totals: list[dict[str, torch.Tensor]] = []
    for rank in range(size):
        params = _mixed_params()
        x = torch.arange(1.0, 17.0) * (rank + 1)
        for loss in _mixed_losses(params, x, accumulated):
            torch.autograd.backward(loss)
        totals.append(grad_tree(params))
    average = {k: (totals[0][k] + totals[1][k]) / size for k in totals[0]}
    for buckets, grads in results:
        assert buckets == [[1, 0], [2]]  # [b, a] launches first (optree sorts the keys)
        tree_allclose(grads, average, **TOL)


def _grads_by_backward_of(
    ddp: fdp.DistributedDataParallel, params: dict[str, torch.Tensor], loss: Any
) -> dict[str, torch.Tensor | None]:
    for t in params.values():
        t.grad = None
    torch.autograd.backward(loss(ddp(params)))
    return {k: t.grad for k, t in params.items()}


def _grads_by_func_grad_of(
    ddp: fdp.DistributedDataParallel, params: dict[str, torch.Tensor], loss: Any
) -> dict[str, torch.Tensor]:
    grads: dict[str, torch.Tensor] = torch.func.grad(lambda p: loss(ddp(p)))(detached(params))
    return grads


def _different_leaves(rank: int, size: int, grads_of: Any, dtype: torch.dtype) -> Any:
    g = torch.Generator().manual_seed(0)
    params = {name: torch.randn(5, generator=g).to(dtype).requires_grad_() for name in "abcd"}
    used = {0: "a", 1: "ab", 2: "bc"}[rank]  # d: used by no rank
    ddp = fdp.DistributedDataParallel(params, bucket_cap_mb=1e-6, first_bucket_cap_mb=1e-6)
    results: list[Any] = []
    issued: list[int] = []  # all-reduces per step
    plain, fast = dist.all_reduce, fdp._compat.all_reduce_sum

    def counted(*args: Any, **kwargs: Any) -> Any:
        issued[-1] += 1
        return plain(*args, **kwargs)

    def counted_sum(t: torch.Tensor, group: Any) -> Any:  # the buckets' launches
        return counted(t, group=group, async_op=True)

    for step in range(3):  # repeated: nothing stale carries over

        def loss(p: dict[str, torch.Tensor], step: int = step) -> torch.Tensor:
            return sum((p[k] * (rank + step + 1)).sin().sum() for k in used)  # type: ignore[return-value]

        issued.append(0)
        dist.all_reduce, fdp._compat.all_reduce_sum = counted, counted_sum
        try:
            results.append(grads_of(ddp, params, loss))
        finally:
            dist.all_reduce, fdp._compat.all_reduce_sum = plain, fast
    return results, issued


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize(
    "grads_of", [_grads_by_backward_of, _grads_by_func_grad_of], ids=["backward", "func_grad"]
)
def test_ranks_using_different_leaves(grads_of: Any, dtype: torch.dtype) -> None:
    size = 3
    results = ranks.world(size).run(_different_leaves, grads_of, dtype)
    g = torch.Generator().manual_seed(0)
    params = {name: torch.randn(5, generator=g).to(dtype).double() for name in "abcd"}
    used = {0: "a", 1: "ab", 2: "bc"}
    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {}
    for step in range(3):
        average = {}
        for k, p in params.items():
            local = [
                torch.cos(p * (r + step + 1)) * (r + step + 1) if k in used[r] else torch.zeros(5)
                for r in range(size)
            ]
            average[k] = (torch.stack(local).sum(0) / size).to(dtype)
        for per_step, _ in results:
            got = per_step[step]
            for k in "abc":  # the average on every rank, also where this rank used no leaf
                torch.testing.assert_close(got[k], average[k], **tol)  # type: ignore[arg-type]
            if grads_of is _grads_by_backward_of:  # used by no rank: None, as locally
                assert got["d"] is None
            else:  # torch.func.grad's zeros: the average of nothing used
                torch.testing.assert_close(got["d"], torch.zeros(5, dtype=dtype))
    # One all-reduce per bucket (a leaf each); the usage counts, which only
    # loss.backward() needs, ride the last bucket where it sums them exactly.
    alone = grads_of is _grads_by_backward_of and dtype == torch.bfloat16
    for _, issued in results:
        assert issued == [4 + alone] * 3


def _tied(rank: int, size: int) -> Any:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 4, generator=g).requires_grad_()
    params = {"embed": w, "unembed": w, "b": torch.zeros(4, requires_grad=True)}
    ddp = fdp.DistributedDataParallel(params, **TINY)
    x = torch.randn(size * PER_RANK, 4, generator=g)
    p = ddp(params)
    torch.autograd.backward((shard(x, rank) @ p["embed"] @ p["unembed"].T + p["b"]).square().mean())
    return w.grad, params["b"].grad


def test_tied_weights_get_the_full_gradient() -> None:
    results = ranks.world(2).run(_tied)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 4, generator=g).requires_grad_()
    b = torch.zeros(4, requires_grad=True)
    x = torch.randn(2 * PER_RANK, 4, generator=g)
    torch.autograd.backward((x @ w @ w.T + b).square().mean())
    for w_grad, b_grad in results:
        torch.testing.assert_close(w_grad, w.grad)
        torch.testing.assert_close(b_grad, b.grad)


def _hooks(rank: int, size: int, name: str) -> Any:
    params = make_params()
    calls: list[int] = []

    def counting(group: Any, bucket: fdp.GradBucket) -> torch.futures.Future[torch.Tensor]:
        calls.append(bucket.buffer().numel())
        return fdp.allreduce_hook(group, bucket)

    def out_of_place(group: Any, bucket: fdp.GradBucket) -> torch.futures.Future[torch.Tensor]:
        averaged = bucket.buffer() / dist.get_world_size(group)  # a new tensor, not the bucket
        work = dist.all_reduce(averaged, group=group, async_op=True)
        assert work is not None
        return work.get_future().then(lambda fut: fut.value()[0])  # type: ignore[no-any-return]

    hook: dict[str, fdp.CommHook] = {
        "fp16": fdp.fp16_compress_hook,
        "bf16": fdp.bf16_compress_hook,
        "user": counting,
        "out_of_place": out_of_place,
    }
    ddp = fdp.DistributedDataParallel(params, comm_hook=hook[name], **SMALL)
    x, y = (shard(t, rank) for t in data(size))
    torch.autograd.backward(loss_fn(ddp(params), x, y))
    return grad_tree(params), len(ddp.buckets), calls


@pytest.mark.parametrize(
    ("name", "tol"),
    [("fp16", 2e-3), ("bf16", 2e-2), ("user", 0.0), ("out_of_place", 0.0)],
    ids=["fp16", "bf16", "user", "out_of_place"],
)
def test_comm_hooks(name: str, tol: float) -> None:
    results = ranks.world(2).run(_hooks, name)
    expected = reference_grads(2)
    for grads, n_buckets, calls in results:
        tolerances = {"rtol": tol, "atol": tol} if tol else {}
        tree_allclose(grads, expected, **(tolerances or TOL))
        # Full precision comes back whatever the wire carried.
        assert grads["layers"][0]["w"].dtype == torch.float32
        assert grads["scale"].dtype == torch.float64
        if name == "user":
            assert len(calls) == n_buckets


# --------------------------------------------------------------------------- collectives


def _broadcast(rank: int, size: int, src: int) -> tuple[Any, list[bool]]:
    trees = params_corpus(seed=rank)  # every rank starts from different values
    before = [t._version for t in leaves(trees) if t is not None]
    out = fdp.broadcast_params(trees, src=src)
    assert out is trees
    after = [t._version for t in leaves(trees) if t is not None]
    return detached(trees), [a != b for a, b in zip(after, before, strict=True)]


@pytest.mark.parametrize(("size", "src"), [(3, 0), (3, 1), (1, 0)])
def test_broadcast_params_gives_every_rank_the_source_values(size: int, src: int) -> None:
    results = ranks.world(size).run(_broadcast, src)
    expected = detached(params_corpus(seed=src))
    for result, written in results:
        tree_allclose(result, expected, rtol=0, atol=0)
        # Every rank's leaves count as written, rank src's too (its values are
        # not copied back): autograd's in-place checks agree across ranks.
        assert written == [True] * len(written), written


def _all_reduce(rank: int, size: int, cap: float, average: bool) -> Any:
    def rank_values(t: Any) -> Any:
        return None if t is None else (t.detach() * (rank + 1) + rank).to(t.dtype)

    corpus: Any = params_corpus()
    grads: Any = optree.tree_map(rank_values, corpus, none_is_leaf=True)
    before = optree.tree_map(lambda t: None if t is None else t.clone(), grads, none_is_leaf=True)
    out = fdp.all_reduce_grads(grads, bucket_cap_mb=cap, average=average)
    tree_allclose(grads, before, rtol=0, atol=0)  # inputs untouched
    bases = {t._base.data_ptr() for t in leaves(out) if t is not None and t._base is not None}
    return out, len(bases)


@pytest.mark.parametrize("cap", [1e-6, 25.0])
@pytest.mark.parametrize("average", [True, False])
def test_all_reduce_grads_equals_the_mean_over_ranks(cap: float, average: bool) -> None:
    size = 3 if average else 2  # 3: a division by the world size that is not exact
    results = ranks.world(size).run(_all_reduce, cap, average)
    corpus: Any = params_corpus()

    def expect(t: Any) -> Any:
        if t is None:
            return None
        per_rank = [(t.detach() * (r + 1) + r).to(t.dtype).double() for r in range(size)]
        total = sum(per_rank)
        return (total / size if average else total).to(t.dtype)

    expected = optree.tree_map(expect, corpus, none_is_leaf=True)
    for out, n_bases in results:
        tree_allclose(out, expected, rtol=2e-3, atol=2e-3)  # float16 leaves included
        n_leaves = sum(1 for t in leaves(corpus) if t is not None)
        # A tiny cap: one buffer per leaf. 25 MiB: one per dtype (f32, f64, f16).
        assert n_bases == (n_leaves if cap < 1 else 3)


# --------------------------------------------------------------------------- errors


def _mismatch(rank: int, size: int, what: str) -> str:
    params = make_params()
    if rank == 1 and what == "shape":
        params["layers"][1]["w"] = torch.randn(8, 9, requires_grad=True)
    if rank == 1 and what == "structure":
        params["layers"].append({"w": torch.randn(8, 8), "b": torch.randn(8)})
    if rank == 2 and what == "dtype":
        params["scale"] = params["scale"].detach().float()
    call = fdp.broadcast_params if what == "dtype" else fdp.DistributedDataParallel
    with pytest.raises(ValueError, match="differs across ranks") as info:
        call(params)
    return str(info.value)


@pytest.mark.parametrize(
    ("what", "path"),
    [
        ("shape", "params['layers'][1]['w']"),
        ("structure", "params['layers'][2]['b']"),
        ("dtype", "tree['scale']"),
    ],
)
def test_mismatched_trees_raise_on_every_rank(what: str, path: str) -> None:
    messages = ranks.world(3).run(_mismatch, what)
    assert len(set(messages)) == 1, messages  # the same error everywhere
    assert path in messages[0]
    if what == "shape":
        assert "(8, 8)" in messages[0]
        assert "(8, 9)" in messages[0]


def _call_errors(rank: int, size: int) -> list[str]:
    params = make_params()
    ddp = fdp.DistributedDataParallel(params)
    messages = []
    wrong_shape = {**params, "scale": torch.zeros(2, dtype=torch.float64)}
    wrong_tree = {**params, "extra": torch.zeros(1)}
    non_leaf = {**params, "head": Pair(params["head"].first * 2, None)}
    for bad in (wrong_shape, wrong_tree, non_leaf):
        with pytest.raises(
            ValueError, match=r"^fdp.DistributedDataParallel.__call__: `params`"
        ) as info:
            ddp(bad)
        messages.append(str(info.value))
    with pytest.raises(TypeError, match=r"`grads` leaf grads\['x'\]"):
        fdp.all_reduce_grads({"x": "not a tensor"})
    with pytest.raises(TypeError, match="floating-point"):
        fdp.all_reduce_grads({"x": torch.ones(2, dtype=torch.int64)})
    return messages


def test_call_errors_name_the_leaf() -> None:
    messages = ranks.world(2).run(_call_errors)[0]
    assert "params['scale']" in messages[0]
    assert "shape ()" in messages[0]
    assert (
        "expected the structure of the tree this DistributedDataParallel was planned" in messages[1]
    )
    assert "params['head'].first" in messages[2]
    assert "MulBackward0" in messages[2]


def test_errors_before_any_collective() -> None:
    with pytest.raises(RuntimeError, match=r"not initialized; call fdp.init_distributed\(\) first"):
        fdp.all_reduce_grads({"x": torch.ones(1)})
    with pytest.raises(ValueError, match="`bucket_cap_mb`"):
        fdp.DistributedDataParallel({"x": torch.ones(1)}, bucket_cap_mb=0)
    with pytest.raises(TypeError, match="`comm_hook`"):
        fdp.DistributedDataParallel({"x": torch.ones(1)}, comm_hook="fp16")  # type: ignore[arg-type]
    assert not dist.is_initialized()


# --------------------------------------------------------------------------- failures


def _dies(rank: int, size: int) -> Any:
    params = make_params()
    ddp = fdp.DistributedDataParallel(params, **TINY)
    x, y = (shard(t, rank) for t in data(size))
    loss = loss_fn(ddp(params), x, y)
    if rank == 1:
        os._exit(3)  # dies mid-step, before its share of the all-reduce
    start = time.monotonic()
    try:
        torch.autograd.backward(loss)
    except Exception as e:
        return type(e).__name__, str(e)[:300], time.monotonic() - start
    return None, "backward returned", time.monotonic() - start


def test_a_killed_rank_makes_the_others_raise() -> None:
    pg_timeout = 10.0
    world = ranks.World(2, pg_timeout_s=pg_timeout)
    try:
        (result,) = world.run(_dies, ranks=[0], timeout_s=4 * pg_timeout)
    finally:
        world.close()
    error, message, elapsed = result
    assert error is not None, message
    assert elapsed < 2 * pg_timeout, (error, message, elapsed)
    assert world.procs[1].exitcode == 3


def _kept_results(rank: int, size: int) -> Any:
    first = fdp.all_reduce_grads([torch.full((4,), float(rank))])
    second = fdp.all_reduce_grads([torch.full((4,), float(rank + 10))])
    params = make_params()
    ddp = fdp.DistributedDataParallel(params)
    kept = []
    for step in range(2):
        x, y = (shard(t, rank) for t in data(size, seed=step))
        torch.autograd.backward(loss_fn(ddp(params), x, y))
        kept.append((grad_tree(params), optree.tree_map(torch.clone, grad_tree(params))))
        for t in leaves(params):
            if isinstance(t, torch.Tensor):
                t.grad = None
    return first, second, kept


def test_results_kept_by_the_caller_are_never_overwritten() -> None:
    # fdp reuses its flat buffers across calls, but only once nothing else
    # holds a view of them.
    (first, second, kept), *_ = ranks.world(2).run(_kept_results)
    torch.testing.assert_close(first[0], torch.full((4,), 0.5))
    torch.testing.assert_close(second[0], torch.full((4,), 10.5))
    for held, snapshot in kept:
        tree_allclose(held, snapshot, rtol=0, atol=0)


def replicated_model(tree: dict[str, Any], x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = mlp(tree["net"], x) * tree["scale"]
    return out


def replicated_tree(rank: int) -> dict[str, Any]:
    """The shared MLP and a buffer whose value differs by rank (rank 0's is 1)."""
    return {"net": mlp_params(), "scale": torch.full((3,), 1.0 + rank)}


def rank_devices(rank: int, kind: str) -> list[str]:
    """Two replicas per rank: CPU ones, or two GPUs of the machine's (shared when few)."""
    if kind == "cpu":
        return ["cpu", "cpu"]
    n = torch.cuda.device_count()
    return [f"cuda:{(2 * rank) % n}", f"cuda:{(2 * rank + 1) % n}"]


def _several_devices_per_rank(rank: int, size: int, kind: str) -> tuple[list[Any], torch.Tensor]:
    """Two micro-batches under no_sync, then a synchronised one; 2 replicas per rank."""
    devices = rank_devices(rank, kind)
    tree = optree.tree_map(
        lambda t: t.detach().to(devices[0]).requires_grad_(t.requires_grad),
        replicated_tree(rank),  # type: ignore[arg-type]
    )
    ddp = fdp.DistributedDataParallel(tree)
    for step in range(3):
        x, y = batch(size * PER_RANK, seed=step)
        x, y = shard(x, rank).to(devices[0]), shard(y, rank).to(devices[0])
        with ddp.no_sync() if step < 2 else contextlib.nullcontext():
            out = fdp.data_parallel(replicated_model, ddp(tree), x, devices=devices)
            torch.autograd.backward(torch.nn.functional.mse_loss(out, y))
    leaves = [t.grad.cpu() for t in optree.tree_leaves(tree["net"]) if t is not None]
    return leaves, out.detach().cpu()


@pytest.mark.parametrize(
    "kind",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.cuda,
                pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
            ],
        ),
    ],
)
def test_data_parallel_inside_each_rank_matches_the_full_batch_reference(kind: str) -> None:
    # What torch's DDP did with several device_ids: replicas within a rank,
    # all-reduce across ranks. Buffers come from rank 0 (broadcast_buffers).
    size = 2
    ref = replicated_tree(0)
    for step in range(3):
        x, y = batch(size * PER_RANK, seed=step)
        for r in range(size):
            out = replicated_model(ref, shard(x, r))
            torch.autograd.backward(torch.nn.functional.mse_loss(out, shard(y, r)) / size)
    expected = [t.grad for t in optree.tree_leaves(ref["net"]) if t is not None]
    tol = TOL if kind == "cpu" else {"rtol": 1e-4, "atol": 1e-5}
    for r, (got, out) in enumerate(ranks.world(size).run(_several_devices_per_rank, kind)):
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g, e, **tol)
        torch.testing.assert_close(out, replicated_model(ref, shard(x, r)), **tol)


def _custom_node_compiled(rank: int, size: int) -> str:
    params = {"w": collections.deque([torch.ones(2, requires_grad=True)])}
    ddp = fdp.DistributedDataParallel(params)
    compiled = torch.compile(lambda p: ddp(p)["w"][0].sum(), backend="eager", fullgraph=True)
    with pytest.raises(Exception, match=r"inside torch.compile the tree") as info:
        compiled(params)
    torch.autograd.backward(ddp(params)["w"][0].sum() * (rank + 1))  # eagerly: reduced
    torch.testing.assert_close(params["w"][0].grad, torch.full((2,), (1 + size) / 2))
    return str(info.value)


def test_a_node_compiled_code_cannot_flatten_is_refused_inside_compile_only() -> None:
    for message in ranks.world(2).run(_custom_node_compiled):
        assert "the tree this DistributedDataParallel was planned for must be built" in message


def _three_layers() -> torch.nn.Module:
    """Layers whose names sort in another order than they run (optree sorts dict keys)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        collections.OrderedDict(
            [("z_in", torch.nn.Linear(6, 8)), ("a_mid", torch.nn.Linear(8, 8)),
             ("m_out", torch.nn.Linear(8, 3))]
        )
    )  # fmt: skip


def _module_buckets(rank: int, size: int) -> tuple[list[tuple[str, ...]], list[str], Any]:
    net = _three_layers()
    fn, state = fdp.make_functional(net)
    ddp = fdp.DistributedDataParallel(state, bucket_cap_mb=200 / 2**20, first_bucket_cap_mb=1e-6)
    x, y = batch(size * PER_RANK)
    out = fn(ddp(state), shard(x, rank))
    torch.autograd.backward(torch.nn.functional.mse_loss(out, shard(y, rank)))
    names = [n for n, _ in net.named_parameters()]
    # A rank whose dict has the same keys in another order: refused, on every rank.
    swapped = dict(reversed(state.items())) if rank == 1 else dict(state)
    with pytest.raises(ValueError, match="differs across ranks") as info:
        fdp.DistributedDataParallel(swapped)
    return ddp.buckets, names, ([p.grad for p in net.parameters()], str(info.value))


def test_buckets_follow_the_modules_parameter_order_backwards() -> None:
    """As torch's DDP buckets ``reversed(model.parameters())``: the gradients of a
    bucket arrive together, so the first bucket launches early in backward."""
    net = _three_layers()
    x, y = batch(2 * PER_RANK)
    for r in range(2):
        torch.autograd.backward(torch.nn.functional.mse_loss(net(shard(x, r)), shard(y, r)) / 2)
    for buckets, names, (grads, error) in ranks.world(2).run(_module_buckets):
        flat = [p.removeprefix("params['").removesuffix("']") for b in buckets for p in b]
        assert flat == list(reversed(names))
        assert len(buckets) > 2  # small caps: several buckets, in that order
        for g, p in zip(grads, net.parameters(), strict=True):
            torch.testing.assert_close(g, p.grad, **TOL)
        assert "`params` differs across ranks" in error
        assert "the order of its dicts' keys" in error
