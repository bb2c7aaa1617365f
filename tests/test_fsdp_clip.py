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


def _clipped(rank: int, size: int, max_norm: float, norm_type: float) -> Any:
    params = make_params()
    if norm_type != 2.0:
        _real_phase(params)
    fsdp = fdp.FullyShardedDataParallel(params)
    x, y = data(size)
    shards = _detached(fsdp.shard(params))
    grads = _by_func_grad(fsdp, shards, mine(x, rank), mine(y, rank))
    clipped, norm = fsdp.clip_grad_norm(grads, max_norm, norm_type=norm_type)
    return fsdp.full(clipped), norm


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, math.inf])
@pytest.mark.parametrize("max_norm", [0.05, 100.0], ids=["clipped", "unclipped"])
def test_clip_grad_norm_over_the_shards_equals_torchs_on_the_whole_tree(
    max_norm: float, norm_type: float
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
    for got, got_norm in ranks.world(2).run(_clipped, max_norm, norm_type):
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
