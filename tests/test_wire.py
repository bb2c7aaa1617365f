"""bfloat16 on the wire, float32 sums: the raw primitives, DDP's hook and FSDP's ``sum_dtype``.

References are computed in one process: each rank's input rounded to
bfloat16 once, the rounded inputs added in float32 in rank order (and, for
an all-reduce, the sum rounded to bfloat16 once more). The error against a
float64 reduction is compared with bfloat16's own reduction on the wire,
which rounds every partial sum.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

import fdp
from fdp import _compat
from fdp._comm import _raw
from tests import ranks

N = 4096 + 3  # not a multiple of the world: the all-reduce pads


@contextlib.contextmanager
def wire() -> Iterator[list[tuple[torch.dtype, int]]]:
    """Each eager all-to-all's input while the block runs: its dtype and bytes.

    A float32 exchange of values rounded to bfloat16 beforehand would give
    the same sums; what travels is what says the wire is bfloat16.
    """
    sent: list[tuple[torch.dtype, int]] = []
    original = dist.all_to_all_single

    def recorded(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        sent.append((input.dtype, input.numel() * input.element_size()))
        return original(output, input, *args, **kwargs)

    dist.all_to_all_single = recorded
    try:
        yield sent
    finally:
        dist.all_to_all_single = original


def data(rank: int, n: int = N) -> torch.Tensor:
    """Gradient-like values: mixed signs over four orders of magnitude."""
    g = torch.Generator().manual_seed(rank)
    return torch.randn(n, generator=g) * torch.logspace(-3, 1, n)


def rounded_sum(size: int, n: int = N) -> torch.Tensor:
    total = torch.zeros(n)
    for r in range(size):
        total = total + data(r, n).to(torch.bfloat16).float()
    return total


def _primitives(rank: int, size: int, compiled: bool) -> Any:
    n = (N // size) * size

    def wide(x: torch.Tensor) -> torch.Tensor:
        return _raw.reduce_scatter_wide(x, wire=torch.bfloat16, group=None)

    fn = torch.compile(wide, backend="aot_eager", fullgraph=True) if compiled else wide
    flat = data(rank)
    bucket = fdp.GradBucket(flat, index=0, is_last=True, gradients=[flat], parameters=[flat])
    with wire() as sent:  # the compiled all-to-all is a functional collective: not recorded
        shard = fn(data(rank, n))
        whole = fdp.bf16_wire_hook(None, bucket).wait() * size
    return shard, whole, sent


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("size", [2, 3])
def test_wide_sums_add_the_rounded_inputs_in_float32(size: int, compiled: bool) -> None:
    got = ranks.world(size).run(_primitives, compiled)
    n = (N // size) * size
    per = n // size
    for rank, (shard, whole, sent) in enumerate(got):
        assert shard.dtype == whole.dtype == torch.float32
        # bfloat16 travels: 2 bytes a value (the hook's bucket padded to the world).
        padded = -(-N // size) * size
        assert sent == ([] if compiled else [(torch.bfloat16, 2 * n)]) + [
            (torch.bfloat16, 2 * padded)
        ], sent
        expected_shard = rounded_sum(size, n)[rank * per : (rank + 1) * per]
        torch.testing.assert_close(shard, expected_shard, rtol=0, atol=0)
        # The hook divides by the world before rounding: the sum of the rounded shares.
        shares = torch.stack([(data(r) / size).to(torch.bfloat16).float() for r in range(size)])
        shares = shares.cumsum(0)[-1]  # added in rank order, as the hook adds
        expected = shares.to(torch.bfloat16).float() * size
        torch.testing.assert_close(whole, expected, rtol=0, atol=0)


def _errors(rank: int, size: int) -> dict[str, float]:
    exact = torch.stack([data(r).double() for r in range(size)]).mean(0)
    errors = {}
    for name, hook in (("bf16", fdp.bf16_compress_hook), ("wire", fdp.bf16_wire_hook)):
        flat = data(rank)
        bucket = fdp.GradBucket(flat, index=0, is_last=True, gradients=[flat], parameters=[flat])
        got = hook(None, bucket).wait()
        assert got is flat  # reduced into the bucket, in float32
        errors[name] = float((got.double() - exact).abs().mean() / exact.abs().mean())
    n = (N // size) * size
    exact_shard = torch.stack([data(r, n).double() for r in range(size)]).sum(0)
    exact_shard = exact_shard.view(size, -1)[rank]
    # The backend's own reduce-scatter (a ring, as NCCL's): fdp's plain one on
    # CPU is an all-to-all and a sum, which adds in float32 before it rounds.
    plain = torch.empty(n // size, dtype=torch.bfloat16)
    _compat.reduce_scatter_single(plain, data(rank, n).to(torch.bfloat16), None).wait()
    plain = plain.double()
    wide = _raw.reduce_scatter_wide(data(rank, n), wire=torch.bfloat16, group=None).double()
    for name, got in (("rs_bf16", plain), ("rs_wire", wide)):
        errors[name] = float((got - exact_shard).abs().mean() / exact_shard.abs().mean())
    return errors


def test_the_error_stays_put_as_ranks_grow_where_bf16s_own_grows() -> None:
    """Relative mean error against a float64 reduction, 2 and 4 ranks (8: the benchmark)."""
    two, four = (ranks.world(size).run(_errors)[0] for size in (2, 4))
    # At 2 ranks an all-reduce rounds once either way; the reduce-scatter's
    # result stays float32, so it is better from the start.
    assert two["wire"] == pytest.approx(two["bf16"], rel=0.05)
    assert two["rs_bf16"] / two["rs_wire"] > 1.3
    assert four["bf16"] / four["wire"] > 1.25
    assert four["rs_bf16"] / four["rs_wire"] > 1.6
    # Wire errors are bfloat16's rounding of each input (and of the result), whatever the world.
    assert four["wire"] < 1.2 * two["wire"]
    assert four["rs_wire"] < 1.2 * two["rs_wire"]


def _ddp(rank: int, size: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    params = {
        "w": torch.randn(33, 7, generator=g, requires_grad=True),
        "b": torch.zeros(7, requires_grad=True),
    }
    ddp = fdp.DistributedDataParallel(params, comm_hook=fdp.bf16_wire_hook, bucket_cap_mb=1e-3)
    x = torch.randn(5, 33, generator=torch.Generator().manual_seed(10 + rank))
    loss = (x @ ddp(params)["w"] + params["b"]).tanh().square().sum()
    with wire() as sent:
        torch.autograd.backward(loss)
    assert sent, "no all-to-all ran"
    assert {dtype for dtype, _ in sent} == {torch.bfloat16}, sent
    # Two bytes a value: every gradient value once (padded to the world per bucket).
    assert sum(b for _, b in sent) <= 2 * (33 * 7 + 7 + size * len(sent)), sent
    return {k: v.grad for k, v in params.items() if v.grad is not None}


def test_ddp_with_the_wire_hook_averages_the_rounded_gradients_in_float32() -> None:
    got = ranks.world(2).run(_ddp)
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(33, 7, generator=g, requires_grad=True), torch.zeros(7, requires_grad=True)
    local = []
    for rank in range(2):
        x = torch.randn(5, 33, generator=torch.Generator().manual_seed(10 + rank))
        local.append(torch.autograd.grad((x @ w + b).tanh().square().sum(), (w, b)))
    for i, key in enumerate(("w", "b")):
        halves = [(grads[i] / 2).to(torch.bfloat16).float() for grads in local]
        expected = (halves[0] + halves[1]).to(torch.bfloat16).float()
        for rank in range(2):
            torch.testing.assert_close(got[rank][key], expected, rtol=0, atol=0)


def _fsdp(rank: int, size: int, sum_dtype: Any) -> Any:
    g = torch.Generator().manual_seed(0)
    params = {"blocks": [{"w": torch.randn(9, 9, generator=g)} for _ in range(2)]}
    fsdp = fdp.FullyShardedDataParallel(params, reduce_dtype=torch.bfloat16, sum_dtype=sum_dtype)
    shards = fsdp.shard(params)
    x = torch.randn(4, 9, generator=torch.Generator().manual_seed(10 + rank))

    def loss(s: Any) -> torch.Tensor:
        p = fsdp(s)
        out: torch.Tensor = (x @ p["blocks"][0]["w"] @ p["blocks"][1]["w"]).tanh().square().sum()
        return out

    with wire() as sent:
        grads = torch.func.grad(loss)(shards)
    if sum_dtype is not None:  # bfloat16 rows of each unit's gradient, added in float32
        assert sent, "no all-to-all ran"
        assert {dtype for dtype, _ in sent} == {torch.bfloat16}, sent
        assert sum(b for _, b in sent) == 2 * 2 * 81 + sum(
            2 * (-(-81 // size) * size - 81) for _ in sent
        ), sent
    return fsdp.full(grads)


def test_fsdp_sum_dtype_adds_the_bf16_gradients_in_float32() -> None:
    got = ranks.world(2).run(_fsdp, torch.float32)
    plain = ranks.world(2).run(_fsdp, None)
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(9, 9, generator=g) for _ in range(2)]
    local = []
    for rank in range(2):
        x = torch.randn(4, 9, generator=torch.Generator().manual_seed(10 + rank))
        local.append(torch.func.grad(lambda w, x=x: (x @ w[0] @ w[1]).tanh().square().sum())(ws))
    exact = [(local[0][i].double() + local[1][i].double()) / 2 for i in range(2)]
    for i in range(2):
        expected = (
            local[0][i].to(torch.bfloat16).float() + local[1][i].to(torch.bfloat16).float()
        ) / 2
        torch.testing.assert_close(got[0]["blocks"][i]["w"], expected, rtol=1e-7, atol=1e-7)
        wire_error = (got[0]["blocks"][i]["w"].double() - exact[i]).abs().mean()
        ring_error = (plain[0]["blocks"][i]["w"].double() - exact[i]).abs().mean()
        assert wire_error < ring_error


def test_a_bad_sum_dtype_is_refused() -> None:
    ranks.world(2).run(_refused)


def _refused(rank: int, size: int) -> None:
    with pytest.raises(TypeError, match=r"`sum_dtype` expected a floating-point dtype"):
        fdp.FullyShardedDataParallel({"w": torch.ones(4)}, sum_dtype=torch.int32)


def _zero(rank: int, size: int, stage: int, compiled: bool, sum_dtype: Any) -> Any:
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(13, 5, generator=g), "b": torch.randn(7, generator=g)}
    zero = fdp.ZeroRedundancy(
        fdp.optim.sgd(1.0),
        params,
        stage=stage,
        bucket_cap_mb=1e-4,
        reduce_dtype=torch.bfloat16,
        sum_dtype=sum_dtype,
    )
    state = zero.init(params)
    grads = {
        k: data(10 * rank + i, v.numel()).view_as(v) for i, (k, v) in enumerate(params.items())
    }
    step = torch.compile(zero.step, backend="aot_eager") if compiled else zero.step
    with wire() as sent:
        new, _ = step(grads, state, params)
    if sum_dtype is not None and not compiled:
        assert sent, "no all-to-all ran"
        assert {dtype for dtype, _ in sent} == {torch.bfloat16}, sent
    return {k: params[k] - new[k] for k in params}  # the averaged gradient (lr 1)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_with_sum_dtype_steps_with_the_bf16_gradients_added_in_float32(
    stage: int, compiled: bool
) -> None:
    got = ranks.world(2).run(_zero, stage, compiled, torch.float32)
    plain = ranks.world(2).run(_zero, stage, False, None)
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(13, 5, generator=g), "b": torch.randn(7, generator=g)}
    for i, (k, v) in enumerate(params.items()):
        local = [data(10 * r + i, v.numel()).view_as(v) for r in range(2)]
        rounded = [x.to(torch.bfloat16).float() for x in local]
        expected = (rounded[0] + rounded[1]) / 2
        exact = (local[0].double() + local[1].double()) / 2
        for rank in range(2):
            torch.testing.assert_close(got[rank][k], expected, rtol=1e-6, atol=1e-6)
            wide_error = (got[rank][k].double() - exact).abs().max()
            ring_error = (plain[rank][k].double() - exact).abs().max()
            assert wide_error <= ring_error


def test_zero_refuses_a_sum_dtype_without_a_reduce_dtype() -> None:
    with pytest.raises(ValueError, match=r"`sum_dtype` expected a `reduce_dtype` to add up"):
        fdp.ZeroRedundancy(fdp.optim.sgd(1.0), {"w": torch.ones(2)}, sum_dtype=torch.float32)
