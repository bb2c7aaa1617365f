"""A forgotten ``ddp(params)`` (fdp/_ddp/_forgotten.py): caught at the first backward.

A loss computed from ``params`` instead of ``ddp(params)`` trains each rank
on its own gradients. The first backward that accumulates into DDP's leaves
before any call reduced raises on every rank that runs it; ``no_sync``
sanctions a local backward; after the first reduced call nothing is
checked any more (no hook is left), and local backwards are what they were.
"""

from __future__ import annotations

from typing import Any

import torch

import fdp
from tests import ranks


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def _x(rank: int, step: int) -> torch.Tensor:
    return torch.randn(5, 3, generator=torch.Generator().manual_seed(10 * step + rank))


def _forgotten(rank: int, size: int) -> Any:
    net = _model()
    fn, state = fdp.make_functional(net)
    ddp = fdp.DistributedDataParallel(state)  # built, then never called
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    try:
        torch.autograd.backward(fn(state, _x(rank, 0)).square().sum())  # ddp(state) forgotten
        opt.step()
    except ValueError as e:
        return str(e)
    return f"trained apart ({ddp})"


def test_a_loss_from_params_instead_of_ddp_params_raises_at_the_first_backward() -> None:
    for said in ranks.world(2).run(_forgotten):
        assert said.startswith("fdp.DistributedDataParallel: a backward accumulated into"), said
        assert "`params` leaf params['" in said, said
        assert "not ddp(params)" in said, said
        assert "ddp.no_sync()" in said, said


def _sanctioned(rank: int, size: int) -> Any:
    net = _model()
    fn, state = fdp.make_functional(net)
    ddp = fdp.DistributedDataParallel(state)
    params = list(net.parameters())
    # Not accumulated (returned): nothing to check.
    returned = torch.autograd.grad(fn(state, _x(rank, 0)).sum(), params)
    with ddp.no_sync():  # local on purpose, before any reduced call
        torch.autograd.backward(fn(state, _x(rank, 1)).square().sum())
    local = [p.grad.clone() for p in params if p.grad is not None]
    torch.autograd.backward(fn(ddp(state), _x(rank, 2)).square().sum())  # folds the local one
    reduced = [p.grad.clone() for p in params if p.grad is not None]
    hooks = [getattr(p, "_post_accumulate_grad_hooks", None) for p in params]
    for p in params:
        p.grad = None
    torch.autograd.backward(fn(state, _x(rank, 3)).square().sum())  # local, after a DDP step
    after = [p.grad for p in params]
    return returned, local, reduced, hooks, after


def _reference_grads(xs: list[torch.Tensor], scale: float = 1.0) -> list[torch.Tensor]:
    """One process: the gradient of the sum of ``scale`` times each batch's loss."""
    net = _model()
    loss = sum((net(x).square().sum() * scale for x in xs), torch.zeros(()))
    return list(torch.autograd.grad(loss, list(net.parameters())))


def _linear_grads(x: torch.Tensor) -> list[torch.Tensor]:
    net = _model()
    return list(torch.autograd.grad(net(x).sum(), list(net.parameters())))


def test_no_sync_and_local_backwards_after_a_reduced_call_are_left_alone() -> None:
    size = 2
    results = ranks.world(size).run(_sanctioned)
    # Every rank's no_sync gradient and its step-2 gradient, averaged over ranks.
    mean = _reference_grads([_x(r, s) for r in range(size) for s in (1, 2)], 1 / size)
    for rank, (returned, local, reduced, hooks, after) in enumerate(results):
        pairs = [
            (returned, _linear_grads(_x(rank, 0))),
            (local, _reference_grads([_x(rank, 1)])),
            (reduced, mean),
            (after, _reference_grads([_x(rank, 3)])),
        ]
        for got, want in pairs:
            assert len(got) == len(want)
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w)
        assert all(not h for h in hooks), hooks  # removed after the first reduced call
