"""FullyShardedDataParallel.optimizer: param_groups over the shards (_fsdp_optim.py).

Against the grouped step on the unsharded tree.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import fdp
from tests import ranks
from tests.helpers import tree_allclose
from tests.test_fsdp import (
    TOL,
    _by_func_grad,
    _detached,
    data,
    make_optimizer,
    make_params,
    mine,
    reference,
)


@pytest.mark.parametrize(
    ("donate", "kind"), [(False, "grouped"), (True, "grouped"), (False, "mixed")]
)
def test_param_groups_over_the_shards_label_each_piece_by_its_leaf(donate: bool, kind: str) -> None:
    # Before, every shard is 1-D, so "t.ndim <= 1" put everything in no_decay
    # and weight decay silently disappeared (2.9e-2 off after one step).
    # "mixed": SGD's momentum on the vectors, AdamW's moments on the rest.
    size, steps = 2, 2
    expected = reference(size, steps, kind)
    for per_step in ranks.world(size).run(_train_grouped, steps, donate, kind):
        for got, want in zip(per_step, expected, strict=True):
            tree_allclose(got, {k: want[k] for k in got}, **TOL)


def _train_grouped(rank: int, size: int, steps: int, donate: bool, kind: str) -> list[Any]:
    params = make_params()
    fsdp = fdp.FullyShardedDataParallel(params)
    shards = _detached(fsdp.shard(params))
    opt = fsdp.optimizer(make_optimizer(kind))
    state = opt.init(shards)
    x, y = data(size)
    out = []
    for _ in range(steps):
        grads = _by_func_grad(fsdp, shards, mine(x, rank), mine(y, rank))
        grads = {k: tuple(g if k != "frozen" else None for g in gs) for k, gs in grads.items()}
        shards, state = opt.update(grads, state, shards, donate=donate)
        full = fsdp.full(shards)
        out.append({k: full[k] for k in ("embed", "blocks", "conv", "head")})
    return out


def _grouped_directly(rank: int, size: int) -> list[str]:
    """param_groups with a label function stepping shards directly: refused, every time."""
    params = make_params()
    fsdp = fdp.FullyShardedDataParallel(params)
    shards = fsdp.shard(params)
    grouped = make_optimizer("grouped")
    x, y = data(size)
    grads = _by_func_grad(fsdp, _detached(shards), mine(x, rank), mine(y, rank))
    errors = []
    for tree in (shards, _detached(shards)):  # as shard() gives them, and detached
        try:
            grouped.update(grads, grouped.init(tree), tree)
        except ValueError as e:
            errors.append(str(e))
    # A tree that is not these shards is labelled as before.
    plain = {"w": torch.ones(2, 2), "b": torch.ones(2)}
    grouped.update(plain, grouped.init(plain), plain)
    return errors


def test_param_groups_refuse_shards_and_name_fsdp_optimizer() -> None:
    # Each shard is a 1-D slice of several leaves: t.ndim <= 1 would label every one
    # no-decay (parameters off by 2.9e-2 after one step), so the direct use is refused.
    for errors in ranks.world(2).run(_grouped_directly):
        assert len(errors) == 2, errors
        for error in errors:
            assert error.startswith("fdp.optim.param_groups: `params` are the shards of"), error
            assert "fsdp.optimizer(fdp.optim.param_groups(...))" in error
