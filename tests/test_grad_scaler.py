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


# Steps whose data on rank 0 overflows one element of `w` once scaled: the
# shard that holds it is rank 1's, so only rank 1's gradients hold the inf.
SHARD_OVERFLOW_STEPS = {1, 2, 5}


def _shard_data(step: int, rank: int) -> torch.Tensor:
    c = torch.randn(8, generator=torch.Generator().manual_seed(10 * step + rank))
    if rank == 0 and step in SHARD_OVERFLOW_STEPS:
        c[7] = 1e38  # times the scale: inf in float32
    return c


def _shard_loss(p: dict[str, torch.Tensor], c: torch.Tensor) -> torch.Tensor:
    return (p["w"] * c).sum() + (p["b"] * c[:3]).square().sum()


def _shard_start() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"w": torch.randn(8, generator=g), "b": torch.randn(3, generator=g)}


def _fully_sharded_scaling(rank: int, size: int, sync: bool | None) -> Any:
    fsdp = fdp.FullyShardedDataParallel(_shard_start())  # units "w" and "b"
    shards = fsdp.shard(_shard_start())
    opt, scaler = fdp.optim.sgd(0.1, momentum=0.9), fdp.optim.GradScaler(**HYPER)
    opt_state, scale_state = opt.init(shards), scaler.init()
    founds, scales = [], []
    for step in range(STEPS):

        def scaled_loss(s: Any, c: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
            return scaler.scale(_shard_loss(fsdp(s), c), state)

        grads = fdp.grad(scaled_loss)(shards, _shard_data(step, rank), scale_state)
        grads, found = scaler.unscale(grads, scale_state, sync=sync)
        if not found:
            shards, opt_state = opt.update(grads, opt_state, shards)
        scale_state = scaler.update(scale_state, found)
        founds.append(float(found))
        scales.append(float(scale_state["scale"]))
    return fsdp.full(shards), founds, scales


def _torch_sharded_reference(size: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    params = {k: v.clone().requires_grad_() for k, v in _shard_start().items()}
    opt = torch.optim.SGD(params.values(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", **HYPER)
    scales = []
    for step in range(STEPS):
        opt.zero_grad()
        # The average of the ranks' losses: their gradients' average, as fsdp's.
        total = torch.stack([_shard_loss(params, _shard_data(step, r)) for r in range(size)]).mean()
        torch.autograd.backward(scaler.scale(total))
        scaler.step(opt)
        scaler.update()
        scales.append(float(scaler.get_scale()))
    return {k: v.detach() for k, v in params.items()}, scales


def test_fully_sharded_gradients_overflowing_on_one_rank_skip_the_step_on_every_rank() -> None:
    # Before: unscale took each rank's own answer by default, so where one
    # shard overflowed its rank skipped the step and backed off while the
    # other stepped, and the ranks trained apart without an error.
    world = ranks.world(2)
    expected, expected_scales = _torch_sharded_reference(2)
    for full, founds, scales in world.run(_fully_sharded_scaling, None):
        tree_allclose(full, expected)
        assert scales == expected_scales
        assert founds == [float(s in SHARD_OVERFLOW_STEPS) for s in range(STEPS)]
    # sync=False: each rank's own answer, as asked (only rank 1 held the inf).
    local = world.run(_fully_sharded_scaling, False)
    assert [founds[1] for _, founds, _ in local] == [0.0, 1.0]


def _fully_sharded_torch_scaling(rank: int, size: int) -> Any:
    """docs/fsdp.md's loop with torch's optimizer and ShardedGradScaler on the shards' .grad."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    fsdp = fdp.FullyShardedDataParallel(_shard_start())
    shards = fsdp.shard(_shard_start())
    leaves = [t.requires_grad_() for ts in shards.values() for t in ts]
    opt = torch.optim.SGD(leaves, lr=0.1, momentum=0.9)
    scaler = ShardedGradScaler("cpu", **HYPER)
    scales = []
    for step in range(STEPS):
        opt.zero_grad()
        torch.autograd.backward(scaler.scale(_shard_loss(fsdp(shards), _shard_data(step, rank))))
        scaler.step(opt)
        scaler.update()
        scales.append(float(scaler.get_scale()))
    return fsdp.full(shards), scales


def test_torchs_sharded_grad_scaler_on_fully_sharded_shards_steps_as_one_process() -> None:
    # torch.amp.GradScaler takes each rank's own answer there (the ranks train
    # apart); docs/fsdp.md names torch's ShardedGradScaler, checked here.
    expected, expected_scales = _torch_sharded_reference(2)
    for full, scales in ranks.world(2).run(_fully_sharded_torch_scaling):
        tree_allclose(full, expected)
        assert scales == expected_scales
