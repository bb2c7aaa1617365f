"""fdp._comm._differentiable's flat all-gather and reduce-scatter, compiled, against one process.

The flat collectives carry a dtype policy (:class:`fdp._comm._differentiable.Policy`):
what the gather carries, what the reduce-scatter carries, what it returns.
Where a cast is a no-op (every dtype the same) torch 2.11 silently zeroed the
gradient of a compiled Function that returned it (Note [no-op casts in traced
forwards]); these cases pin every policy, eager and compiled, to the gradient
one process computes from every rank's input.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from fdp._comm import _differentiable
from tests import ranks

# name: (param dtype, reduce dtype, grad dtype) for float64 inputs; None casts nothing
POLICIES = {
    "one dtype": (torch.float64, torch.float64, torch.float64),
    "float32 on the wire": (torch.float32, torch.float32, torch.float64),
    "none: the input's own": (None, None, None),
}


def _input(rank: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    return torch.randn(n, generator=g, dtype=torch.float64)


def _loss(out: torch.Tensor, rank: int) -> torch.Tensor:
    return (torch.sin(out * (0.5 + rank)) * out).sum()


def _reference(kind: str, xs: list[torch.Tensor], rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's output, its gradient) from every rank's input in one process."""
    leaves = [x.clone().requires_grad_() for x in xs]
    world = len(xs)
    if kind == "reduce_scatter":
        outs = list(torch.stack(leaves).sum(0).chunk(world))
    else:
        outs = [torch.cat(leaves)] * world
    torch.autograd.backward(torch.stack([_loss(o, q) for q, o in enumerate(outs)]).sum())
    grad = leaves[rank].grad
    assert grad is not None
    return outs[rank].detach(), grad


def _run(rank: int, size: int, kind: str, policy: str, compiled: bool) -> dict[str, Any]:
    n = 4 * size if kind == "reduce_scatter" else 4
    xs = [_input(q, n) for q in range(size)]
    flat = _differentiable.Policy(None, size, *POLICIES[policy])
    call = (
        _differentiable.reduce_scatter_flat
        if kind == "reduce_scatter"
        else _differentiable.all_gather_flat
    )

    def mine(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = call(x, flat)
        return out, _loss(out, dist.get_rank())

    leaf = xs[rank].clone().requires_grad_()
    if compiled:
        torch._dynamo.reset()
        out, loss = torch.compile(mine, backend="aot_eager", fullgraph=True)(leaf)
    else:
        out, loss = mine(leaf)
    torch.autograd.backward(loss)
    want_out, want_grad = _reference(kind, xs, rank)
    tol = 1e-5 if policy == "float32 on the wire" else 1e-12
    gather_dtype, _, out_dtype = POLICIES[policy]
    want_dtype = out_dtype if kind == "reduce_scatter" else gather_dtype
    return {
        # The gather returns what it carried; the reduce-scatter, the input's dtype.
        "dtype": out.dtype == (want_dtype or torch.float64),
        "output": torch.allclose(out.double(), want_out, atol=tol, rtol=tol),
        "gradient": leaf.grad is not None and torch.allclose(leaf.grad, want_grad, atol=tol),
    }


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("kind", ["reduce_scatter", "all_gather"])
def test_flat_collectives_match_one_process(kind: str, policy: str, compiled: bool) -> None:
    results = ranks.world(2).run(_run, kind, policy, compiled)
    for rank, checks in enumerate(results):
        assert all(checks.values()), f"rank {rank}: {checks}"


def _constants(rank: int, size: int) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """Each collective of an input that requires no grad: compiled, and in one process."""
    xs = [_input(q, 4 * size) for q in range(size)]
    policy = _differentiable.Policy(None, size)
    calls = {
        "psum": lambda x: _differentiable.psum(x, scale=0.5),
        "all_gather_flat": lambda x: _differentiable.all_gather_flat(x, policy),
        "reduce_scatter_flat": lambda x: _differentiable.reduce_scatter_flat(x, policy),
        "all_to_all_rows": lambda x: _differentiable.all_to_all_rows(x.view(size, -1), None),
        "replicated": lambda x: _differentiable.replicated(x, replicas=None, total=size),
    }
    whole = torch.stack(xs)
    wanted = {
        "psum": 0.5 * whole.sum(0),
        "all_gather_flat": whole.reshape(-1),
        "reduce_scatter_flat": whole.sum(0).chunk(size)[rank],
        "all_to_all_rows": whole.view(size, size, -1)[:, rank],
        "replicated": xs[rank],
    }
    torch._dynamo.reset()
    return [
        (name, torch.compile(call, backend="aot_eager", fullgraph=True)(xs[rank]), wanted[name])
        for name, call in calls.items()
    ]


def test_a_compiled_collective_of_a_tensor_that_requires_no_grad_is_the_plain_result() -> None:
    # Dynamo inlines a Function's forward when nothing requires grad, and
    # would hand a rule with *consts a ctx too many (torch 2.13).
    for results in ranks.world(2).run(_constants):
        for name, got, want in results:
            torch.testing.assert_close(got, want, msg=name)
