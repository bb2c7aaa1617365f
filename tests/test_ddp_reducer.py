"""DistributedDataParallel's reduction in the situations real models bring.

Activation checkpointing, gradient penalties, complex and channels_last
parameters, undefined and sparse gradients, hooks that misbehave. Every body
runs on spawned gloo ranks (tests/ranks.py) and is compared with one plain
single-process computation on the full batch, or asserts the same clear error
on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.checkpoint import checkpoint

import fdp
from tests import ranks
from tests.helpers import PER_RANK, TINY, TOL, batch, shard


def grads(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
    return {k: v.grad for k, v in params.items()}


# Bucket caps for the chain's three 6x6 float32 leaves (144 bytes each). One
# node aliases a run of a bucket's leaves (fdp/_ddp/_reducer.py), so a bucket
# of several leaves meets what one of one leaf never does: a node run for
# some of its leaves only (a nested backward, backward(inputs=...), an
# undefined gradient) and hooks on outputs the backward did not reach.
CAPS: dict[str, dict[str, Any]] = {
    "a bucket per leaf": TINY,
    "w2 and w1 in one bucket": {"bucket_cap_mb": 288 / 2**20, "first_bucket_cap_mb": 288 / 2**20},
}


# --------------------------------------------------------------- checkpointing


def chain_params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {k: (torch.randn(6, 6, generator=g) / 3).requires_grad_() for k in ("w0", "w1", "w2")}


def chain(p: dict[str, torch.Tensor], x: torch.Tensor, where: str, reentrant: bool) -> torch.Tensor:
    def block(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.tanh(h @ w)

    def ckpt(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # The block closes over its parameter, as a module's forward does: with
        # reentrant checkpointing its gradient comes from a nested backward.
        out: torch.Tensor = checkpoint(lambda h: block(h, w), h, use_reentrant=reentrant)
        return out

    h = (
        x.requires_grad_() if reentrant else x
    )  # reentrant checkpoints need an input that requires grad
    # "last": the checkpointed block's backward (a nested one) comes first.
    # "middle": hooks fire in the outer backward, then the nested one, then the outer again.
    layers = {"last": (block, block, ckpt), "middle": (block, ckpt, block)}[where]
    for layer, name in zip(layers, ("w0", "w1", "w2"), strict=True):
        h = layer(h, p[name])
    return h.square().mean()


def data(size: int) -> torch.Tensor:
    return batch(size * PER_RANK)[0]


def _checkpointed(rank: int, size: int, where: str, reentrant: bool, caps: str) -> Any:
    params = chain_params()
    ddp = fdp.DistributedDataParallel(params, **CAPS[caps])
    for _ in range(2):  # two steps: nothing stale carries over
        for p in params.values():
            p.grad = None
        torch.autograd.backward(chain(ddp(params), shard(data(size), rank), where, reentrant))
    return grads(params)


@pytest.mark.parametrize("caps", list(CAPS))
@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("where", ["last", "middle"])
def test_activation_checkpointing(where: str, reentrant: bool, caps: str) -> None:
    size = 2
    results = ranks.world(size).run(_checkpointed, where, reentrant, caps)
    params = chain_params()
    x = data(size)
    # The reference: the mean over ranks of each rank's loss, on one process.
    losses = [chain(params, shard(x, r), where, reentrant=False) for r in range(size)]
    torch.autograd.backward(torch.stack(losses).mean())
    for got in results:
        for name, p in params.items():
            torch.testing.assert_close(got[name], p.grad, **TOL, msg=name)
            # Bitwise the same on every rank: parameters never drift apart.
            assert torch.equal(got[name], results[0][name])


def twice(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``w`` in two reentrant checkpoints: one gradient from each nested backward."""

    def layer(h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(h @ p["w"])

    h = x @ p["v"]
    for _ in range(2):
        h = checkpoint(layer, h, use_reentrant=True)
    return (h @ p["u"]).square().mean()


def twice_params() -> dict[str, torch.Tensor]:
    w = chain_params()
    return {"v": w["w0"], "w": w["w1"], "u": w["w2"][:, :2].detach().requires_grad_()}


def _twice_after_no_sync(rank: int, size: int, caps: str) -> Any:
    params = twice_params()
    ddp = fdp.DistributedDataParallel(params, **({} if caps == "one bucket" else TINY))
    x = shard(data(size), rank)
    with ddp.no_sync():
        torch.autograd.backward(twice(ddp(params), x[:2]))
    torch.autograd.backward(twice(ddp(params), x[2:]))
    return grads(params)


@pytest.mark.parametrize("caps", ["a bucket per leaf", "one bucket"])
def test_a_second_gradient_in_one_backward_after_no_sync(caps: str) -> None:
    """Folded into its bucket before the launch (one bucket), reduced late after (per leaf)."""
    results = ranks.world(2).run(_twice_after_no_sync, caps)
    params = twice_params()
    x = data(2)
    for r in range(2):  # the mean over ranks of the sum over each rank's two backwards
        part = shard(x, r)
        torch.autograd.backward((twice(params, part[:2]) + twice(params, part[2:])) / 2)
    for got in results:
        for name, p in params.items():
            torch.testing.assert_close(got[name], p.grad, **TOL, msg=name)


def _grad_in_bucket_during_backward(rank: int, size: int) -> Any:
    params = chain_params()
    ddp = fdp.DistributedDataParallel(params)  # one bucket
    seen: list[int] = []

    # After w0's gradient is accumulated, w1's and w2's (packed earlier) must
    # already be in the same buffer: no local gradient is held until the end.
    def look(_: torch.Tensor) -> None:
        grads_now = [q.grad for q in params.values() if q.grad is not None]
        seen.extend(g.untyped_storage().data_ptr() for g in grads_now)

    params["w0"].register_post_accumulate_grad_hook(look)  # type: ignore[no-untyped-call]
    torch.autograd.backward(chain(ddp(params), shard(data(size), rank), "last", reentrant=False))
    return seen, grads(params)


def test_grads_live_in_their_bucket_as_soon_as_packed() -> None:
    results = ranks.world(2).run(_grad_in_bucket_during_backward)
    params = chain_params()
    x = data(2)
    losses = [chain(params, shard(x, r), "last", reentrant=False) for r in range(2)]
    torch.autograd.backward(torch.stack(losses).mean())
    for seen, got in results:
        assert len(seen) == 3, seen
        assert len(set(seen)) == 1, seen
        for name, p in params.items():
            torch.testing.assert_close(got[name], p.grad, **TOL, msg=name)


# --------------------------------------------------------------- create_graph


def _gradient_penalty(rank: int, size: int, caps: str) -> tuple[Any, Any, str]:
    params = chain_params()
    ddp = fdp.DistributedDataParallel(params, **CAPS[caps])
    loss = chain(ddp(params), shard(data(size), rank), "last", reentrant=False)
    torch.autograd.backward(loss, create_graph=True)
    reduced = {k: v.grad for k, v in params.items()}
    assert all(g is not None for g in reduced.values())
    assert all(g.requires_grad for g in reduced.values() if g is not None)
    penalty = torch.stack([(g**2).sum() for g in reduced.values() if g is not None]).sum()
    for p in params.values():
        p.grad = None
    torch.autograd.backward(penalty)  # through the reduction's graph, and ddp's aliases again
    first = {k: v.detach() for k, v in reduced.items() if v is not None}
    # autograd.grad's gradients are returned before any reduction could give
    # them a graph: refused on every rank, and the next step works.
    loss = chain(ddp(params), shard(data(size), rank), "last", reentrant=False)
    with pytest.raises(RuntimeError, match="create_graph=True") as info:
        torch.autograd.grad(loss, list(params.values()), create_graph=True)
    return first, grads(params), str(info.value).split(" reached ")[0]


@pytest.mark.parametrize("caps", list(CAPS))
def test_a_gradient_penalty_through_backward_create_graph(caps: str) -> None:
    # torch's test_ddp_create_graph runs create_graph=True: the reduced .grad
    # carries the psum's graph, so a penalty on it differentiates the global
    # batch's gradient (before: refused).
    size = 2
    params = chain_params()
    x = data(size)
    loss = torch.stack([chain(params, shard(x, r), "last", reentrant=False) for r in range(size)])
    g = torch.autograd.grad(loss.mean(), list(params.values()), create_graph=True)
    penalty = torch.stack([(t**2).sum() for t in g]).sum()
    penalty_grads = torch.autograd.grad(penalty, list(params.values()))
    for first, second, message in ranks.world(size).run(_gradient_penalty, caps):
        for name, expected in zip(params, g, strict=True):
            torch.testing.assert_close(first[name], expected.detach(), **TOL, msg=name)
        for name, expected in zip(params, penalty_grads, strict=True):
            torch.testing.assert_close(second[name], expected, **TOL, msg=name)
        assert message == "fdp.DistributedDataParallel: torch.autograd.grad(..., create_graph=True)"


# --------------------------------------------------------------- complex params


def complex_params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 3, dtype=torch.complex64, generator=g).requires_grad_()
    b = torch.randn(3, generator=g).requires_grad_()
    # "z" comes first in the bucket (reverse leaf order) with an odd numel, so
    # the complex leaf starts at an odd offset and needs padding.
    return {"w": w, "b": b, "z": torch.randn(3, generator=g).requires_grad_()}


def complex_loss(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return ((x.to(torch.complex64) @ p["w"]).abs() + p["b"] * p["z"]).square().mean()


HOOKS: dict[str, Any] = {
    "default": None,
    "allreduce": fdp.allreduce_hook,
    "fp16": fdp.fp16_compress_hook,
    "bf16": fdp.bf16_compress_hook,
}


def _complex(rank: int, size: int, hook: str) -> Any:
    params = complex_params()
    ddp = fdp.DistributedDataParallel(params, comm_hook=HOOKS[hook])
    x = torch.randn(size * PER_RANK, 4, generator=torch.Generator().manual_seed(1))
    torch.autograd.backward(complex_loss(ddp(params), shard(x, rank)))
    return grads(params)


@pytest.mark.parametrize("hook", list(HOOKS))
def test_complex_parameters(hook: str) -> None:
    size = 2
    results = ranks.world(size).run(_complex, hook)
    params = complex_params()
    x = torch.randn(size * PER_RANK, 4, generator=torch.Generator().manual_seed(1))
    torch.autograd.backward(complex_loss(params, x))
    tol = {"bf16": {"rtol": 2e-2, "atol": 2e-2}, "fp16": {"rtol": 2e-3, "atol": 2e-3}}
    for got in results:
        for name, p in params.items():
            assert p.grad is not None
            torch.testing.assert_close(got[name], p.grad, **tol.get(hook, TOL), msg=name)
            assert got[name].dtype == p.dtype


# --------------------------------------------------------------- layouts


def conv_params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 3, 3, 3, generator=g).to(memory_format=torch.channels_last)
    return {"w": w.requires_grad_(), "b": torch.randn(4, generator=g).requires_grad_()}


def conv_loss(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return nn.functional.conv2d(x, p["w"], p["b"]).square().mean()


def conv_data(size: int) -> torch.Tensor:
    return torch.randn(size * PER_RANK, 3, 5, 5, generator=torch.Generator().manual_seed(1))


def _channels_last(rank: int, size: int) -> Any:
    params = conv_params()
    ddp = fdp.DistributedDataParallel(params)
    torch.autograd.backward(conv_loss(ddp(params), shard(conv_data(size), rank)))
    w_grad = params["w"].grad
    assert w_grad is not None
    return grads(params), w_grad.stride()


def test_grads_keep_the_parameters_memory_layout() -> None:
    results = ranks.world(2).run(_channels_last)
    params = conv_params()
    torch.autograd.backward(conv_loss(params, conv_data(2)))
    for got, stride in results:
        assert stride == params["w"].stride()  # channels_last, as torch's DDP keeps it
        for name, p in params.items():
            torch.testing.assert_close(got[name], p.grad, **TOL, msg=name)


# --------------------------------------------------------------- undefined and sparse grads


def _undefined(rank: int, size: int, caps: str) -> Any:
    params = chain_params()
    ddp = fdp.DistributedDataParallel(params, **CAPS[caps])
    p = ddp(params)
    x = shard(data(size), rank)
    # w0's gradient is undefined (never materialised as zeros) on every rank.
    blocked: Any = torch._C._functions.UndefinedGrad()(x @ p["w0"])
    loss = (torch.tanh(x @ p["w1"]) @ p["w2"]).square().mean() + blocked.sum() * 0
    torch.autograd.backward(loss)
    return grads(params)


@pytest.mark.parametrize("caps", list(CAPS))
def test_undefined_gradients(caps: str) -> None:
    results = ranks.world(2).run(_undefined, caps)
    params = chain_params()
    x = data(2)
    for r in range(2):
        xr = shard(x, r)
        blocked: Any = torch._C._functions.UndefinedGrad()(xr @ params["w0"])
        loss = (torch.tanh(xr @ params["w1"]) @ params["w2"]).square().mean() + blocked.sum() * 0
        torch.autograd.backward(loss / 2)
    for got in results:
        assert got["w0"] is None  # as local training leaves it
        for name in ("w1", "w2"):
            torch.testing.assert_close(got[name], params[name].grad, **TOL, msg=name)


def sparse_params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed": torch.randn(10, 3, generator=g).requires_grad_(),
        "w": torch.randn(3, 2, generator=g).requires_grad_(),
    }


def sparse_loss(p: dict[str, torch.Tensor], rank: int, step: int, how: str) -> torch.Tensor:
    """An embedding (sparse gradient) and a dense layer; rank 1 skips the embedding if asked."""
    ids = torch.tensor([rank + step, 2, 7 - rank])
    if how == "one_rank" and rank == 1:
        rows = torch.ones(3, 3)  # this rank never looks anything up
    else:
        rows = nn.functional.embedding(ids, p["embed"], sparse=True)
    return (torch.tanh(rows @ p["w"]) ** 2).mean()


def _sparse(rank: int, size: int, how: str, caps: str = "tiny") -> dict[str, torch.Tensor]:
    params = sparse_params()
    # "one": both leaves in one bucket and one alias node, which packs the run
    # at once only where every gradient is dense (fdp/_ddp/_runs.py).
    ddp = fdp.DistributedDataParallel(params, **(TINY if caps == "tiny" else {}))
    if how == "frozen" and rank == 1:  # this rank stops training the table
        params["embed"].requires_grad_(False)
    if how == "no_sync":  # a local sparse gradient first, folded into the reduction
        with ddp.no_sync():
            torch.autograd.backward(sparse_loss(ddp(params), rank, 1, how))
    if how == "join":  # rank 1 leaves at once: it mirrors the sparse reduction
        with ddp.join():
            if rank == 0:
                torch.autograd.backward(sparse_loss(ddp(params), rank, 0, how))
    else:
        torch.autograd.backward(sparse_loss(ddp(params), rank, 0, how))
    embed = params["embed"].grad
    if how == "join" and rank == 1:  # it left at once: no gradient of its own
        return {}
    if how == "frozen" and rank == 1:  # it took part in the reduction, with nothing
        assert embed is None
        return {"w": params["w"].grad}  # type: ignore[dict-item]
    assert embed is not None
    assert embed.is_sparse  # as torch's DDP gives it
    return {"embed": embed.to_dense(), "w": params["w"].grad}  # type: ignore[dict-item]


def _sparse_reference(how: str, size: int) -> dict[str, torch.Tensor]:
    """One process: the ranks' mean loss (a table frozen on rank 1 is a constant there)."""
    params = sparse_params()
    active = [0] if how == "join" else list(range(size))
    frozen = {**params, "embed": params["embed"].detach()}
    losses = [sparse_loss(frozen if how == "frozen" and r == 1 else params, r, 0, how)
              for r in active]  # fmt: skip
    if how == "no_sync":
        losses += [sparse_loss(params, r, 1, how) for r in range(size)]
    torch.autograd.backward(torch.stack(losses).sum() / size)
    grads = {k: p.grad for k, p in params.items() if p.grad is not None}
    return {k: g.to_dense() if g.is_sparse else g for k, g in grads.items()}


@pytest.mark.parametrize(
    ("how", "caps"),
    [
        ("both_ranks", "tiny"),
        ("one_rank", "tiny"),
        ("no_sync", "tiny"),
        ("join", "tiny"),
        ("frozen", "tiny"),
        ("both_ranks", "one"),
        ("no_sync", "one"),
    ],
)
def test_sparse_gradients_are_reduced(how: str, caps: str) -> None:
    # nn.Embedding(sparse=True): torch's DDP reduces sparse gradients (before: refused).
    # "frozen": the table frozen on rank 1 only. Before, that rank skipped the sparse
    # all-reduce the other made, and both waited for the process group's timeout.
    expected = _sparse_reference(how, 2)
    results = ranks.world(2).run(_sparse, how, caps)
    for got in results[:1] if how == "join" else results:
        assert got.keys() <= expected.keys()
        for name, t in got.items():
            torch.testing.assert_close(t, expected[name], **TOL, msg=name)
    assert len(results[0]) == 2


def _gloo_allreduce_hook(
    state: object, bucket: fdp.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """torch's test_ddp_comm_hook_sparse_gradients hook: the raw collective, then divide."""
    world = dist.group.WORLD
    assert world is not None
    SEEN.append(bucket.buffer().is_sparse)
    fut = world.allreduce([bucket.buffer()]).get_future()
    return fut.then(lambda f: f.wait()[0] / dist.get_world_size())


SEEN: list[bool] = []  # per rank process: which buckets the hook saw sparse


def _sparse_hooked(rank: int, size: int, how: str, hook: str) -> Any:
    params = sparse_params()
    comm_hook = {
        "torch_test": _gloo_allreduce_hook,
        "fdp": fdp.allreduce_hook,
        "torch_default": default_hooks.allreduce_hook,
    }[hook]
    ddp = fdp.DistributedDataParallel(params, comm_hook=comm_hook, **TINY)
    if how == "frozen" and rank == 1:
        params["embed"].requires_grad_(False)
    SEEN.clear()
    if how == "join":  # rank 1 leaves at once: it mirrors the hook on zeros, sparse bucket too
        with ddp.join():
            if rank == 0:
                torch.autograd.backward(sparse_loss(ddp(params), rank, 0, how))
        if rank == 1:
            return {}, list(SEEN)
    else:
        torch.autograd.backward(sparse_loss(ddp(params), rank, 0, how))
    embed = params["embed"].grad
    if how == "frozen" and rank == 1:  # the hook ran on its empty sparse bucket too
        assert embed is None
        return {"w": params["w"].grad}, list(SEEN)
    assert embed is not None
    assert embed.is_sparse
    return {"embed": embed.to_dense(), "w": params["w"].grad}, list(SEEN)


@pytest.mark.parametrize("hook", ["torch_test", "fdp", "torch_default"])
@pytest.mark.parametrize("how", ["both_ranks", "one_rank", "join", "frozen"])
def test_a_comm_hook_reduces_a_sparse_bucket(how: str, hook: str) -> None:
    # torch's test_ddp_comm_hook_sparse_gradients: before, fdp refused any hook but its own,
    # and any hook inside join. "frozen": see test_sparse_gradients_are_reduced.
    expected = _sparse_reference(how, 2)
    results = ranks.world(2).run(_sparse_hooked, how, hook)
    for got, seen in results:
        if hook == "torch_test":
            assert seen == [False, False, True]  # two dense buckets, then the sparse one
        assert got.keys() <= expected.keys()
        for name, t in got.items():
            torch.testing.assert_close(t, expected[name], **TOL, msg=name)
    assert len(results[0][0]) == 2


# --------------------------------------------------------------- hooks


def _bad_hook(rank: int, size: int) -> str:
    params = chain_params()
    bad: Callable[..., Any] = lambda state, bucket: 3  # noqa: E731
    ddp = fdp.DistributedDataParallel(params, comm_hook=bad)
    loss = chain(ddp(params), shard(data(size), rank), "last", reentrant=False)
    with pytest.raises(TypeError) as info:
        torch.autograd.backward(loss)
    return str(info.value)


def test_a_hook_that_returns_no_future_is_named() -> None:
    (message,) = set(ranks.world(2).run(_bad_hook))
    assert message == (
        "fdp.DistributedDataParallel: `comm_hook` expected to return a torch.futures.Future "
        "of the reduced bucket; got int 3"
    )


def _complex_all_reduce(rank: int, size: int) -> Any:
    g = torch.Generator().manual_seed(rank)
    grads = {
        "z": torch.randn(3, 2, dtype=torch.complex64, generator=g),
        "r": torch.randn(4, generator=g),
        "t": torch.randn(4, 3, generator=g).t(),  # not contiguous
    }
    return grads, fdp.all_reduce_grads(grads, bucket_cap_mb=1e-5)


def test_all_reduce_grads_of_complex_and_strided_leaves() -> None:
    results = ranks.world(2).run(_complex_all_reduce)
    for _, reduced in results:
        for name in ("z", "r", "t"):
            expected = (results[0][0][name] + results[1][0][name]) / 2
            torch.testing.assert_close(reduced[name], expected, **TOL, msg=name)
            assert reduced[name].dtype == expected.dtype


# --------------------------------------------------------------- what arms a reduction
# Every backward that passes through the output of a ddp(params) call is
# reduced, once per backward; a backward that does not is local (torch's DDP
# through ``ddp.module``). Each pattern runs on 2 ranks and is compared with
# one process: the local gradient of this rank's shard, or the average.


def _chain_loss(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return chain(p, x, "last", reentrant=False)


def _local_grads(x: torch.Tensor, *, times: int = 1) -> dict[str, torch.Tensor | None]:
    params = chain_params()
    for _ in range(times):
        torch.autograd.backward(_chain_loss(params, x))
    return grads(params)


def _reduced_grads(xs: list[torch.Tensor], size: int) -> dict[str, torch.Tensor | None]:
    """Each backward in ``xs`` averaged over ranks: the mean of the shards' losses."""
    params = chain_params()
    for x in xs:
        losses = [_chain_loss(params, shard(x, r)) for r in range(size)]
        torch.autograd.backward(torch.stack(losses).mean())
    return grads(params)


def _pattern(rank: int, size: int, pattern: str, caps: str = "a bucket per leaf") -> Any:
    params = chain_params()
    ddp = fdp.DistributedDataParallel(params, **CAPS[caps])
    x1, x2 = shard(data(size), rank), shard(batch(size * PER_RANK, seed=7)[0], rank)
    out: dict[str, Any] = {}
    if pattern == "local_after":  # a DDP step, then a local one on rank 0 only
        torch.autograd.backward(_chain_loss(ddp(params), x1))
        out["ddp"] = {k: v.clone() for k, v in grads(params).items()}  # type: ignore[union-attr]
        for p in params.values():
            p.grad = None
        if rank == 0:
            torch.autograd.backward(_chain_loss(params, x2))
            out["local"] = grads(params)
    elif pattern == "local_between":  # ddp(params), a local autograd.grad (rank 0), then DDP
        armed = ddp(params)
        if rank == 0:
            local = torch.autograd.grad(_chain_loss(params, x2), list(params.values()))
            out["local"] = dict(zip(params, local, strict=True))
        torch.autograd.backward(_chain_loss(armed, x1))
        out["ddp"] = grads(params)
    elif pattern == "retain_graph":
        loss = _chain_loss(ddp(params), x1)
        torch.autograd.backward(loss, retain_graph=True)
        torch.autograd.backward(loss)
        out["ddp"] = grads(params)
    elif pattern == "two_forwards":
        l1, l2 = _chain_loss(ddp(params), x1), _chain_loss(ddp(params), x2)
        torch.autograd.backward(l1)
        torch.autograd.backward(l2)
        out["ddp"] = grads(params)
    elif pattern == "one_backward_two_calls":
        torch.autograd.backward(_chain_loss(ddp(params), x1) + _chain_loss(ddp(params), x2))
        out["ddp"] = grads(params)
    elif pattern == "grad_wrt_outputs":  # autograd.grad with the call's outputs as inputs
        armed = ddp(params)
        got = torch.autograd.grad(_chain_loss(armed, x1), list(armed.values()))
        out["ddp"] = dict(zip(params, got, strict=True))
        assert all(v.grad is None for v in params.values())
    elif pattern in ("grad_wrt_one_output", "grad_wrt_one_leaf"):  # w1, beside w2 in a bucket
        armed = ddp(params)
        of = armed if pattern == "grad_wrt_one_output" else params
        (one,) = torch.autograd.grad(_chain_loss(armed, x1), [of["w1"]])
        out["ddp"] = {"w1": one}
        assert all(v.grad is None for v in params.values())
    elif pattern == "backward_inputs_one_leaf":  # w1's .grad only, as locally
        torch.autograd.backward(_chain_loss(ddp(params), x1), inputs=[params["w1"]])
        out["ddp"] = grads(params)
    return out


@pytest.mark.parametrize("when", ["local_after", "local_between"])
def test_a_backward_that_never_called_ddp_is_local(when: str) -> None:
    # Only rank 0 runs the local backward: a collective in it would pair with
    # nothing (a timeout) or with the other rank's next step (wrong results).
    size = 2
    results = ranks.world(size).run(_pattern, when)
    x2 = batch(size * PER_RANK, seed=7)[0]
    for key, expected in _local_grads(shard(x2, 0)).items():
        torch.testing.assert_close(results[0]["local"][key], expected, **TOL, msg=key)
    reduced = _reduced_grads([data(size)], size)
    for out in results:
        for key, expected in reduced.items():
            torch.testing.assert_close(out["ddp"][key], expected, **TOL, msg=key)


ONE_LEAF = ["grad_wrt_one_output", "grad_wrt_one_leaf", "backward_inputs_one_leaf"]


@pytest.mark.parametrize("caps", list(CAPS))
@pytest.mark.parametrize(
    "pattern",
    ["retain_graph", "two_forwards", "one_backward_two_calls", "grad_wrt_outputs", *ONE_LEAF],
)
def test_every_backward_through_a_call_is_reduced_once(pattern: str, caps: str) -> None:
    size = 2
    x1, x2 = data(size), batch(size * PER_RANK, seed=7)[0]
    xs = {"retain_graph": [x1, x1], "two_forwards": [x1, x2], "one_backward_two_calls": [x1, x2]}
    expected = _reduced_grads(xs.get(pattern, [x1]), size)
    if pattern in ONE_LEAF:  # w1's gradient only; w0 and w2 get none
        expected = {"w1": expected["w1"]}
        if pattern == "backward_inputs_one_leaf":
            expected |= {"w0": None, "w2": None}
    for out in ranks.world(size).run(_pattern, pattern, caps):
        assert set(out["ddp"]) == set(expected)
        for key, e in expected.items():
            if e is None:
                assert out["ddp"][key] is None, key
            else:
                torch.testing.assert_close(out["ddp"][key], e, **TOL, msg=key)


def _reused_across_steps(rank: int, size: int, steps: int) -> dict[str, torch.Tensor]:
    params = chain_params()
    ddp = fdp.DistributedDataParallel(params, **TINY)
    opt = torch.optim.SGD(params.values(), lr=0.5)
    p = ddp(params)  # once, before the loop: every step's backward still reduces
    for step in range(steps):
        x = shard(batch(size * PER_RANK, seed=step)[0], rank)
        opt.zero_grad()
        torch.autograd.backward(_chain_loss(p, x))
        opt.step()
    return {k: v.detach() for k, v in params.items()}


def test_a_call_reused_across_steps_reduces_every_step() -> None:
    size, steps = 2, 3
    params = chain_params()
    opt = torch.optim.SGD(params.values(), lr=0.5)
    for step in range(steps):
        x = batch(size * PER_RANK, seed=step)[0]
        opt.zero_grad()
        torch.autograd.backward(
            torch.stack([_chain_loss(params, shard(x, r)) for r in range(size)]).mean()
        )
        opt.step()
    for got in ranks.world(size).run(_reused_across_steps, steps):
        for key, e in params.items():
            torch.testing.assert_close(got[key], e.detach(), **TOL, msg=key)


def _launch_order(rank: int, size: int, caps: str) -> list[str]:
    params = chain_params()
    events: list[str] = []

    def hook(state: Any, bucket: fdp.GradBucket) -> torch.futures.Future[torch.Tensor]:
        events.append(f"launch {bucket.index()}")
        return fdp.allreduce_hook(state, bucket)

    ddp = fdp.DistributedDataParallel(params, comm_hook=hook, **CAPS[caps])
    h = shard(data(size), rank)
    p = ddp(params)
    for i, name in enumerate(("w0", "w1", "w2")):
        h = torch.tanh(h @ p[name])
        h.register_hook(lambda g, i=i: events.append(f"activation {i}"))  # type: ignore[no-untyped-call]
    torch.autograd.backward(h.square().mean())
    return events


@pytest.mark.parametrize("caps", list(CAPS))
def test_buckets_launch_while_backward_runs(caps: str) -> None:
    # The last layers' bucket is all-reduced before the first layer's
    # activation gradient exists: the reduction overlaps backward.
    for events in ranks.world(2).run(_launch_order, caps):
        assert events.index("launch 0") < events.index("activation 0"), events


# --------------------------------------------------------------- profiler labels


def _profiled(rank: int, size: int) -> Any:
    params = chain_params()
    ddp = fdp.DistributedDataParallel(params, **TINY)  # one bucket per leaf
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.autograd.backward(chain(ddp(params), shard(data(size), rank), "last", False))
    return grads(params), sorted({e.name for e in prof.events() if e.name.startswith("fdp::")})


def test_a_profiler_trace_shows_each_bucket_and_the_finish() -> None:
    size = 2
    results = ranks.world(size).run(_profiled)
    params = chain_params()
    x = data(size)
    losses = [chain(params, shard(x, r), "last", reentrant=False) for r in range(size)]
    torch.autograd.backward(torch.stack(losses).mean())
    for got, labels in results:
        assert labels == [
            "fdp::ddp.bucket 0",
            "fdp::ddp.bucket 1",
            "fdp::ddp.bucket 2",
            "fdp::ddp.finish",
        ]
        for name, p in params.items():
            torch.testing.assert_close(got[name], p.grad, **TOL, msg=name)


# ------------------------------------------------- what a user does to a .grad


def _repointed(rank: int, size: int, how: str, caps: str) -> list[dict[str, torch.Tensor]]:
    """Three steps; after each, the handed-out gradients are repointed at other memory."""
    params = chain_params()
    ddp = fdp.DistributedDataParallel(params, **CAPS[caps])
    seen = []
    for step in range(3):
        x = shard(batch(size * PER_RANK, seed=step)[0], rank)
        if how == "fdp.grad":
            got = fdp.grad(lambda p, x=x: _chain_loss(ddp(p), x))(
                {k: v.detach() for k, v in params.items()}
            )
        else:
            torch.autograd.backward(_chain_loss(ddp(params), x))
            got = {k: v.grad for k, v in params.items()}
        seen.append({k: v.clone() for k, v in got.items()})
        for g in got.values():  # the bucket's memory must not follow
            if how == "data":
                g.data = torch.full_like(g, 7.0)
            else:
                g.set_(torch.full_like(g, 7.0))
        del got
        for v in params.values():
            v.grad = None  # the buffer is free again: the next step reuses it
    return seen


@pytest.mark.parametrize("caps", list(CAPS))
@pytest.mark.parametrize("how", ["set_", "data", "fdp.grad"])
def test_a_repointed_gradient_leaves_the_next_steps_buckets_alone(how: str, caps: str) -> None:
    # The buckets keep their leaves' views from step to step (Layout.buffer_views);
    # what a step hands out is an alias of one, so set_ or .data = on it
    # repoints that alias only.
    size = 2
    for got in ranks.world(size).run(_repointed, how, caps):
        for step, grads_ in enumerate(got):
            x = batch(size * PER_RANK, seed=step)[0]
            params = chain_params()
            losses = [_chain_loss(params, shard(x, r)) for r in range(size)]
            torch.autograd.backward(torch.stack(losses).mean())
            for key, p in params.items():
                torch.testing.assert_close(grads_[key], p.grad, **TOL, msg=f"step {step} {key}")


def _runs_packed(
    rank: int, size: int, how: str
) -> tuple[dict[str, torch.Tensor], torch.Tensor, list[int]]:
    from fdp._ddp import _step

    at_once: list[int] = []
    real = _step.Step._run_at_once

    def counted(self: Any, slots: Any, *args: Any) -> Any:
        at_once.append(len(slots.indices))
        return real(self, slots, *args)

    _step.Step._run_at_once = counted  # type: ignore[method-assign,assignment]
    try:
        params = run_params()
        ddp = fdp.DistributedDataParallel(params)  # one bucket, one run of three leaves

        def loss(p: dict[str, torch.Tensor]) -> torch.Tensor:
            return run_loss(ddp(p), rank)

        if how == "backward":
            value = loss(params)
            torch.autograd.backward(value)
            grads = {k: v.grad for k, v in params.items()}
        else:
            grads, value = fdp.grad_and_value(loss)(params)
    finally:
        _step.Step._run_at_once = real  # type: ignore[method-assign]
    return grads, value.detach(), at_once  # type: ignore[return-value]


def run_params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    shapes = {"a": (4, 5), "b": (5,), "c": (5, 2)}
    return {k: torch.randn(*s, generator=g).requires_grad_() for k, s in shapes.items()}


def run_loss(p: dict[str, torch.Tensor], rank: int) -> torch.Tensor:
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    return (torch.tanh(x @ p["a"] + p["b"]) @ p["c"]).square().mean()


@pytest.mark.parametrize("how", ["backward", "fdp.grad"])
def test_a_run_of_plain_leaves_is_packed_at_once(how: str) -> None:
    # The common case skips the per-leaf loop (fdp/_ddp/_runs.py); same gradients.
    size = 2
    params = run_params()
    losses = [run_loss(params, r) for r in range(size)]
    torch.autograd.backward(torch.stack(losses).sum() / size)
    for rank, (grads, value, at_once) in enumerate(ranks.world(size).run(_runs_packed, how)):
        assert at_once == [3]
        torch.testing.assert_close(value, losses[rank].detach(), **TOL)
        for name, p in params.items():
            torch.testing.assert_close(grads[name], p.grad, **TOL, msg=name)
