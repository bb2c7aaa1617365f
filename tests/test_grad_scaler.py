"""fdp.optim.GradScaler against torch.amp.GradScaler driving torch.optim."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import fdp
from tests import ranks
from tests.helpers import tree_allclose

STEPS = 8
INF_STEPS = {2, 3, 6}  # steps whose input holds an inf: their gradients overflow


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)
    if step in INF_STEPS:
        x[0, 0] = float("inf")
    return x, y


def start() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(4, 2, generator=g), "b": torch.zeros(2)}


def loss(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(x @ p["w"] + p["b"], y)


HYPER: dict[str, Any] = {"init_scale": 256.0, "growth_interval": 2}
# Factors that float32 cannot hold exactly: torch rounds once, in double.
ODD: dict[str, Any] = {
    "init_scale": 3000.0,
    "growth_factor": 1.1,
    "backoff_factor": 0.3,
    "growth_interval": 1,
}


def torch_reference(hyper: dict[str, Any]) -> tuple[dict[str, torch.Tensor], list[float]]:
    params = {k: v.clone().requires_grad_() for k, v in start().items()}
    opt = torch.optim.SGD(params.values(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", **hyper)
    scales = []
    for step in range(STEPS):
        opt.zero_grad()
        torch.autograd.backward(scaler.scale(loss(params, *data(step))))
        scaler.step(opt)
        scaler.update()
        scales.append(float(scaler.get_scale()))
    return {k: v.detach() for k, v in params.items()}, scales


@pytest.mark.parametrize("hyper", [HYPER, ODD], ids=["powers_of_two", "odd_factors"])
def test_steps_skips_and_scales_equal_torchs_grad_scaler(hyper: dict[str, Any]) -> None:
    expected, expected_scales = torch_reference(hyper)
    scaler, opt = fdp.optim.GradScaler(**hyper), fdp.optim.sgd(0.1, momentum=0.9)
    params = start()
    state, opt_state, scales = scaler.init(), opt.init(params), []
    for step in range(STEPS):

        def scaled(p: Any, x: torch.Tensor, y: torch.Tensor, s: Any) -> torch.Tensor:
            return scaler.scale(loss(p, x, y), s)

        grads = torch.func.grad(scaled)(params, *data(step), state)
        grads, found_inf = scaler.unscale(grads, state)
        assert bool(found_inf) == (step in INF_STEPS)
        if not found_inf:
            params, opt_state = opt.update(grads, opt_state, params)
        state = scaler.update(state, found_inf)
        scales.append(float(state["scale"]))
    assert scales == expected_scales
    tree_allclose(params, expected)


def test_the_scale_never_grows_past_float32s_range() -> None:
    scaler = fdp.optim.GradScaler(init_scale=2.0**127, growth_interval=1)
    state = scaler.update(scaler.init(), torch.zeros(()))
    assert float(state["scale"]) == 2.0**127  # torch keeps the finite scale
    assert int(state["growth_tracker"]) == 0


def test_update_compiles_to_one_graph() -> None:
    scaler = fdp.optim.GradScaler(growth_interval=3)
    update = torch.compile(scaler.update, backend="eager", fullgraph=True)
    state = scaler.init()
    for found in [0.0, 1.0, 0.0, 0.0, 0.0]:
        eager = scaler.update(state, torch.tensor(found))
        state = update(state, torch.tensor(found))
        tree_allclose(state, eager)
    assert float(state["scale"]) == 2.0**16  # backed off once, grown once


def test_bad_hyperparameters_name_the_argument() -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"init_scale": 0.0}, "init_scale"),
        ({"growth_factor": 1.0}, "growth_factor"),
        ({"backoff_factor": 1.0}, "backoff_factor"),
        ({"growth_interval": 0}, "growth_interval"),
    ]
    for kwargs, name in cases:
        with pytest.raises(ValueError, match=rf"GradScaler: `{name}` expected"):
            fdp.optim.GradScaler(**kwargs)


def _one_rank_overflows(rank: int, size: int) -> tuple[float, float]:
    scaler = fdp.optim.GradScaler()
    grads = {"w": torch.full((3,), float("inf") if rank == 1 else 1.0)}
    _, local = scaler.unscale(grads, scaler.init())
    _, synced = scaler.unscale(grads, scaler.init(), sync=True)
    return float(local), float(synced)


def test_sync_takes_every_ranks_overflow() -> None:
    """Local gradients (ZeroRedundancy's input) overflow on one rank: every rank must skip."""
    results = ranks.world(3).run(_one_rank_overflows)
    assert [local for local, _ in results] == [0.0, 1.0, 0.0]
    assert [synced for _, synced in results] == [1.0, 1.0, 1.0]
