"""fdp.clear_caches: what fdp keeps between calls can be released, and results stay the same."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import torch

import fdp
from fdp._comm import _tree_collectives
from tests import ranks


def _plans_released(rank: int, size: int) -> Any:
    grads = {"w": torch.full((1000,), float(rank))}
    first = fdp.all_reduce_grads(grads)["w"].clone()
    planned = len(_tree_collectives._plans)
    kept = [
        b for p in _tree_collectives._plans.values() for b in p.layout._buffers if b is not None
    ]
    buffers = [weakref.ref(b) for b in kept]
    del kept
    fdp.clear_caches()
    gc.collect()
    released = all(ref() is None for ref in buffers)
    again = fdp.all_reduce_grads(grads)["w"]  # plans again, same result
    return planned, len(buffers), released, first, again


def test_clear_caches_releases_plans_and_buffers() -> None:
    for planned, n_buffers, released, first, again in ranks.world(2).run(_plans_released):
        assert planned >= 1
        assert n_buffers >= 1
        assert released  # no result viewed them any more
        torch.testing.assert_close(first, torch.full((1000,), 0.5))
        torch.testing.assert_close(again, first)


def test_clear_caches_without_a_process_group() -> None:
    fdp.clear_caches()  # nothing to release, nothing to raise
    x = torch.randn(6, 3)
    w = torch.randn(3, 2, requires_grad=True)
    out = fdp.data_parallel(lambda p, x: x @ p, w, x, devices=["cpu", "cpu"])
    torch.testing.assert_close(out, x @ w)
