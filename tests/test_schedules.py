"""Learning-rate schedules (fdp.optim._schedules) against torch's schedulers.

The reference is ``torch.optim.AdamW``/``SGD`` driven by torch's
``LinearLR``, ``CosineAnnealingLR`` and ``SequentialLR``: the rate of each
update, and the parameters after every update. A schedule is a function of
the optimizer state's step, so a run resumed from a saved state takes the
same rates as an uninterrupted one (bitwise), and a compiled update traces
once for every step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import fdp

STEPS, WARMUP, LR = 12, 4, 0.05


def torch_scheduler(opt: torch.optim.Optimizer, kind: str) -> Any:
    sched = torch.optim.lr_scheduler
    if kind == "linear":
        return sched.LinearLR(opt, start_factor=0.1, end_factor=1.0, total_iters=WARMUP)
    if kind == "cosine":
        return sched.CosineAnnealingLR(opt, T_max=STEPS, eta_min=0.001)
    warm = sched.LinearLR(opt, start_factor=0.1, end_factor=1.0, total_iters=WARMUP)
    cos = sched.CosineAnnealingLR(opt, T_max=STEPS - WARMUP, eta_min=0.001)
    return sched.SequentialLR(opt, [warm, cos], milestones=[WARMUP])


def fdp_schedule(kind: str) -> Callable[[torch.Tensor], torch.Tensor]:
    o = fdp.optim
    if kind == "linear":
        return o.linear_schedule(0.1 * LR, LR, WARMUP)
    if kind == "cosine":
        return o.cosine_decay_schedule(LR, STEPS, alpha=0.001 / LR)
    return o.warmup_cosine_decay_schedule(0.1 * LR, LR, WARMUP, STEPS, end_value=0.001)


def params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}


def grad_at(step: int, p: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A gradient that depends on the parameters and the step (a quadratic's, shifted)."""
    return {k: v * (1 + step % 3) - 0.1 * step for k, v in p.items()}


def torch_run(kind: str, optimizer: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    p = {k: v.clone().requires_grad_() for k, v in params().items()}
    cls = torch.optim.AdamW if optimizer == "adamw" else torch.optim.SGD
    opt = cls(p.values(), lr=LR)
    sched = torch_scheduler(opt, kind)
    rates = []
    for step in range(STEPS):
        rates.append(opt.param_groups[0]["lr"])
        for k, g in grad_at(step, {k: v.detach() for k, v in p.items()}).items():
            p[k].grad = g
        opt.step()
        sched.step()
    return rates, {k: v.detach() for k, v in p.items()}


def fdp_optimizer(kind: str, optimizer: str) -> Any:
    lr = fdp_schedule(kind)
    return fdp.optim.adamw(lr) if optimizer == "adamw" else fdp.optim.sgd(lr)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("kind", ["linear", "cosine", "warmup_cosine"])
def test_schedules_step_as_torchs_schedulers(kind: str, optimizer: str) -> None:
    expected_rates, expected = torch_run(kind, optimizer)
    schedule = fdp_schedule(kind)
    rates = [float(schedule(torch.tensor(n, dtype=torch.float64))) for n in range(STEPS)]
    for got, want in zip(rates, expected_rates, strict=True):
        assert math.isclose(got, want, rel_tol=1e-12, abs_tol=1e-15)
    opt = fdp_optimizer(kind, optimizer)
    p = params()
    state = opt.init(p)
    for step in range(STEPS):
        p, state = opt.update(grad_at(step, p), state, p)
    for k, v in expected.items():
        torch.testing.assert_close(p[k], v, rtol=1e-6, atol=1e-7)


def test_a_resumed_run_takes_the_same_rates_bitwise(tmp_path: Path) -> None:
    opt = fdp_optimizer("warmup_cosine", "adamw")
    p = params()
    state = opt.init(p)
    for step in range(STEPS):
        p, state = opt.update(grad_at(step, p), state, p)
    # The same run, saved after 5 steps and resumed in a fresh optimizer.
    q = params()
    first = fdp_optimizer("warmup_cosine", "adamw")
    q_state = first.init(q)
    for step in range(5):
        q, q_state = first.update(grad_at(step, q), q_state, q)
    fdp.save_checkpoint(str(tmp_path), {"params": q, "opt": q_state}, rng=False)
    resumed = fdp_optimizer("warmup_cosine", "adamw")
    like = {"params": params(), "opt": resumed.init(params())}
    loaded = fdp.load_checkpoint(str(tmp_path), like, rng=False)
    q, q_state = loaded["params"], loaded["opt"]
    for step in range(5, STEPS):
        q, q_state = resumed.update(grad_at(step, q), q_state, q)
    for k in p:
        assert torch.equal(q[k], p[k]), k


@pytest.mark.compile
def test_a_compiled_update_with_a_schedule_compiles_once() -> None:
    torch._dynamo.reset()
    frames: list[Any] = []

    def backend(gm: torch.fx.GraphModule, example: Any) -> Any:
        frames.append(gm)
        return gm.forward

    opt = fdp_optimizer("warmup_cosine", "adamw")
    update: Any = torch.compile(opt.update, backend=backend, fullgraph=True)
    p, q = params(), params()
    state, q_state = opt.init(p), opt.init(q)
    for step in range(STEPS):
        p, state = update(grad_at(step, p), state, p)
        q, q_state = opt.update(grad_at(step, q), q_state, q)
    for k in p:
        torch.testing.assert_close(p[k], q[k], rtol=1e-6, atol=1e-7)
    assert len(frames) == 1  # every step and rate: one graph


def test_torch_func_differentiates_through_an_update_with_a_schedule() -> None:
    # d(new w)/d(g) = -lr for SGD: the schedule's rate, at each step count.
    schedule = fdp.optim.linear_schedule(0.0, 1.0, 4)
    opt = fdp.optim.sgd(schedule)
    p = {"w": torch.ones(3)}
    state = opt.init(p)
    for n in range(3):

        def new_w(g: torch.Tensor, s: Any = state, q: Any = p) -> torch.Tensor:
            out: torch.Tensor = opt.update({"w": g}, s, q)[0]["w"].sum()
            return out

        got = torch.func.grad(new_w)(torch.ones(3))
        torch.testing.assert_close(got, torch.full((3,), -n / 4, dtype=torch.float32))
        p, state = opt.update({"w": torch.ones(3)}, state, p)


def test_bad_schedules_are_refused_by_name() -> None:
    o = fdp.optim
    cases: list[tuple[Callable[[], Any], str]] = [
        (lambda: o.linear_schedule(0.0, 1.0, 0), "`transition_steps` expected an int > 0; got 0"),
        (lambda: o.cosine_decay_schedule(1.0, 10, alpha=2.0), "`alpha` expected a float in"),
        (lambda: o.join_schedules([o.constant_schedule(1.0)], [3]), "`boundaries` expected one"),
        (lambda: o.warmup_cosine_decay_schedule(0.0, 1.0, 10, 5), "`decay_steps` expected more"),
    ]
    for make, message in cases:
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            make()
