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


def _clipped(rank: int, size: int, max_norm: float, norm_type: float, dynamic: bool) -> Any:
    params = make_params()
    if norm_type != 2.0:
        _real_phase(params)
    fsdp = fdp.FullyShardedDataParallel(params)
    x, y = data(size)
    shards = _detached(fsdp.shard(params))
    grads = _by_func_grad(fsdp, shards, mine(x, rank), mine(y, rank))
    clip = fsdp.clip_grad_norm
    if dynamic:  # every number and size symbolic, the norm's order included
        torch._dynamo.reset()
        clip = torch.compile(clip, backend="aot_eager", fullgraph=True, dynamic=True)
    clipped, norm = clip(grads, max_norm, norm_type=norm_type)
    return fsdp.full(clipped), norm


@pytest.mark.parametrize(
    ("norm_type", "dynamic"),
    [
        (2.0, False),
        (1.0, False),
        (3.0, False),
        (math.inf, False),
        # Compiled with dynamic=True the order was a symbol, which math.isinf refused.
        pytest.param(2.0, True, marks=pytest.mark.compile, id="2.0-compiled-dynamic"),
        pytest.param(math.inf, True, marks=pytest.mark.compile, id="inf-compiled-dynamic"),
    ],
)
@pytest.mark.parametrize("max_norm", [0.05, 100.0], ids=["clipped", "unclipped"])
def test_clip_grad_norm_over_the_shards_equals_torchs_on_the_whole_tree(
    max_norm: float, norm_type: float, dynamic: bool
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
    for got, got_norm in ranks.world(2).run(_clipped, max_norm, norm_type, dynamic):
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
