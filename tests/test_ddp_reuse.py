"""``ddp(params)`` with the tensors of its last call hands that call's aliases out again.

Note [reused aliases] in fdp/_ddp/_reuse.py. Each case trains three SGD
steps on 2 gloo ranks, calling ``ddp(params)`` every step, and compares the
parameters with one process's steps on the full batch. What the cases change
between steps (a leaf moved to new memory, a hook, ``retain_grad`` or an
in-place op on an output, a leaf frozen) must give the next call aliases of its own; the
records say which calls reused; each step's gradients and the final
parameters equal the reference's.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch
from torch import nn

import fdp
from tests import ranks
from tests.helpers import PER_RANK, TINY, TOL, batch, shard

STEPS = 3


def _params(kind: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    made = {k: torch.randn(6, 6, generator=g) / 3 for k in ("w0", "w1", "w2")}
    if kind == "tensors":  # plain tensors: never kept (they could be fresh each step)
        return {k: v.requires_grad_() for k, v in made.items()}
    return {k: nn.Parameter(v) for k, v in made.items()}


def _loss(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    h = x
    for k in ("w0", "w1", "w2"):
        h = torch.tanh(h @ p[k])
    return h.square().mean()


def _x(step: int, size: int) -> torch.Tensor:
    return batch(size * PER_RANK, seed=step)[0]


def _between(case: str, step: int, params: dict[str, torch.Tensor]) -> None:
    """What the case changes before step 1's call (same values: the reference is unchanged)."""
    if step != 1:
        return
    if case == "moved":
        params["w1"].data = params["w1"].data.clone()
    elif case == "frozen":
        params["w0"].requires_grad_(False)


def _trained(rank: int, size: int, case: str) -> dict[str, Any]:
    params = _params("tensors" if case == "tensors" else "parameters")
    ddp = fdp.DistributedDataParallel(params, **TINY)
    opt = torch.optim.SGD(params.values(), lr=0.5)
    calls: list[int] = []
    reused: list[bool] = []
    grads: list[dict[str, torch.Tensor | None]] = []
    last: dict[str, torch.Tensor] | None = None
    for step in range(STEPS):
        _between(case, step, params)
        x = shard(_x(step, size), rank)
        opt.zero_grad()
        if case == "inside_jvp" and step == 1:  # ddp(params) where jvp transforms x
            armed, loss = _inside_jvp(ddp, params, x)
        else:
            armed = ddp(params)
        reused.append(last is not None and armed["w2"] is last["w2"])
        if case == "hooked" and step == 0:
            armed["w2"].register_hook(lambda g, step=step: calls.append(step))  # type: ignore[no-untyped-call]
        if case == "retained" and step == 0:
            armed["w2"].retain_grad()
        if case == "in_place" and step == 0:  # the output's node becomes MulBackward0
            armed["w2"].mul_(1.0)
        if case == "two_forwards":  # two calls, then two backwards, each reduced
            again = ddp(params)
            reused.append(again["w2"] is armed["w2"])
            first, second = _loss(armed, x), _loss(again, shard(_x(step + 10, size), rank))
            torch.autograd.backward(first)
            torch.autograd.backward(second)
        else:
            torch.autograd.backward(loss if case == "inside_jvp" and step == 1 else _loss(armed, x))
        grads.append(_grads(params))
        opt.step()
        last = armed
    out = {"params": {k: v.detach() for k, v in params.items()}, "grads": grads}
    return out | {"reused": reused, "calls": calls}


def _inside_jvp(
    ddp: fdp.DistributedDataParallel, params: dict[str, torch.Tensor], x: torch.Tensor
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    seen: dict[str, torch.Tensor] = {}

    def f(x: torch.Tensor) -> torch.Tensor:
        seen.update(ddp(params))
        return _loss(seen, x)

    loss: torch.Tensor = torch.func.jvp(f, (x,), (torch.ones_like(x),))[0]
    return seen, loss


def _grads(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
    return {k: None if v.grad is None else v.grad.clone() for k, v in params.items()}


def _reference(case: str, size: int) -> dict[str, Any]:
    params = _params("parameters")
    opt = torch.optim.SGD(params.values(), lr=0.5)
    grads = []
    for step in range(STEPS):
        _between(case, step, params)
        opt.zero_grad()
        xs = [_x(step, size)] + ([_x(step + 10, size)] if case == "two_forwards" else [])
        for x in xs:
            losses = [_loss(params, shard(x, r)) for r in range(size)]
            torch.autograd.backward(torch.stack(losses).mean())
        grads.append(_grads(params))
        opt.step()
    return {"params": {k: v.detach() for k, v in params.items()}, "grads": grads}


# Which calls get the last call's aliases back: step 1's and 2's, except where
# the case changed something before step 1 (it makes its own; step 2 reuses them).
REUSED = {
    "same": [False, True, True],
    "moved": [False, False, True],
    "frozen": [False, False, True],
    "hooked": [False, False, True],
    "retained": [False, False, True],
    "in_place": [False, False, True],
    "tensors": [False, False, False],
    # Under a transform the call makes plain aliases and keeps nothing.
    "inside_jvp": [False, False, False],
    # Per step: the second call reuses the first's; the next step's first call
    # reuses the last step's aliases.
    "two_forwards": [False, True, True, True, True, True],
}


@pytest.mark.parametrize("case", list(REUSED))
def test_a_call_with_the_last_calls_tensors_reuses_its_aliases_and_reduces(case: str) -> None:
    size = 2
    expected = _reference(case, size)
    for got in ranks.world(size).run(_trained, case):
        assert got["reused"] == REUSED[case]
        for step, (g, e_grads) in enumerate(zip(got["grads"], expected["grads"], strict=True)):
            for key, e in e_grads.items():  # None where the reference has none (frozen)
                if e is None:
                    assert g[key] is None, (step, key)
                else:
                    torch.testing.assert_close(g[key], e, **TOL, msg=f"step {step} {key}")
        for key, e in expected["params"].items():
            torch.testing.assert_close(got["params"][key], e, **TOL, msg=key)
        if case == "hooked":  # a hook on step 0's output ran in step 0's backward only
            assert got["calls"] == [0]


def _dropped(rank: int, size: int, hook: str) -> dict[str, bool]:
    """Three steps, then the DDP dropped: does anything keep it, or its parameters?"""
    net = nn.Linear(6, 6)
    fn, state = fdp.make_functional(net)
    ddp = fdp.DistributedDataParallel(state, **TINY)
    if hook == "fdp's bf16 hook":
        ddp.register_comm_hook(None, fdp.bf16_compress_hook)
    elif hook == "a hook whose state holds the DDP":

        def mine(state: list[Any], bucket: fdp.GradBucket) -> torch.futures.Future[torch.Tensor]:
            assert state[0].buckets
            return fdp.allreduce_hook(None, bucket)

        ddp.register_comm_hook([ddp], mine)
    for step in range(STEPS):
        torch.autograd.backward(fn(ddp(state), shard(_x(step, size)[:, :6], rank)).sum())
    refs: dict[str, weakref.ref[Any]] = {"ddp": weakref.ref(ddp), "weight": weakref.ref(net.weight)}
    del ddp, fn, state, net
    gc.collect()
    return {name: ref() is not None for name, ref in refs.items()}


@pytest.mark.parametrize("hook", ["none", "fdp's bf16 hook", "a hook whose state holds the DDP"])
def test_a_dropped_ddp_and_its_parameters_are_freed(hook: str) -> None:
    # The aliases' node refers to the reducer through C++, which Python's
    # collector cannot follow: the kept aliases must not close a cycle.
    for alive in ranks.world(2).run(_dropped, hook):
        assert alive == {"ddp": False, "weight": False}
