"""DistributedDataParallel(broadcast_buffers=...): rank 0's buffers on every rank (_ddp_buffers).

Every body runs on spawned gloo ranks (tests/ranks.py). The reference for
buffers is torch's own DDP on the same module and data; for gradients, the
single-process average over ranks.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

import fdp
from tests import ranks
from tests.helpers import PER_RANK, TOL, BufferProbe, batch, shard

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


SEQUENCES = {
    # Gradient accumulation: torch broadcasts in the first micro-batch's forward
    # (the previous forward was synchronised), not in the last one's.
    "accumulate": ["sync", "no_sync", "no_sync", "sync", "no_sync", "sync", "sync"],
    # An evaluation after accumulating (torch's flag is down there: no broadcast).
    "evaluate": ["sync", "no_sync", "no_grad", "sync", "sync"],
}


def _broadcasts(rank: int, size: int, sequence: str) -> tuple[list[bool], list[bool]]:
    """Which calls of a sequence gave this rank rank 0's buffers: fdp's and torch's DDP."""
    module = BufferProbe()
    fn, state = fdp.make_functional(module)
    ddp = fdp.DistributedDataParallel(state)
    torch_ddp = torch.nn.parallel.DistributedDataParallel(BufferProbe())
    runs: list[tuple[torch.nn.Module, Any, Any]] = [
        (module, lambda x: fn(ddp(state), x), ddp.no_sync),
        (torch_ddp.module, torch_ddp, torch_ddp.no_sync),
    ]
    seen: tuple[list[bool], list[bool]] = ([], [])
    for mode in SEQUENCES[sequence]:
        for k, (held, forward, no_sync) in enumerate(runs):
            held.get_buffer("value").fill_(1.0 + rank)
            if mode == "no_grad":
                with torch.no_grad():
                    forward(torch.ones(3))
            else:
                with no_sync() if mode == "no_sync" else contextlib.nullcontext():
                    forward(torch.ones(3)).sum().backward()
            seen[k].append(bool(held.get_buffer("value")[0] == 1.0))
    return seen


@pytest.mark.parametrize("sequence", sorted(SEQUENCES))
def test_buffers_broadcast_when_torchs_ddp_does(sequence: str) -> None:
    # Before, fdp broadcast on every synchronised call and never under no_sync
    # (running variances off torch's by up to 0.24 under accumulation).
    expected = {
        "accumulate": [True, True, False, False, True, False, True],
        "evaluate": [True, True, False, False, True],
    }[sequence]
    for rank, (fdp_seen, torch_seen) in enumerate(ranks.world(2).run(_broadcasts, sequence)):
        assert fdp_seen == torch_seen
        assert fdp_seen == [e or rank == 0 for e in expected]


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


def _two_forwards(rank: int, size: int) -> str:
    """Two training calls, then one backward: the second call's broadcast wrote ``scale``."""
    tree = functional_tree(rank)
    ddp = fdp.DistributedDataParallel(tree)
    x, y = batch(4)
    losses = [functional_loss(ddp(tree), x, y) for _ in range(2)]  # the first saved scale
    try:
        torch.autograd.backward(losses[0] + losses[1])
    except RuntimeError as e:
        return str(e).splitlines()[0]
    return "no error"


def test_a_saved_buffer_the_broadcast_wrote_fails_backward_on_every_rank() -> None:
    # Rank 0 (the source) copies nothing back, but its buffers count as
    # written: if only the receiving ranks failed, rank 0 would wait in the
    # gradients' all-reduce. The reference: the same write, one process.
    tree = functional_tree(0)
    loss = functional_loss(tree, *batch(4))
    tree["buffers"]["scale"].copy_(functional_tree(0)["buffers"]["scale"])
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.backward(loss)
    messages = ranks.world(2).run(_two_forwards)
    assert len(set(messages)) == 1, messages
    assert "modified by an inplace operation" in messages[0], messages


# --------------------------------------------------------------- where ranks start


def _start_apart(rank: int, size: int, init_sync: bool) -> dict[str, Any]:
    """Each rank builds its own weights (another seed) and trains two SGD steps."""
    tree = functional_tree(rank)
    with torch.no_grad():
        tree["params"]["w"].add_(rank)  # as if each rank drew its own initialisation
    ddp = fdp.DistributedDataParallel(tree, init_sync=init_sync)
    start = {"w": tree["params"]["w"].detach().clone(), "scale": tree["buffers"]["scale"].clone()}
    opt = torch.optim.SGD([tree["params"]["w"]], lr=0.1)
    for step in range(2):
        x, y = batch(size * PER_RANK, seed=step)
        opt.zero_grad()
        torch.autograd.backward(functional_loss(ddp(tree), shard(x, rank), shard(y, rank)))
        opt.step()
    return {"start": start, "w": tree["params"]["w"].detach()}


def test_construction_gives_every_rank_rank_0s_parameters_and_buffers() -> None:
    # As torch's DDP. Before, each rank trained its own weights with no warning.
    size = 2
    ref = functional_tree(0)
    opt = torch.optim.SGD([ref["params"]["w"]], lr=0.1)
    for step in range(2):
        x, y = batch(size * PER_RANK, seed=step)
        opt.zero_grad()
        losses = [functional_loss(ref, shard(x, r), shard(y, r)) for r in range(size)]
        torch.autograd.backward(torch.stack(losses).mean())
        opt.step()
    for out in ranks.world(size).run(_start_apart, True):
        torch.testing.assert_close(out["start"]["w"], functional_tree(0)["params"]["w"].detach())
        torch.testing.assert_close(out["start"]["scale"], functional_tree(0)["buffers"]["scale"])
        torch.testing.assert_close(out["w"], ref["params"]["w"].detach(), **TOL)


def test_init_sync_false_leaves_the_parameters_alone() -> None:
    first, second = ranks.world(2).run(_start_apart, False)
    assert torch.equal(second["start"]["w"], functional_tree(1)["params"]["w"].detach() + 1)
    assert not torch.equal(first["start"]["w"], second["start"]["w"])


class FrozenNet(torch.nn.Module):
    """torch's test_ddp_inference model: a frozen integer parameter, no buffers."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = torch.nn.Linear(2, 10, bias=False)
        self.fc2 = torch.nn.Linear(10, 4, bias=False)
        self.no_grad_param = torch.nn.Parameter(torch.tensor([2, 2]).long(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.softmax(self.fc2(F.relu(self.fc1(x))), dim=1) * self.no_grad_param[0]


def _inference(rank: int, size: int) -> list[torch.Tensor]:
    net = FrozenNet().eval()
    fn, state = fdp.make_functional(net)
    ddp = fdp.DistributedDataParallel(state)
    x = batch(10)[0][:, :2]
    out = []
    if rank == 0:  # alone, grad mode on, as torch's test: no collective may wait for rank 1
        out = [fn(ddp(state), x).detach() for _ in range(6)]
    net.train()  # then both ranks train a step: their collectives still pair up
    torch.autograd.backward(fn(ddp(state), shard(batch(size * PER_RANK)[0][:, :2], rank)).sum())
    return [*out, state["fc1.weight"].grad]


def test_ddp_inference_one_rank_with_a_frozen_parameter() -> None:
    # torch's test_ddp_inference: a frozen nn.Parameter is synced at construction
    # only; before, it was broadcast as a buffer on every call and rank 0 hung.
    size = 2
    net = FrozenNet().eval()
    x = batch(10)[0][:, :2]
    expected = net(x).detach()
    torch.autograd.backward(net(batch(size * PER_RANK)[0][:, :2]).sum() / size)
    first, second = ranks.world(size).run(_inference)
    assert len(first) == 7
    assert len(second) == 1
    for got in first[:6]:
        torch.testing.assert_close(got, expected)
    for out in (first, second):
        torch.testing.assert_close(out[-1], net.fc1.weight.grad, **TOL)


def _func_grad_batch_norm(rank: int, size: int) -> dict[str, torch.Tensor]:
    net = bn_module().eval()
    fn, state = fdp.make_functional(net)
    params = {k: v.detach() for k, v in state.items() if v.requires_grad}
    buffers = {k: v for k, v in state.items() if not v.requires_grad}
    ddp = fdp.DistributedDataParallel({**params, **buffers})
    x, y = (shard(t, rank) for t in batch(size * PER_RANK))

    def loss(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.mse_loss(fn(ddp({**p, **buffers}), x), y)

    grads: dict[str, torch.Tensor] = torch.func.grad(loss)(params)
    return grads


def test_func_grad_through_ddp_of_params_and_buffers() -> None:
    # Buffers come out of ddp(...) as they went in, never requiring grad: before,
    # batch_norm raised "not differentiable with respect to argument running_mean".
    size = 2
    net = bn_module().eval()
    x, y = batch(size * PER_RANK)
    losses = [F.mse_loss(net(shard(x, r)), shard(y, r)) for r in range(size)]
    torch.autograd.backward(torch.stack(losses).mean())
    expected = {k: v.grad for k, v in net.named_parameters()}
    for grads in ranks.world(size).run(_func_grad_batch_norm):
        assert grads.keys() == expected.keys()
        for k, g in grads.items():
            torch.testing.assert_close(g, expected[k], **TOL, msg=k)


def _grad(p: torch.Tensor) -> torch.Tensor:
    assert p.grad is not None
    return p.grad


def _func_grad_batch_norm_train(rank: int, size: int) -> tuple[Any, Any]:
    """Train mode: the buffers are an argument of the transformed loss, not differentiated."""
    net = bn_module()
    fn, state = fdp.make_functional(net)
    params = {k: v.detach() for k, v in state.items() if v.requires_grad}
    buffers = {k: v.clone() for k, v in state.items() if not v.requires_grad}
    ddp = fdp.DistributedDataParallel({**params, **buffers})
    x, y = (shard(t, rank) for t in batch(size * PER_RANK))

    def loss(p: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.mse_loss(fn(ddp({**p, **b}), x), y)

    grads = torch.func.grad(loss)(params, buffers)  # updates the buffers in place
    return grads, buffers


def test_func_grad_through_ddp_of_params_and_buffers_in_train_mode() -> None:
    # Before: "native_batch_norm is not differentiable with respect to argument
    # running_mean" (the buffers came out of ddp(...) requiring grad at the
    # transform's level). One process: the average of each rank's gradient,
    # each rank's running statistics from its own batch (torch's DDP).
    size = 2
    x, y = batch(size * PER_RANK)
    nets = [bn_module() for _ in range(size)]
    losses = [F.mse_loss(n(shard(x, r)), shard(y, r)) for r, n in enumerate(nets)]
    torch.autograd.backward(torch.stack(losses).mean())
    for rank, (grads, buffers) in enumerate(ranks.world(size).run(_func_grad_batch_norm_train)):
        for k, _ in nets[0].named_parameters():
            want = torch.stack([_grad(n.get_parameter(k)) for n in nets]).sum(0)
            torch.testing.assert_close(grads[k], want, **TOL, msg=k)
        for k, b in nets[rank].named_buffers():
            torch.testing.assert_close(buffers[k], b, **TOL, msg=k)
