"""Comm hooks with torch's protocol, ``hook(state, bucket)`` (fdp._comm._comm_hooks).

torch's own hooks (``torch.distributed.algorithms.ddp_comm_hooks``) run
unmodified through ``ddp.register_comm_hook``. Every body runs on spawned
gloo ranks; the reference is the single-process average over ranks of each
rank's gradients.
"""

from __future__ import annotations

from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD

import fdp
from tests import ranks
from tests.helpers import PER_RANK, TOL, batch, mlp, mlp_params, shard

CAPS: dict[str, Any] = {"bucket_cap_mb": 1e-4, "first_bucket_cap_mb": 1e-4}  # a few buckets

TORCH_HOOKS: dict[str, Any] = {
    "allreduce": default_hooks.allreduce_hook,
    "fp16": default_hooks.fp16_compress_hook,
    "bf16": default_hooks.bf16_compress_hook,
    "fp16_wrapper": default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook),
    "bf16_wrapper": default_hooks.bf16_compress_wrapper(default_hooks.allreduce_hook),
}
LOSSY = {"fp16": 2e-3, "bf16": 2e-2, "fp16_wrapper": 2e-3, "bf16_wrapper": 2e-2}


def loss(params: dict[str, Any], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(mlp(params, x), y)


def flat_grads(params: dict[str, Any]) -> torch.Tensor:
    return torch.cat(
        [torch.zeros(0) if p.grad is None else p.grad.reshape(-1) for p in leaves(params)]
    )


def leaves(params: dict[str, Any]) -> list[torch.Tensor]:
    return [params["head"].first, *(t for layer in params["layers"] for t in layer.values())]


def reference(size: int, steps: int = 1) -> torch.Tensor:
    params = mlp_params(depth=3)
    for step in range(steps):
        x, y = batch(size * PER_RANK, seed=1 + step)
        for r in range(size):
            torch.autograd.backward(loss(params, shard(x, r), shard(y, r)) / size)
    return flat_grads(params)


def _torch_hook(rank: int, size: int, name: str) -> torch.Tensor:
    params = mlp_params(depth=3)
    ddp = fdp.DistributedDataParallel(params, **CAPS)
    ddp.register_comm_hook(None, TORCH_HOOKS[name])
    x, y = batch(size * PER_RANK)
    torch.autograd.backward(loss(ddp(params), shard(x, rank), shard(y, rank)))
    return flat_grads(params)


@pytest.mark.parametrize("name", list(TORCH_HOOKS))
def test_torchs_hooks_run_unmodified(name: str) -> None:
    got = ranks.world(2).run(_torch_hook, name)
    assert torch.equal(got[0], got[1])  # every rank holds the same gradients
    tol = LOSSY.get(name)
    kw = {"rtol": tol, "atol": tol} if tol else TOL
    torch.testing.assert_close(got[0], reference(2), **kw)


def _power_sgd(rank: int, size: int, steps: int) -> list[torch.Tensor]:
    params = mlp_params(depth=3)
    ddp = fdp.DistributedDataParallel(params, **CAPS)
    state = powerSGD.PowerSGDState(
        process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2, random_seed=0
    )
    ddp.register_comm_hook(state, powerSGD.powerSGD_hook)
    out = []
    for step in range(steps):
        x, y = batch(size * PER_RANK, seed=1 + step)
        torch.autograd.backward(loss(ddp(params), shard(x, rank), shard(y, rank)))
        out.append(flat_grads(params))
        for p in leaves(params):
            p.grad = None
    return out


def test_power_sgd_gives_every_rank_the_same_low_rank_average() -> None:
    size, steps = 2, 4
    got = ranks.world(size).run(_power_sgd, steps)
    for a, b in zip(*got, strict=True):
        assert torch.equal(a, b)
    # Before start_powerSGD_iter, PowerSGD is a plain average; after, an approximation.
    params = mlp_params(depth=3)
    for step in range(steps):
        for p in leaves(params):
            p.grad = None
        x, y = batch(size * PER_RANK, seed=1 + step)
        for r in range(size):
            torch.autograd.backward(loss(params, shard(x, r), shard(y, r)) / size)
        if step < 2:
            torch.testing.assert_close(got[0][step], flat_grads(params), **TOL)
        else:
            assert not torch.allclose(got[0][step], flat_grads(params))
            cosine = torch.nn.functional.cosine_similarity(got[0][step], flat_grads(params), 0)
            assert cosine > 0.5


def _bucket_api(rank: int, size: int) -> list[tuple[int, bool, bool, bool]]:
    params = mlp_params(depth=3)
    ddp = fdp.DistributedDataParallel(params, **CAPS)
    seen: list[tuple[int, bool, bool, bool]] = []
    ids = {id(t) for t in leaves(params)}

    def spy(group: Any, bucket: fdp.GradBucket) -> torch.futures.Future[torch.Tensor]:
        flat = bucket.buffer()
        views = all(g.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
                    for g in bucket.gradients())  # fmt: skip
        shapes = [g.shape for g in bucket.gradients()] == [p.shape for p in bucket.parameters()]
        mine = all(id(p) in ids for p in bucket.parameters())
        seen.append((bucket.index(), bucket.is_last(), views and shapes, mine))
        return fdp.allreduce_hook(group, bucket)

    ddp.register_comm_hook(None, spy)
    x, y = batch(size * PER_RANK)
    torch.autograd.backward(loss(ddp(params), shard(x, rank), shard(y, rank)))
    return seen


def test_the_bucket_offers_what_torchs_grad_bucket_offers() -> None:
    for seen in ranks.world(2).run(_bucket_api):
        n = len(seen)
        assert n > 2
        assert [s[0] for s in seen] == list(range(n))
        assert [s[1] for s in seen] == [False] * (n - 1) + [True]
        assert all(s[2] and s[3] for s in seen)


def _raw_future(rank: int, size: int, dtype: str) -> torch.Tensor:
    params = mlp_params(depth=3)
    ddp = fdp.DistributedDataParallel(params, **CAPS)

    def raw(group: Any, bucket: fdp.GradBucket) -> torch.futures.Future[torch.Tensor]:
        # The collective's own future, of a list of one tensor (torch's DDP takes it too).
        flat = bucket.buffer().to(getattr(torch, dtype)).div_(size)
        future = dist.all_reduce(flat, group=group, async_op=True).get_future()
        return cast("torch.futures.Future[torch.Tensor]", future)

    ddp.register_comm_hook(None, raw)
    x, y = batch(size * PER_RANK)
    torch.autograd.backward(loss(ddp(params), shard(x, rank), shard(y, rank)))
    return flat_grads(params)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_hook_may_return_the_collectives_own_future(dtype: str) -> None:
    got = ranks.world(2).run(_raw_future, dtype)
    assert torch.equal(got[0], got[1])
    tol = LOSSY["bf16"] if dtype == "bfloat16" else None
    kw = {"rtol": tol, "atol": tol} if tol else TOL
    torch.testing.assert_close(got[0], reference(2), **kw)


def _wrong_result(rank: int, size: int) -> str:
    params = mlp_params(depth=3)
    ddp = fdp.DistributedDataParallel(params, **CAPS)

    def short(group: Any, bucket: fdp.GradBucket) -> torch.futures.Future[torch.Tensor]:
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(torch.zeros(3))
        return done

    ddp.register_comm_hook(None, short)
    x, y = batch(size * PER_RANK)
    with pytest.raises(TypeError) as info:
        torch.autograd.backward(loss(ddp(params), shard(x, rank), shard(y, rank)))
    return str(info.value)


def test_a_hook_resolving_to_another_shape_is_refused() -> None:
    for error in ranks.world(2).run(_wrong_result):
        assert error.startswith("fdp.DistributedDataParallel: `comm_hook` expected to resolve")
        assert "tensor of the bucket's shape (" in error
        assert "got Tensor (3,)" in error


def wrong_bucket(state: Any, bucket: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    raise AssertionError("never called")


def wrong_return(state: Any, bucket: fdp.GradBucket) -> torch.Tensor:
    raise AssertionError("never called")


def one_argument(bucket: fdp.GradBucket) -> torch.futures.Future[torch.Tensor]:
    raise AssertionError("never called")


def torch_annotated(
    state: Any,
    bucket: torch.distributed.GradBucket,  # type: ignore[name-defined]
) -> torch.futures.Future[torch.Tensor]:
    return fdp.allreduce_hook(state, bucket)


def _annotations(rank: int, size: int) -> list[str]:
    """torch's _check_comm_hook cases (test_c10d_common.py: test_invalid_comm_hook_*)."""
    errors = []
    for hook, error in [
        (wrong_bucket, ValueError),
        (wrong_return, ValueError),
        (one_argument, TypeError),
    ]:
        with pytest.raises(error) as info:
            fdp.DistributedDataParallel(mlp_params()).register_comm_hook(None, hook)  # type: ignore[arg-type]
        errors.append(str(info.value))
    with pytest.raises(ValueError, match="return annotation") as info:
        fdp.DistributedDataParallel(mlp_params(), comm_hook=wrong_return)  # type: ignore[arg-type]
    errors.append(str(info.value))
    # Annotated as torch documents, and this module's own postponed (string) annotations: accepted.
    fdp.DistributedDataParallel(mlp_params()).register_comm_hook(None, torch_annotated)
    return errors


def test_hook_annotations_are_checked_as_torch_checks_them() -> None:
    for errors in ranks.world(2).run(_annotations):
        call = "fdp.DistributedDataParallel.register_comm_hook: "
        assert errors[0].startswith(call + "`hook`'s bucket annotation expected GradBucket")
        assert "got 'torch.Tensor'" in errors[0]
        assert errors[1].startswith(
            call + "`hook`'s return annotation expected torch.futures.Future[torch.Tensor]"
        )
        assert errors[2].startswith(call + "`hook` expected a callable hook(state, bucket) taking")
        assert errors[3].startswith("fdp.DistributedDataParallel: `comm_hook`'s return annotation")


def _registration(rank: int, size: int) -> list[str]:
    params = mlp_params()
    ddp = fdp.DistributedDataParallel(params)
    with pytest.raises(TypeError) as not_callable:
        ddp.register_comm_hook(None, "fp16")  # type: ignore[arg-type]
    ddp.register_comm_hook(None, fdp.fp16_compress_hook)
    with pytest.raises(RuntimeError) as twice:
        ddp.register_comm_hook(None, fdp.bf16_compress_hook)
    used = fdp.DistributedDataParallel(params)
    used(params)
    with pytest.raises(RuntimeError) as late:
        used.register_comm_hook(None, fdp.bf16_compress_hook)
    return [str(not_callable.value), str(twice.value), str(late.value)]


def test_a_hook_is_registered_once_before_the_first_call() -> None:
    for not_callable, twice, late in ranks.world(2).run(_registration):
        assert "`hook` expected a callable hook(state, bucket); got 'fp16'" in not_callable
        assert "only once, before the first ddp(params)" in twice
        assert "only once, before the first ddp(params)" in late


def _compiled_torch_hook(rank: int, size: int) -> torch.Tensor:
    torch._dynamo.reset()
    params = mlp_params(depth=3)
    ddp = fdp.DistributedDataParallel(params, **CAPS)
    ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    compiled = torch.compile(
        lambda p, x, y: loss(ddp(p), x, y), backend="aot_eager", fullgraph=True
    )
    x, y = batch(size * PER_RANK)
    torch.autograd.backward(compiled(params, shard(x, rank), shard(y, rank)))
    return flat_grads(params)


@pytest.mark.compile
def test_torchs_default_hooks_are_traced_inside_torch_compile() -> None:
    got = ranks.world(2).run(_compiled_torch_hook)
    assert torch.equal(got[0], got[1])
    torch.testing.assert_close(got[0], reference(2), rtol=2e-2, atol=2e-2)
