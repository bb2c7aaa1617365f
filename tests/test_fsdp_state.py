"""FullyShardedDataParallel checkpoints (fdp/_sharding/_fsdp_state.py) and hybrid sharding.

Against one process: checkpoints reshard to another world size and load
unsharded; a 2-D mesh trains as one process.
"""

from __future__ import annotations

from typing import Any

import pytest

import fdp
from tests import ranks
from tests.helpers import tree_allclose
from tests.test_fsdp import (
    TOL,
    Grads,
    _by_backward,
    _by_func_grad,
    _detached,
    _sharded,
    _train,
    data,
    make_params,
    mine,
    reference,
)


def _save(rank: int, size: int, path: str, hybrid: bool = False) -> Any:
    """Two AdamW steps fully sharded, then a checkpoint of the shards and the state."""
    params = make_params()
    fsdp = _sharded(params, size, hybrid)
    shards = _detached(fsdp.shard(params))
    opt = fdp.optim.adamw(0.05)
    state = opt.init(shards)
    x, y = data(size)
    for _ in range(2):
        grads = _by_func_grad(fsdp, shards, mine(x, rank), mine(y, rank))
        shards, state = opt.update(grads, state, shards)
    saved = {"params": fsdp.to_checkpoint(shards), "opt": fsdp.to_checkpoint(state)}
    fdp.save_checkpoint(path, saved)
    return fsdp.full(shards), fsdp.full(state["exp_avg"])


def _load(rank: int, size: int, path: str, hybrid: bool = False) -> Any:
    """The checkpoint on another world size (or mesh)."""
    params = make_params()
    fsdp = _sharded(params, size, hybrid)
    shards = _detached(fsdp.shard(params))
    opt = fdp.optim.adamw(0.05)
    like = {"params": fsdp.to_checkpoint(shards), "opt": fsdp.to_checkpoint(opt.init(shards))}
    loaded = fdp.load_checkpoint(path, like=like)
    shards, state = fsdp.from_checkpoint(loaded["params"]), fsdp.from_checkpoint(loaded["opt"])
    return fsdp.full(shards), fsdp.full(state["exp_avg"]), state["step"]["embed"][0].item()


def test_checkpoints_reshard_to_another_world_size_and_load_unsharded(tmp_path: Any) -> None:
    path = str(tmp_path / "ckpt")
    (saved, moments), *_ = ranks.world(2).run(_save, path)
    for got, got_moments, step in ranks.world(3).run(_load, path):
        tree_allclose(got, saved, rtol=0, atol=0)
        tree_allclose(got_moments, moments, rtol=0, atol=0)
        assert step == 2.0
    # The same checkpoint into unsharded parameters and an unsharded fdp.optim state.
    params = make_params()
    variables = {k: params[k].detach() for k in ("embed", "conv", "frozen")}
    variables["blocks"] = [{k: t.detach() for k, t in b.items()} for b in params["blocks"]]
    variables["head"] = {k: params["head"][k].detach() for k in ("w", "phase")}
    opt_state = fdp.optim.adamw(0.05).init(variables)
    loaded = fdp.load_checkpoint(path, like={"params": variables, "opt": opt_state})
    for k in ("embed", "conv", "frozen", "blocks"):
        tree_allclose(loaded["params"][k], saved[k], rtol=0, atol=0)
    tree_allclose(loaded["opt"]["exp_avg"]["head"]["w"], moments["head"]["w"], rtol=0, atol=0)
    # And back: an unsharded checkpoint (one process) into fully sharded ranks.
    unsharded = str(tmp_path / "unsharded")
    fdp.save_checkpoint(unsharded, loaded)
    for got, got_moments, step in ranks.world(2).run(_load, unsharded):
        tree_allclose(got, saved, rtol=0, atol=0)
        tree_allclose(got_moments, moments, rtol=0, atol=0)
        assert step == 2.0


@pytest.mark.parametrize("grads_of", [_by_backward, _by_func_grad], ids=["backward", "func_grad"])
def test_hybrid_sharding_on_a_2d_mesh_trains_as_one_process(grads_of: Grads) -> None:
    expected = reference(4, 2)
    for per_rank in ranks.world(4).run(_train, grads_of, 2, True):
        for got, want in zip(per_rank, expected, strict=True):
            tree_allclose(got, want, **TOL)


def test_hybrid_checkpoints_load_on_a_flat_world_and_back(tmp_path: Any) -> None:
    path, flat = str(tmp_path / "hybrid"), str(tmp_path / "flat")
    (saved, moments), *_ = ranks.world(4).run(_save, path, True)
    for got, got_moments, step in ranks.world(3).run(_load, path):
        tree_allclose(got, saved, rtol=0, atol=0)
        tree_allclose(got_moments, moments, rtol=0, atol=0)
        assert step == 2.0
    (saved, moments), *_ = ranks.world(2).run(_save, flat)
    for got, got_moments, step in ranks.world(4).run(_load, flat, True):
        tree_allclose(got, saved, rtol=0, atol=0)
        tree_allclose(got_moments, moments, rtol=0, atol=0)
        assert step == 2.0
