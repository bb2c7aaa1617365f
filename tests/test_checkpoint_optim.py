"""Torch optimizers through ``fdp.save_checkpoint`` / ``load_checkpoint``, and strict loading.

A restarted job builds a fresh ``torch.optim.AdamW``, whose ``state_dict()``
holds no per-parameter state; loading with it (or with the optimizer itself)
must give back every moment the checkpoint holds, so that the resumed run
equals the uninterrupted one bitwise. A checkpoint holding entries that
``like`` has no leaf for is refused unless ``strict=False``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import fdp
from tests import ranks

STEPS, SAVE_AT = 6, 3


def _net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)


def _steps(rank: int, net: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    """fdp DDP with a torch optimizer, as docs/porting.md has it."""
    fn, state = fdp.make_functional(net)
    ddp = fdp.DistributedDataParallel(state)
    for step in steps:
        x, y = _batch(rank, step)
        torch.autograd.backward(torch.nn.functional.mse_loss(fn(ddp(state), x), y))
        opt.step()
        opt.zero_grad()


def _resumed(rank: int, size: int, path: str, like_form: str) -> list[torch.Tensor]:
    """Trains to SAVE_AT, saves; a fresh net and AdamW load it and train to STEPS."""
    net = _net(0)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    _steps(rank, net, opt, range(SAVE_AT))
    saved = opt if like_form == "optimizer" else opt.state_dict()
    fdp.save_checkpoint(path, {"params": dict(net.state_dict()), "opt": saved})
    net = _net(1)  # the restarted job: other initial values, a fresh optimizer
    opt = torch.optim.AdamW(net.parameters(), lr=5e-2)
    like: dict[str, Any] = {"params": dict(net.state_dict())}
    like["opt"] = opt if like_form == "optimizer" else opt.state_dict()
    loaded = fdp.load_checkpoint(path, like)
    net.load_state_dict(loaded["params"])
    if like_form == "optimizer":
        assert loaded["opt"] is opt  # loaded into in place
    else:
        opt.load_state_dict(loaded["opt"])
    _steps(rank, net, opt, range(SAVE_AT, STEPS))
    return [p.detach() for p in net.parameters()]


def _uninterrupted(rank: int, size: int) -> list[torch.Tensor]:
    net = _net(0)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    _steps(rank, net, opt, range(STEPS))
    return [p.detach() for p in net.parameters()]


def _both(rank: int, size: int, tmp: str) -> Any:
    forms = ("state_dict", "optimizer")
    out = {form: _resumed(rank, size, f"{tmp}/{form}", form) for form in forms}
    out["uninterrupted"] = _uninterrupted(rank, size)
    dist.barrier()
    return out


def test_a_fresh_torch_adamw_resumes_bitwise_as_its_state_dict_or_itself(tmp_path: Path) -> None:
    for got in ranks.world(2).run(_both, str(tmp_path)):
        for form in ("state_dict", "optimizer"):
            for p, want in zip(got[form], got["uninterrupted"], strict=True):
                torch.testing.assert_close(p, want, rtol=0, atol=0, msg=form)


def test_a_torch_optimizer_round_trips_in_one_process(tmp_path: Path) -> None:
    net = _net(0)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    x, y = _batch(0, 0)
    torch.autograd.backward(torch.nn.functional.mse_loss(net(x), y))
    opt.step()
    fdp.save_checkpoint(tmp_path / "c", {"opt": opt})
    fresh = torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.1)
    fdp.load_checkpoint(tmp_path / "c", {"opt": fresh})
    want, got = opt.state_dict(), fresh.state_dict()
    assert got["param_groups"] == want["param_groups"]  # lr 0.1, momentum 0.9 again
    assert got["state"].keys() == want["state"].keys()
    for i, slots in want["state"].items():
        for name, value in slots.items():
            torch.testing.assert_close(got["state"][i][name], value, rtol=0, atol=0)


def test_entries_like_lacks_are_refused_by_name_unless_not_strict(tmp_path: Path) -> None:
    net = _net(0)
    opt = torch.optim.AdamW(net.parameters())
    x, y = _batch(0, 0)
    torch.autograd.backward(torch.nn.functional.mse_loss(net(x), y))
    opt.step()
    params = {k: v.detach() for k, v in net.state_dict().items()}
    fdp.save_checkpoint(tmp_path / "c", {"params": params, "opt": opt.state_dict(), "step": 1})
    like: dict[str, Any] = {"params": {k: torch.zeros_like(v) for k, v in params.items()}}
    like["step"] = 0
    with pytest.raises(ValueError, match=r"holds 2[0-9] entries that `like` has no leaf for: "):
        fdp.load_checkpoint(tmp_path / "c", like)
    with pytest.raises(ValueError, match=r"\"\['opt'\]\['param_groups'\]\[0\]\['amsgrad'\]\""):
        fdp.load_checkpoint(tmp_path / "c", like)
    loaded = fdp.load_checkpoint(tmp_path / "c", like, strict=False)
    assert loaded["step"] == 1
    for k, v in params.items():
        torch.testing.assert_close(loaded["params"][k], v, rtol=0, atol=0)


def test_options_a_scheduler_added_come_back_to_a_fresh_optimizer(tmp_path: Path) -> None:
    net = _net(0)
    opt = torch.optim.AdamW(net.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=4)
    x, y = _batch(0, 0)
    torch.autograd.backward(torch.nn.functional.mse_loss(net(x), y))
    opt.step()
    sched.step()
    fdp.save_checkpoint(tmp_path / "c", {"opt": opt.state_dict(), "sched": sched.state_dict()})
    fresh = torch.optim.AdamW(net.parameters(), lr=0.1)  # no initial_lr until a scheduler
    like = {"opt": fresh.state_dict(), "sched": sched.state_dict()}
    loaded = fdp.load_checkpoint(tmp_path / "c", like)
    fresh.load_state_dict(loaded["opt"])
    assert fresh.param_groups[0]["initial_lr"] == 0.1
    assert fresh.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


def _cuda_run(tmp: Path, *, resume: bool) -> list[torch.Tensor]:
    net = _net(0).cuda()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, fused=True)
    for step in range(STEPS):
        if resume and step == SAVE_AT:
            fdp.save_checkpoint(tmp / "c", {"model": net.state_dict(), "opt": opt}, rng=False)
            net = _net(1).cuda()
            opt = torch.optim.AdamW(net.parameters(), lr=5e-2, fused=True)
            like: dict[str, Any] = {"model": net.state_dict(), "opt": opt}
            net.load_state_dict(fdp.load_checkpoint(tmp / "c", like, rng=False)["model"])
            moments = [s["exp_avg"] for s in opt.state.values()]
            assert moments
            assert all(m.is_cuda for m in moments)
        x, y = (t.cuda() for t in _batch(0, step))
        torch.autograd.backward(torch.nn.functional.mse_loss(net(x), y))
        opt.step()
        opt.zero_grad()
    return [p.detach().cpu() for p in net.parameters()]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_fused_cuda_adamw_resumes_bitwise_with_its_moments_on_the_gpu(tmp_path: Path) -> None:
    resumed = _cuda_run(tmp_path, resume=True)
    for got, want in zip(resumed, _cuda_run(tmp_path, resume=False), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
