"""FullyShardedDataParallel.no_sync (accumulation without communication) and per-unit dtypes.

Against one process: the gradient of the mean over ranks of every
micro-batch's loss, as ``tests/test_fsdp.py``'s reference computes it.
"""

from __future__ import annotations

import contextlib
from typing import Any
from unittest import mock

import pytest
import torch

import fdp
from fdp._comm import _raw
from tests import ranks
from tests.helpers import tree_allclose
from tests.test_fsdp import (
    ROWS,
    TOL,
    Shards,
    data,
    local_loss,
    make_params,
    mine,
    reference_grad,
)


def micro_batches_loss(params: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The sum of the losses of each row as its own micro-batch."""
    return torch.stack([local_loss(params, x[i : i + 1], y[i : i + 1]) for i in range(ROWS)]).sum()


def _grads(shards: Shards) -> Shards:
    return {
        k: tuple(torch.zeros_like(t) if t.grad is None else t.grad for t in ts)
        for k, ts in shards.items()
    }


def _accumulate(rank: int, size: int, accumulate: bool, path: str) -> Any:
    """Every row a micro-batch; all but the last inside no_sync when ``accumulate``."""
    params = make_params()
    fsdp = fdp.FullyShardedDataParallel(params)
    shards = fsdp.shard(params)
    x, y = mine(data(size)[0], rank), mine(data(size)[1], rank)
    scattered = []
    real = _raw.reduce_scatter

    def counting(t: torch.Tensor, **kw: Any) -> torch.Tensor:
        scattered.append(t.numel() * t.element_size())
        return real(t, **kw)

    def tree() -> Any:
        if path == "call":
            return fsdp(shards)
        # Unit by unit (prefetching the next), put together as the params tree.
        tree: dict[str, Any] = {"count": params["count"], "blocks": [None] * 3}
        for name in fsdp.unit_names:
            top, _, index = name.partition(".")
            if index:
                tree[top][int(index)] = fsdp.gather(shards, name)
            else:
                tree[top] = fsdp.gather(shards, name)
        tree["unembed"] = tree["embed"]  # tied
        return tree

    with mock.patch.object(_raw, "reduce_scatter", counting):
        for i in range(ROWS):
            held = accumulate and i < ROWS - 1
            with fsdp.no_sync() if held else contextlib.nullcontext():
                torch.autograd.backward(local_loss(tree(), x[i : i + 1], y[i : i + 1]))
    return fsdp.full(_grads(shards)), sum(scattered), len(scattered)


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("path", ["call", "gather"])
def test_no_sync_accumulates_micro_batches_with_one_reduce_scatter(size: int, path: str) -> None:
    expected = reference_grad(size, micro_batches_loss)
    expected = {**expected, "frozen": torch.zeros_like(expected["frozen"])}  # no grad wanted
    synced = ranks.world(size).run(_accumulate, False, path)
    held = ranks.world(size).run(_accumulate, True, path)
    for (got_synced, bytes_synced, n_synced), (got_held, bytes_held, n_held) in zip(
        synced, held, strict=True
    ):
        tree_allclose(got_synced, expected, **TOL)
        tree_allclose(got_held, expected, **TOL)
        assert n_synced == ROWS * n_held  # one reduce-scatter per buffer, not per micro-batch
        assert bytes_synced == ROWS * bytes_held


def _refused(rank: int, size: int, how: str) -> str:
    params = make_params()
    fsdp = fdp.FullyShardedDataParallel(params)
    shards = fsdp.shard(params)
    x, y = mine(data(size)[0], rank), mine(data(size)[1], rank)
    try:
        with fsdp.no_sync():
            if how == "grad":
                torch.func.grad(lambda s: local_loss(fsdp(s), x, y))(shards)
            elif how == "fdp.grad":
                # Before: zeros came back (the gradient was kept), and the next
                # call's result held two micro-batches' sum.
                fdp.grad(lambda s: local_loss(fsdp(s), x, y))(shards)
            elif how == "autograd.grad":
                # Before: None for every shard (or "not used in the graph"), and
                # the next call's gradients held two micro-batches' sum.
                leaves = [t.requires_grad_() for ts in shards.values() for t in ts]
                torch.autograd.grad(local_loss(fsdp(shards), x, y), leaves, allow_unused=True)
            elif how == "compiled":
                compiled = torch.compile(lambda s: local_loss(fsdp(s), x, y), fullgraph=True)
                compiled(shards)
            else:
                with fsdp.no_sync():
                    pass
    except Exception as e:  # dynamo wraps the error while compiling
        return str(e)
    return "no error"


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("grad", "under a torch.func transform"),
        ("fdp.grad", "under a torch.func transform or fdp.grad"),
        ("autograd.grad", "torch.autograd.grad of the shards inside no_sync()"),
        ("compiled", "while torch.compile traces"),
        ("nested", "already inside no_sync"),
    ],
)
def test_no_sync_refuses_what_cannot_keep_gradients(how: str, message: str) -> None:
    for error in ranks.world(2).run(_refused, how):
        assert message in error


def _per_unit(rank: int, size: int) -> Any:
    params = make_params()
    fsdp = fdp.FullyShardedDataParallel(
        params,
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
        unit_dtypes={"head": torch.float32, "conv": (None, torch.float32), "frozen": None},
    )
    x, y = mine(data(size)[0], rank), mine(data(size)[1], rank)
    shards = {k: tuple(t.detach() for t in ts) for k, ts in fsdp.shard(params).items()}
    gathered = fsdp(shards)
    grads = torch.func.grad(lambda s: _mixed_loss(fsdp(s), x, y))(shards)
    dtypes = {
        "head": gathered["head"]["w"].dtype,
        "conv": gathered["conv"].dtype,
        "embed": gathered["embed"].dtype,
    }
    return fsdp.full(grads), dtypes


def _mixed_loss(params: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The model with a bfloat16 body and a float32 head and conv (each as gathered)."""
    body = {k: v for k, v in params.items() if k not in ("head", "conv", "frozen")}
    low = torch.utils._pytree.tree_map(
        lambda t: t.bfloat16() if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
        body,
    )
    whole = {**params, **low, "unembed": low["embed"]}
    h = x.bfloat16() @ whole["embed"]
    for block in whole["blocks"]:
        h = torch.tanh(h @ block["w"] + block["b"])
    h = torch.tanh(h.float() @ whole["conv"].flatten(1).T)
    phase = whole["head"]["phase"].abs().to(h.dtype)
    out = h @ whole["head"]["w"] + phase + whole["frozen"]
    tied = (out @ whole["unembed"][:3, :3].float()) * 0.1 * whole["count"]
    loss: torch.Tensor = (out + tied - y).square().mean()
    return loss


def test_a_float32_head_on_a_bfloat16_body_is_gathered_and_reduced_per_unit() -> None:
    size = 2
    expected = reference_grad(size, _mixed_loss)
    for grads, dtypes in ranks.world(size).run(_per_unit):
        assert dtypes == {"head": torch.float32, "conv": torch.float32, "embed": torch.bfloat16}
        tree_allclose(grads, expected, rtol=1e-5, atol=1e-6)


def _bad_unit_dtypes(rank: int, size: int) -> list[str]:
    errors = []
    for bad in ({"nope": torch.float32}, {"head": torch.int32}, {"head": (torch.float32,)}, [1]):
        try:
            fdp.FullyShardedDataParallel(make_params(), unit_dtypes=bad)  # type: ignore[arg-type]
        except (TypeError, ValueError) as e:
            errors.append(f"{type(e).__name__}: {e}")
    return errors


def test_unit_dtypes_are_checked() -> None:
    for errors in ranks.world(2).run(_bad_unit_dtypes):
        assert len(errors) == 4
        assert (
            "ValueError: fdp.FullyShardedDataParallel: `unit_dtypes` key expected one of"
            in errors[0]
        )
        assert (
            "TypeError: fdp.FullyShardedDataParallel: `unit_dtypes['head']` expected" in errors[1]
        )
        assert "`unit_dtypes['head']` expected a floating-point dtype" in errors[2]
        assert "`unit_dtypes` expected a dict" in errors[3]
