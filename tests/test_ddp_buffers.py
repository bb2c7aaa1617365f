"""DistributedDataParallel(broadcast_buffers=...): rank 0's buffers on every rank (_ddp_buffers).

Every body runs on spawned gloo ranks (tests/ranks.py). The reference for
buffers is torch's own DDP on the same module and data; for gradients, the
single-process average over ranks.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

import fdp
from tests import ranks
from tests.helpers import PER_RANK, TOL, batch, shard

STEPS = 5


def bn_module() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(), torch.nn.Linear(8, 3)
    )


def buffers_of(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state.items() if not v.requires_grad}


def _train(rank: int, size: int, broadcast: bool) -> dict[str, Any]:
    """STEPS SGD steps of the BatchNorm model with fdp DDP and with torch DDP, same data."""
    module = bn_module()
    state = {k: v.detach().clone().requires_grad_() for k, v in module.named_parameters()}
    state |= {k: v.clone() for k, v in module.named_buffers()}
    ddp = fdp.DistributedDataParallel(state, broadcast_buffers=broadcast)
    opt = torch.optim.SGD([v for v in state.values() if v.requires_grad], lr=0.1)
    torch_ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(module))
    torch_opt = torch.optim.SGD(torch_ddp.parameters(), lr=0.1)
    for step in range(STEPS):
        x, y = batch(size * PER_RANK, seed=step)
        x, y = shard(x, rank), shard(y, rank)
        torch.autograd.backward(F.mse_loss(functional_call(module, ddp(state), x), y))
        opt.step()
        opt.zero_grad()
        torch.autograd.backward(F.mse_loss(torch_ddp(x), y))
        torch_opt.step()
        torch_opt.zero_grad()
    trained = buffers_of(state)
    torch_trained = {k: v.clone() for k, v in torch_ddp.module.named_buffers()}
    # One more call, outside training. torch's DDP broadcasts there (its first
    # forward after a synchronised one does); fdp communicates nothing under
    # no_grad, so that one rank may evaluate alone: each rank keeps the
    # buffers its own last forward left, rank 0's being torch's.
    with torch.no_grad():
        ddp(state)
        torch_ddp.eval()
        torch_ddp(x)
    return {
        "trained": trained,
        "torch_trained": torch_trained,
        "synced": buffers_of(state),
        "torch_synced": dict(torch_ddp.module.named_buffers()),
        "params": {k: v.detach() for k, v in state.items() if v.requires_grad},
        "torch_params": {k: v.detach() for k, v in torch_ddp.module.named_parameters()},
    }


@pytest.mark.parametrize("size", [2, 3])
def test_batch_norm_buffers_match_torch_ddp_and_agree_across_ranks(size: int) -> None:
    results = ranks.world(size).run(_train, True)
    for r in results:
        for k, v in r["trained"].items():
            torch.testing.assert_close(v, r["torch_trained"][k], **TOL)
        for k, v in r["params"].items():
            torch.testing.assert_close(v, r["torch_params"][k], **TOL)
        for k, v in r["synced"].items():
            assert torch.equal(v, r["trained"][k]), k  # nothing communicated under no_grad
            torch.testing.assert_close(results[0]["synced"][k], r["torch_synced"][k], **TOL)


def test_without_broadcast_each_rank_keeps_its_own_buffers() -> None:
    first, second = ranks.world(2).run(_train, False)
    assert not torch.equal(first["synced"]["1.running_mean"], second["synced"]["1.running_mean"])
    # Gradients are averaged either way: the parameters agree.
    for k, v in first["params"].items():
        torch.testing.assert_close(v, second["params"][k], **TOL)


def functional_tree(rank: int) -> dict[str, Any]:
    """Params and rank-dependent buffers (float and integer) in one tree."""
    g = torch.Generator().manual_seed(0)
    return {
        "params": {"w": torch.randn(6, 3, generator=g).requires_grad_()},
        "buffers": {"scale": torch.full((3,), 1.0 + rank), "count": torch.tensor(10 * rank)},
    }


def functional_loss(tree: dict[str, Any], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = x @ tree["params"]["w"] * tree["buffers"]["scale"] + tree["buffers"]["count"]
    return F.mse_loss(out, y)


def _func_grad(rank: int, size: int, how: str) -> tuple[Any, Any]:
    torch._dynamo.reset()
    tree = functional_tree(rank)
    ddp = fdp.DistributedDataParallel(tree)
    x, y = batch(size * PER_RANK)
    x, y = shard(x, rank), shard(y, rank)
    if how == "func.grad":

        def loss(params: dict[str, Any]) -> torch.Tensor:
            return functional_loss(ddp({"params": params, "buffers": tree["buffers"]}), x, y)

        # Detached: torch.func.grad of a leaf that requires grad keeps its graph.
        grad = torch.func.grad(loss)(tree["params"])["w"].detach()
    else:
        compiled = torch.compile(
            lambda t: functional_loss(ddp(t), x, y), backend="aot_eager", fullgraph=True
        )
        torch.autograd.backward(compiled(tree))
        grad = tree["params"]["w"].grad
    return grad, tree["buffers"]


@pytest.mark.parametrize("how", ["func.grad", pytest.param("compile", marks=pytest.mark.compile)])
def test_buffers_broadcast_under_func_grad_and_compile(how: str) -> None:
    size = 2
    # Reference: every rank computes with rank 0's buffers, gradients averaged.
    ref = functional_tree(0)
    x, y = batch(size * PER_RANK)
    for r in range(size):
        torch.autograd.backward(functional_loss(ref, shard(x, r), shard(y, r)) / size)
    for grad, buffers in ranks.world(size).run(_func_grad, how):
        assert torch.equal(buffers["scale"], ref["buffers"]["scale"])
        assert torch.equal(buffers["count"], ref["buffers"]["count"])
        torch.testing.assert_close(grad, ref["params"]["w"].grad, **TOL)


def _broadcasts(rank: int, size: int) -> list[bool]:
    """Which of a sequence of calls gave this rank rank 0's buffers."""
    tree = functional_tree(rank)
    ddp = fdp.DistributedDataParallel(tree)
    seen = []
    for mode in ["sync", "no_sync", "no_sync", "no_grad", "sync"]:
        tree["buffers"]["scale"].fill_(1.0 + rank)
        if mode == "no_sync":
            with ddp.no_sync():
                ddp(tree)
        elif mode == "no_grad":
            with torch.no_grad():
                ddp(tree)
        else:
            ddp(tree)
        seen.append(bool(tree["buffers"]["scale"][0] == 1.0))
    return seen


def test_buffers_broadcast_on_every_synchronised_call() -> None:
    # As torch's DDP: not under no_sync or no_grad, which communicate nothing.
    for rank, seen in enumerate(ranks.world(2).run(_broadcasts)):
        assert seen == [True, rank == 0, rank == 0, rank == 0, True]


def _evaluate_alone(rank: int, size: int) -> list[torch.Tensor]:
    """Rank 0 validates alone (no_grad, a model with buffers); then both train a step."""
    tree = functional_tree(rank)
    ddp = fdp.DistributedDataParallel(tree)
    tree["buffers"]["scale"].fill_(1.0 + rank)
    out = []
    if rank == 0:
        with torch.no_grad():
            out.append(functional_loss(ddp(tree), *batch(4)).detach())
    tree["buffers"]["scale"].fill_(1.0 + rank)
    ddp(tree)  # a training call: rank 0's buffers everywhere
    out.append(tree["buffers"]["scale"].clone())
    return out


def test_one_rank_may_evaluate_alone() -> None:
    # torch's test_ddp_inference: before, rank 0 waited in the buffers' broadcast.
    results = ranks.world(2).run(_evaluate_alone)
    reference = functional_tree(0)
    reference["buffers"]["scale"].fill_(1.0)
    with torch.no_grad():
        expected = functional_loss(reference, *batch(4))
    torch.testing.assert_close(results[0][0], expected)
    for out in results:
        torch.testing.assert_close(out[-1], torch.ones_like(out[-1]))
