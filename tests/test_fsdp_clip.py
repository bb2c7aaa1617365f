"""FullyShardedDataParallel.clip_grad_norm (fdp/_sharding/_fsdp_clip.py) against torch.

torch.nn.utils.clip_grad_norm_ on the whole, unsharded tree is the reference.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import fdp
from tests import ranks
from tests.helpers import tree_allclose
from tests.test_fsdp import (
    TOL,
    _as_params,
    _by_func_grad,
    _detached,
    data,
    local_loss,
    make_params,
    mine,
    reference_grad,
)


def _real_phase(params: dict[str, Any]) -> None:
    """No complex leaf: p-norms other than 2 need each complex element whole."""
    params["head"]["phase"] = params["head"]["phase"].detach().real.clone().requires_grad_()


def _clipped(
    rank: int, size: int, max_norm: float, norm_type: float, dynamic: bool, via: str
) -> Any:
    params = make_params()
    if norm_type != 2.0:
        _real_phase(params)
    fsdp = fdp.FullyShardedDataParallel(params)
    x, y = data(size)
    shards = _detached(fsdp.shard(params))
    grads = _by_func_grad(fsdp, shards, mine(x, rank), mine(y, rank))
    # fdp.optim.clip_by_global_norm of the shards' gradients is fsdp's: before,
    # each rank clipped its shards by their own norm (the ranks' norms differed).
    clip = fsdp.clip_grad_norm if via == "fsdp" else fdp.optim.clip_by_global_norm
    if dynamic:  # every number and size symbolic, the norm's order included
        torch._dynamo.reset()
        clip = torch.compile(clip, backend="aot_eager", fullgraph=True, dynamic=True)
    clipped, norm = clip(grads, max_norm, norm_type=norm_type)
    return fsdp.full(clipped), norm


@pytest.mark.parametrize(
    ("norm_type", "dynamic", "via"),
    [
        (2.0, False, "fsdp"),
        (1.0, False, "fsdp"),
        (3.0, False, "fsdp"),
        (math.inf, False, "fsdp"),
        (2.0, False, "optim"),
        (math.inf, False, "optim"),
        # Compiled with dynamic=True the order was a symbol, which math.isinf refused.
        pytest.param(2.0, True, "fsdp", marks=pytest.mark.compile, id="2.0-compiled-dynamic"),
        pytest.param(math.inf, True, "fsdp", marks=pytest.mark.compile, id="inf-compiled-dynamic"),
        # The shards recognised while dynamo traces (no lock there: it cannot enter one).
        pytest.param(2.0, True, "optim", marks=pytest.mark.compile, id="2.0-compiled-optim"),
    ],
)
@pytest.mark.parametrize("max_norm", [0.05, 100.0], ids=["clipped", "unclipped"])
def test_clip_grad_norm_over_the_shards_equals_torchs_on_the_whole_tree(
    max_norm: float, norm_type: float, dynamic: bool, via: str
) -> None:
    expected = reference_grad(2, local_loss, None if norm_type == 2.0 else _real_phase)
    # torch's clip_grad_norm_ on the unsharded gradients (the tied tensor once).
    leaves = [expected["embed"], expected["conv"], expected["frozen"], expected["head"]["w"]]
    leaves += [expected["head"]["phase"]] + [t for b in expected["blocks"] for t in b.values()]
    copies = [t.clone() for t in leaves]
    norm = torch.nn.utils.clip_grad_norm_(_as_params(copies), max_norm, norm_type=norm_type)
    scale = min(1.0, max_norm / (float(norm) + 1e-6))

    def scaled_leaf(t: Any) -> Any:  # the integer buffer stays
        trained = isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())
        return t * scale if trained else t

    scaled = torch.utils._pytree.tree_map(scaled_leaf, expected)
    for got, got_norm in ranks.world(2).run(_clipped, max_norm, norm_type, dynamic, via):
        torch.testing.assert_close(got_norm, norm, **TOL)
        tree_allclose(got, scaled, **TOL)


def _clip_complex_by_one_norm(rank: int, size: int) -> str:
    fsdp = fdp.FullyShardedDataParallel(make_params())
    grads = {
        k: tuple(torch.zeros_like(t) for t in ts) for k, ts in fsdp.shard(make_params()).items()
    }
    with pytest.raises(NotImplementedError, match="complex leaves") as info:
        fsdp.clip_grad_norm(grads, 1.0, norm_type=1)
    return str(info.value)


def _small_tree() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"a": torch.randn(5, 3, generator=g), "b": torch.randn(7, generator=g)}


def _clip_without_unit_b(rank: int, size: int, via: str) -> Any:
    fsdp = fdp.FullyShardedDataParallel(_small_tree())  # units "a" and "b"
    shards = fsdp.shard(_small_tree())
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(rank))
    grads = fdp.grad(lambda s: (x @ fsdp(s)["a"]).square().sum())(shards)
    grads["b"] = tuple(None for _ in grads["b"])  # a unit no backward reached (.grad None)
    clip = fsdp.clip_grad_norm if via == "fsdp" else fdp.optim.clip_by_global_norm
    clipped, norm = clip(grads, 0.5)
    assert all(t is None for t in clipped["b"])
    clipped["b"] = tuple(torch.zeros_like(t) for t in shards["b"])
    return fsdp.full(clipped)["a"], norm


@pytest.mark.parametrize("via", ["fsdp", "optim"])
def test_a_unit_without_gradients_counts_as_zeros_and_stays_none(via: str) -> None:
    a = _small_tree()["a"].requires_grad_()
    xs = [torch.randn(4, 5, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    torch.autograd.backward(torch.stack([(x @ a).square().sum() for x in xs]).mean())
    assert a.grad is not None
    norm = torch.nn.utils.clip_grad_norm_([a], 0.5)
    for got, got_norm in ranks.world(2).run(_clip_without_unit_b, via):
        torch.testing.assert_close(got_norm, norm, **TOL)
        torch.testing.assert_close(got, a.grad, **TOL)


def test_clip_grad_norm_refuses_p_norms_of_complex_shards() -> None:
    first, second = ranks.world(2).run(_clip_complex_by_one_norm)
    assert first == second


# ---------------------------------------------------------------------------
# The norm's accuracy: a shard of millions of elements, against float64.


def _big_grads() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {
        "embed": torch.randn(4000, 512, generator=g) * 0.1,  # 2M elements: the most of the norm
        "w": torch.randn(64, 64, generator=g),
        "b": torch.randn(64, generator=g).to(torch.bfloat16).float(),
    }


def _float64_norm(tree: dict[str, torch.Tensor]) -> float:
    flat = torch.cat([t.double().reshape(-1) for t in tree.values()])
    return float(torch.linalg.vector_norm(flat))


def _sharded_norms(rank: int, size: int) -> tuple[float, float]:
    grads = _big_grads()
    params = {k: torch.zeros_like(v) for k, v in grads.items()}
    fsdp = fdp.FullyShardedDataParallel(params)
    _, norm = fsdp.clip_grad_norm(fsdp.shard(grads), 1e9)
    zero = fdp.ZeroRedundancy(fdp.optim.sgd(0.1), params)
    zero.step(grads, zero.init(params), params, max_norm=1e9)
    assert zero.last_grad_norm is not None
    return float(norm), float(zero.last_grad_norm)


def test_fsdp_and_zero_norms_of_large_shards_are_within_float32_rounding_of_float64() -> None:
    # The CPU's float32 norm of a 1M-element shard errs by ~1e-5 (always low);
    # torch's clip_grad_norm_ on such a leaf errs as much. fdp sums rows' squares in float64.
    want = _float64_norm(_big_grads())
    for fsdp_norm, zero_norm in ranks.world(2).run(_sharded_norms):
        assert abs(fsdp_norm - want) / want < 1.2e-7, (fsdp_norm, want)
        assert abs(zero_norm - want) / want < 1.2e-7, (zero_norm, want)


def _cuda_norms(rank: int, size: int) -> tuple[float, float]:
    import torch.distributed as dist

    group = dist.new_group(backend="nccl")  # this rank alone, on its GPU
    grads = {k: v.cuda() for k, v in _big_grads().items()}
    params = {k: torch.zeros_like(v) for k, v in grads.items()}
    fsdp = fdp.FullyShardedDataParallel(params, group=group)
    _, norm = fsdp.clip_grad_norm(fsdp.shard(grads), 1e9)
    zero = fdp.ZeroRedundancy(fdp.optim.sgd(0.1), params, group=group)
    zero.step(grads, zero.init(params), params, max_norm=1e9)
    assert zero.last_grad_norm is not None
    out = float(norm), float(zero.last_grad_norm)
    dist.destroy_process_group(group)
    return out


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_norms_of_large_cuda_shards_are_within_float32_rounding_of_float64() -> None:
    want = _float64_norm(_big_grads())
    fsdp_norm, zero_norm = ranks.world(1).run(_cuda_norms)[0]
    assert abs(fsdp_norm - want) / want < 1.2e-7, (fsdp_norm, want)
    assert abs(zero_norm - want) / want < 1.2e-7, (zero_norm, want)
