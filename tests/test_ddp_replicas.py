"""DDP's check that the ranks still hold the same parameters (fdp._ddp._replicas).

Ranks that step apart (here: each rank scales its step by its own loss, a
rank-local quantity where the global one was meant) train different models.
The check after every ``check_replicas_every``-th reduced backward raises on
every rank; ``fdp.save_checkpoint`` refuses to save such
parameters. Correct training is compared with one process on the whole batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import fdp
from tests import ranks
from tests.helpers import PER_RANK, TOL, batch, mlp, mlp_params, shard

STEPS = 4


def _loss(p: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(mlp(p, x), y)


def _train(rank: int, size: int, every: int, apart: bool) -> Any:
    """SGD steps; ``apart``: each rank's step scaled by its own loss."""
    params = mlp_params()
    ddp = fdp.DistributedDataParallel(params, check_replicas_every=every)
    try:
        for step in range(STEPS):
            x, y = (shard(t, rank) for t in batch(size * PER_RANK, seed=step))
            loss = _loss(ddp(params), x, y)
            torch.autograd.backward(loss)
            lr = 0.1 / (1 + loss.item()) if apart else 0.1
            with torch.no_grad():
                _sgd(params, lr)
    except ValueError as e:
        return step, str(e)
    return None, {k: t.detach() for k, t in enumerate(_leaves(params))}


def _sgd(params: Any, lr: float) -> None:
    for t in _leaves(params):
        if t.grad is not None:
            t -= lr * t.grad
            t.grad = None


def _leaves(params: Any) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(params) if t is not None]


def _reference(size: int) -> dict[int, torch.Tensor]:
    """One process: the average of the ranks' losses, on the whole batch."""
    params = mlp_params()
    for step in range(STEPS):
        x, y = batch(size * PER_RANK, seed=step)
        losses = [_loss(params, shard(x, r), shard(y, r)) for r in range(size)]
        torch.autograd.backward(torch.stack(losses).mean())
        with torch.no_grad():
            _sgd(params, 0.1)
    return {k: t.detach() for k, t in enumerate(_leaves(params))}


def test_ranks_trained_apart_raise_on_every_rank_at_the_check() -> None:
    # Before: no error; the ranks' parameters silently differed.
    for step, message in ranks.world(2).run(_train, 3, True):
        assert step == 2  # the third reduced backward
        assert message.startswith(
            "fdp.DistributedDataParallel: `params` leaf params['head'].first expected the "
            "same values on every rank after 3 reduced backwards; got different values"
        )
        assert "compute the loss from ddp(params) (not params)" in message


def test_without_the_check_the_ranks_diverge_silently() -> None:
    results: list[Any] = ranks.world(2).run(_train, 0, True)
    (step0, got0), (step1, got1) = results
    assert step0 is None
    assert step1 is None
    assert not torch.equal(got0[0], got1[0])


@pytest.mark.parametrize("every", [1, 100])
def test_ranks_that_train_together_pass_the_check(every: int) -> None:
    expected = _reference(2)
    for step, got in ranks.world(2).run(_train, every, False):
        assert step is None
        for k, t in expected.items():
            torch.testing.assert_close(got[k], t, **TOL)


def _frozen_on_one_rank(rank: int, size: int, hooked: bool) -> Any:
    """Rank 0 freezes the head after the first step; rank 1 trains it on."""
    params = mlp_params()
    ddp = fdp.DistributedDataParallel(params, check_replicas_every=2)
    if hooked:  # the usage counts in an all-reduce of their own, not riding a bucket
        ddp.register_comm_hook(None, fdp.allreduce_hook)
    try:
        for step in range(STEPS):
            if step == 1 and rank == 0:
                params["head"].first.requires_grad_(False)
            x, y = (shard(t, rank) for t in batch(size * PER_RANK, seed=step))
            torch.autograd.backward(_loss(ddp(params), x, y))
            with torch.no_grad():
                _sgd(params, 0.1)
    except ValueError as e:
        return step, str(e)
    return None, None


@pytest.mark.parametrize("hooked", [False, True], ids=["default", "comm_hook"])
def test_a_leaf_frozen_on_one_rank_only_is_caught_at_the_check(hooked: bool) -> None:
    # Before, the check fingerprinted the leaves each rank's backward reduced
    # (rank 0 one fewer): the ranks' payloads differed, and gloo aborted. With a
    # comm hook the usage counts had one slot per leaf the rank's call reduced:
    # rank 0's all-reduce was shorter, and both waited until the timeout.
    for step, message in ranks.world(2).run(_frozen_on_one_rank, hooked):
        assert step == 3  # the fourth reduced backward: rank 1 stepped the head twice
        assert message.startswith(
            "fdp.DistributedDataParallel: `params` leaf params['head'].first expected the "
            "same values on every rank after 4 reduced backwards; got different values"
        )


def _sparse_frozen_on_one_rank(rank: int, size: int) -> Any:
    """An embedding with sparse gradients that rank 0 freezes after the first step."""
    g = torch.Generator().manual_seed(0)
    params = {
        "embed": torch.randn(10, 4, generator=g).requires_grad_(),
        "w": torch.randn(4, generator=g).requires_grad_(),
    }
    ddp = fdp.DistributedDataParallel(params, check_replicas_every=2)
    try:
        for step in range(STEPS):
            if step == 1 and rank == 0:
                params["embed"].requires_grad_(False)
            p = ddp(params)
            rows = torch.nn.functional.embedding(
                torch.tensor([rank, 3, step]), p["embed"], sparse=True
            )
            torch.autograd.backward((rows * p["w"]).sum())
            with torch.no_grad():
                _sgd(params, 0.1)
    except ValueError as e:
        return step, str(e)
    return None, None


def test_a_sparse_table_frozen_on_one_rank_only_is_caught_at_the_check() -> None:
    # Before, rank 0 skipped the sparse all-reduce rank 1 made: both waited for the timeout.
    for step, message in ranks.world(2).run(_sparse_frozen_on_one_rank):
        assert step == 3
        assert message.startswith(
            "fdp.DistributedDataParallel: `params` leaf params['embed'] expected the same "
            "values on every rank after 4 reduced backwards; got different values"
        )


def _own_buffer(rank: int, size: int) -> Any:
    """A buffer each rank's forward updates from its own batch, as BatchNorm's statistics."""
    params: dict[str, Any] = {**mlp_params(), "seen": torch.zeros(())}
    ddp = fdp.DistributedDataParallel(params, check_replicas_every=1)
    first: list[torch.Tensor] = []
    for step in range(STEPS):
        x, y = (shard(t, rank) for t in batch(size * PER_RANK, seed=step))
        p = ddp(params)
        with torch.no_grad():
            p["seen"].add_(x.mean())  # this rank's data: the ranks' buffers differ now
        loss = _loss(p, x, y)
        torch.autograd.backward(loss)
        if not first:
            first = [
                loss.detach(),
                *(t.grad.clone() for t in _leaves(params) if t.grad is not None),
            ]
        with torch.no_grad():
            _sgd(params, 0.1)
    return first


def test_buffers_that_each_rank_updates_are_not_compared() -> None:
    # The check compares what were parameters at construction, never the buffers
    # (a version that compared every bucketed leaf raised here at the first check).
    params = mlp_params()
    x, y = batch(2 * PER_RANK, seed=0)
    losses = [_loss(params, shard(x, r), shard(y, r)) for r in range(2)]
    torch.autograd.backward(torch.stack(losses).mean())
    grads = [t.grad for t in _leaves(params) if t.grad is not None]
    for rank, got in enumerate(ranks.world(2).run(_own_buffer)):
        expected = [losses[rank].detach(), *grads]  # this rank's loss, the mean gradients
        assert len(got) == len(expected)
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g, e, **TOL)


def _save(rank: int, size: int, path: str, apart: bool) -> str | None:
    params = mlp_params()
    if apart:
        with torch.no_grad():
            params["layers"][1]["b"].add_(rank)
    try:
        fdp.save_checkpoint(path, {"params": params, "steps": torch.tensor(7)})
    except ValueError as e:
        return str(e)
    like: dict[str, Any] = {"params": mlp_params(seed=1), "steps": torch.tensor(0)}
    loaded = fdp.load_checkpoint(path, like)
    assert torch.equal(loaded["params"]["layers"][1]["b"], params["layers"][1]["b"])
    return None


def test_save_checkpoint_refuses_parameters_that_differ_across_ranks(tmp_path: Path) -> None:
    # Before, rank 0's parameters were written and the other ranks' lost silently.
    for message in ranks.world(2).run(_save, str(tmp_path / "apart"), True):
        assert message is not None
        assert message.startswith(
            "fdp.save_checkpoint: `state` leaf state['params']['layers'][1]['b'] is written "
            "once, from rank 0, so it expected the same values on every rank; got different "
            "values on different ranks"
        )
        assert "Probably parameters that trained apart" in message
    # Every entry agrees (a module's buffers that differ: test_checkpoint.py).
    assert ranks.world(2).run(_save, str(tmp_path / "together"), False) == [None, None]


def _bad_every(rank: int, size: int) -> str:
    with pytest.raises(ValueError, match="check_replicas_every") as info:
        fdp.DistributedDataParallel(mlp_params(), check_replicas_every=-1)
    return str(info.value)


def test_a_bad_check_interval_is_refused_by_name() -> None:
    for message in ranks.world(2).run(_bad_every):
        assert message == (
            "fdp.DistributedDataParallel: `check_replicas_every` expected an int >= 0 "
            "(0: never); got -1"
        )
