"""torch's own DDP tests, ported to fdp's functional API (``make_functional`` + ``ddp(state)``).

Each test names the torch test it ports (``test/distributed/test_c10d_common.py``,
``test_c10d_gloo.py``, ``distributed_test.py``). Where torch's DDP raises
(reentrant checkpointing of a layer used twice without ``static_graph``),
fdp gives the reference instead. The reference is always one process
running the plain module on the whole batch; docs/porting.md lists torch's
tests that do not apply to a function over a tree, and why.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, NamedTuple, cast

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import fdp
from tests import ranks
from tests.helpers import TINY, TOL

# ---------------------------------------------------------------- checkpointing
# test_c10d_common.py: CheckpointOnceModule ... DynamicCheckpointTwiceModuleWeightSharing,
# after fairscale's tests/nn/pipe/test_checkpoint_ddp.py.


class Once(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.l1 = nn.Linear(20, 20)
        self.l2 = nn.Linear(20, 20)
        self.reentrant = reentrant

    def ckpt(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = checkpoint(layer, x, use_reentrant=self.reentrant)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ckpt(self.l2, self.l1(x))


class Twice(Once):
    """The same layer checkpointed twice (pipeline parallelism does this)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ckpt(self.l2, self.ckpt(self.l2, self.l1(x)))


class TwiceShared(Twice):
    def __init__(self, reentrant: bool) -> None:
        super().__init__(reentrant)
        self.l1.weight = self.l2.weight


class Dynamic(Once):
    """Alternates between its layers: a forward that changes between iterations."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__(reentrant)
        self.count = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.ckpt(self.l1 if self.count % 2 else self.l2, x)
        self.count += 1
        return out


class DynamicShared(Dynamic):
    def __init__(self, reentrant: bool) -> None:
        super().__init__(reentrant)
        self.l1.weight = self.l2.weight


class SharedSequential(nn.Sequential):
    """test_ddp_checkpointing_weight_sharing: the whole model checkpointed, l1.weight is l2's."""

    def __init__(self, reentrant: bool) -> None:
        l1, l2 = nn.Linear(20, 20), nn.Linear(20, 20)
        l1.weight = l2.weight
        super().__init__(l1, l2)


MODELS: dict[str, type[nn.Module]] = {
    "once": Once,
    "twice": Twice,
    "twice_weight_sharing": TwiceShared,
    "dynamic_module": Dynamic,
    "dynamic_weight_sharing": DynamicShared,
    "weight_sharing": SharedSequential,
}
ITERS = 5
PER_RANK_ROWS = 8


def checkpoint_data(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    rows = PER_RANK_ROWS * size
    # As torch's: the input requires grad (reentrant checkpointing needs one that does).
    return torch.rand(rows, 20, generator=g).requires_grad_(), torch.randn(rows, 20, generator=g)


def train(
    kind: str, reentrant: bool, call: Any, net: nn.Module, x: torch.Tensor, y: torch.Tensor
) -> list[dict[str, torch.Tensor | None]]:
    """torch's _test_ddp_checkpointing: ITERS steps, ``.grad`` after each (zeroed, not None)."""
    grads = []
    for _ in range(ITERS):
        net.zero_grad(set_to_none=False)
        # weight_sharing: the whole model under one checkpoint
        whole = kind == "weight_sharing"
        out = checkpoint(call, x, use_reentrant=reentrant) if whole else call(x)
        torch.autograd.backward(nn.functional.mse_loss(out, y))
        grads.append(
            {k: None if p.grad is None else p.grad.clone() for k, p in net.named_parameters()}
        )
    return grads


def _checkpointing(rank: int, size: int, kind: str, reentrant: bool, buckets: str) -> Any:
    torch.manual_seed(31415)
    net = MODELS[kind](reentrant)
    fn, state = fdp.make_functional(net)
    ddp = fdp.DistributedDataParallel(state, **(TINY if buckets == "per_leaf" else {}))
    x, y = (t[rank * PER_RANK_ROWS : (rank + 1) * PER_RANK_ROWS] for t in checkpoint_data(size))
    return train(kind, reentrant, lambda h: fn(ddp(state), h), net, x, y)


CASES = [(kind, reentrant) for kind in MODELS for reentrant in (False, True)]


@pytest.mark.parametrize("buckets", ["one", "per_leaf"])  # torch's: use_bucket_view
@pytest.mark.parametrize(("kind", "reentrant"), CASES)
def test_ddp_checkpointing(kind: str, reentrant: bool, buckets: str) -> None:
    """Gradients of every iteration equal one process's on the whole batch, on every rank.

    torch's DDP raises "Expected to mark a variable ready only once" for
    reentrant ``twice`` without ``static_graph``; fdp has no such limit:
    a gradient that a nested backward gives after its bucket left is
    reduced at the end of backward.
    """
    size = 2
    results = ranks.world(size).run(_checkpointing, kind, reentrant, buckets)
    torch.manual_seed(31415)
    net = MODELS[kind](reentrant)
    x, y = checkpoint_data(size)
    want = train(kind, reentrant, net, net, x, y)
    for got in results:
        for step, (g, w) in enumerate(zip(got, want, strict=True)):
            for name, ref in w.items():
                if ref is None:
                    assert g[name] is None, (step, name)
                    continue
                assert g[name] is not None, (step, name)
                torch.testing.assert_close(g[name], ref, **TOL, msg=f"step {step}: {name}")
    for a, b in zip(results[0], results[1], strict=True):
        assert all(a[k] is None or torch.equal(a[k], b[k]) for k in a)  # bitwise across ranks


# ------------------------------------------------- control flow and no_sync
# distributed_test.py: test_grads_same_across_ranks_with_no_sync


class Conditional(nn.Module):
    """Rank 0 uses nn1 then nn2, the other ranks nn3 then nn4: a flag the forward flips."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank
        self.nn1, self.nn2, self.nn3, self.nn4 = (nn.Linear(1, 1) for _ in range(4))
        self.state = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, self.state = self.state == 0, 1 - self.state
        if self.rank == 0:
            return self.nn1(x) if first else self.nn2(x)  # type: ignore[no-any-return]
        return self.nn3(x) if first else self.nn4(x)  # type: ignore[no-any-return]


def conditional_data(rank: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + micro)
    return torch.rand(1, generator=g), torch.rand(1, generator=g)


def _conditional(rank: int, size: int) -> dict[str, torch.Tensor | None]:
    torch.manual_seed(0)
    net = Conditional(rank)
    fn, state = fdp.make_functional(net)
    ddp = fdp.DistributedDataParallel(state)
    for micro in range(2):
        with ddp.no_sync() if micro == 0 else contextlib.nullcontext():
            x, y = conditional_data(rank, micro)
            torch.autograd.backward(nn.functional.mse_loss(fn(ddp(state), x), y))
    return {k: p.grad for k, p in net.named_parameters()}


def test_grads_same_across_ranks_with_no_sync() -> None:
    """Every parameter gets the average over ranks of its accumulated gradient, on every rank."""
    size = 2
    results = ranks.world(size).run(_conditional)
    nets = []
    for rank in range(size):  # the reference: each rank's two micro-batches, one process
        torch.manual_seed(0)
        net = Conditional(rank)
        for micro in range(2):
            x, y = conditional_data(rank, micro)
            torch.autograd.backward(nn.functional.mse_loss(net(x), y) / size)
        nets.append(net)
    for name, _ in nets[0].named_parameters():
        grads = [n.get_parameter(name).grad for n in nets]
        want = sum(g for g in grads if g is not None)
        for got in results:
            assert got[name] is not None, name  # torch's assertion: no None gradient
            torch.testing.assert_close(got[name], want, **TOL, msg=name)


# ------------------------------------------------------ a zoo of small models
# distributed_test.py: test_ddp_returns_tensor_with_no_grad, test_ddp_zero_output_features,
# test_ddp_shared_grad_acc_unused_params, test_ddp_new_tensor_in_fwd,
# test_output_unused_in_loss_{tuple,dict}_module, test_ddp_namedtuple,
# test_ddp_control_flow_{same,different}_across_ranks.


class Outputs(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor


class Zoo(nn.Module):
    """One of torch's small DDP test models, chosen by ``kind``; ``rank`` may steer its forward."""

    def __init__(self, kind: str, rank: int) -> None:
        super().__init__()
        self.kind, self.rank = kind, rank
        self.fc1 = nn.Linear(10, 10, bias=False)
        self.fc2 = nn.Linear(10, 10, bias=kind != "new_tensor_in_fwd")
        if kind == "zero_output_features":
            self.fc3 = nn.Linear(10, 0)
        if kind == "shared_grad_acc_unused_params":
            self.bias = nn.Parameter(torch.zeros(10))
            self.fc1.bias = self.bias  # unused, and named twice

    def forward(self, x: torch.Tensor, step: int) -> Any:
        kind = self.kind
        if kind == "returns_tensor_with_no_grad":
            y = self.fc2(torch.relu(self.fc1(x)))
            return y.detach(), y.clone()
        if kind == "zero_output_features":
            return torch.cat([self.fc1(x), self.fc3(torch.relu(self.fc2(x)))], 1)
        if kind == "shared_grad_acc_unused_params":
            return self.fc2(x).sum() / 10
        if kind == "new_tensor_in_fwd":
            new = torch.ones(1, 10)  # created in forward, returned, not in the loss
            return self.fc2(torch.relu(self.fc1(x))), new, {"tensor": new * 2}
        if kind in ("output_unused_in_loss", "namedtuple"):
            return Outputs(self.fc1(x), self.fc2(x))
        # control_flow_*: the second layer on odd steps, on rank 1 only if "different"
        second = step % 2 == 1 and (kind == "control_flow_same" or self.rank == 1)
        h = torch.relu(self.fc1(x))
        return self.fc2(h) if second else h


ZOO = [
    "returns_tensor_with_no_grad",
    "zero_output_features",
    "shared_grad_acc_unused_params",
    "new_tensor_in_fwd",
    "output_unused_in_loss",
    "namedtuple",
    "control_flow_same",
    "control_flow_different",
]
ZOO_STEPS = 4


def zoo_loss(kind: str, out: Any, step: int) -> torch.Tensor:
    if kind == "returns_tensor_with_no_grad":
        assert not out[0].requires_grad
        return cast(torch.Tensor, (out[0] + out[1]).sum())
    if kind == "new_tensor_in_fwd":
        assert out[1].grad_fn is None
        return cast(torch.Tensor, out[0].mean())
    if kind == "output_unused_in_loss":  # "a" used in steps 1 and 2 only
        return cast(torch.Tensor, (out.a @ out.b.T).sum() if step in (1, 2) else out.b.sum())
    if kind == "namedtuple":
        return cast(torch.Tensor, (out.a * out.b).sum())
    return cast(torch.Tensor, out.sum())


def zoo_input(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(4, 10, generator=g)


def zoo_grads(net: nn.Module) -> dict[str, torch.Tensor | None]:
    return {k: None if p.grad is None else p.grad.clone() for k, p in net.named_parameters()}


def _zoo(rank: int, size: int, kind: str) -> list[dict[str, torch.Tensor | None]]:
    torch.manual_seed(0)
    net = Zoo(kind, rank)
    fn, state = fdp.make_functional(net)
    ddp = fdp.DistributedDataParallel(state)
    out = []
    for step in range(ZOO_STEPS):
        net.zero_grad(set_to_none=True)
        torch.autograd.backward(zoo_loss(kind, fn(ddp(state), zoo_input(rank, step), step), step))
        out.append(zoo_grads(net))
    return out


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors:UserWarning")  # torch's
@pytest.mark.parametrize("kind", ZOO)
def test_small_models_match_one_process(kind: str) -> None:
    """Gradients (and which are None) equal one process's at every step, on every rank."""
    size = 2
    results = ranks.world(size).run(_zoo, kind)
    torch.manual_seed(0)
    nets = [Zoo(kind, r) for r in range(size)]
    for r in range(1, size):
        nets[r].load_state_dict(nets[0].state_dict())
    for step in range(ZOO_STEPS):
        for net in nets:
            net.zero_grad(set_to_none=True)
        for r, net in enumerate(nets):
            out = net(zoo_input(r, step), step)
            torch.autograd.backward(zoo_loss(kind, out, step) / size)
        for name, _ in nets[0].named_parameters():
            parts = [n.get_parameter(name).grad for n in nets]
            want = None if all(p is None for p in parts) else sum(p for p in parts if p is not None)
            for got in results:
                if want is None:
                    assert got[step][name] is None, (step, name)
                else:
                    assert got[step][name] is not None, (step, name)
                    torch.testing.assert_close(got[step][name], want, **TOL, msg=f"{step} {name}")


# ------------------------------------------------------------------ autocast
# distributed_test.py: test_DistributedDataParallel_with_amp_and_grad_is_view (CUDA there;
# CPU autocast in bfloat16 with torch.amp.GradScaler here).


def amp_net() -> nn.Module:
    torch.manual_seed(31415)
    return nn.Sequential(nn.Linear(2, 10), nn.ReLU(), nn.Linear(10, 4))


def amp_data(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1337 + 10 * step + rank)
    return torch.randn(2, 2, generator=g), torch.randn(2, 4, generator=g)


def amp_step(net: nn.Module, losses: list[torch.Tensor], scaler: Any, opt: Any) -> None:
    opt.zero_grad()
    torch.autograd.backward(scaler.scale(torch.stack(losses).mean()))
    scaler.step(opt)
    scaler.update()


def _amp(rank: int, size: int) -> dict[str, torch.Tensor]:
    net = amp_net()
    fn, state = fdp.make_functional(net)
    ddp = fdp.DistributedDataParallel(state)
    opt = torch.optim.SGD(net.parameters(), lr=0.03)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(10):
        x, y = amp_data(rank, step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.mse_loss(fn(ddp(state), x).float(), y)
        amp_step(net, [loss], scaler, opt)
        assert all(bool(p.grad.isfinite().all()) for p in net.parameters() if p.grad is not None)
    return {k: v.detach() for k, v in net.state_dict().items()}


def test_autocast_and_grad_scaler_match_one_process() -> None:
    size = 2
    results = ranks.world(size).run(_amp)
    net = amp_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.03)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(10):
        losses = []
        for r in range(size):
            x, y = amp_data(r, step)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                losses.append(nn.functional.mse_loss(net(x).float(), y))
        amp_step(net, losses, scaler, opt)
    for got in results:
        for k, v in net.state_dict().items():
            torch.testing.assert_close(got[k], v, **TOL, msg=k)
    assert all(torch.equal(results[0][k], results[1][k]) for k in results[0])


# ------------------------------------------ several forwards, one backward
# distributed_test.py: test_static_graph_multi_forward (no static_graph needed here).


def multi_net() -> nn.Module:
    torch.manual_seed(42)
    return nn.Sequential(nn.Linear(10, 10), nn.ReLU())


def _multi_forward(rank: int, size: int) -> list[dict[str, torch.Tensor | None]]:
    net = multi_net()
    fn, state = fdp.make_functional(net)
    ddp = fdp.DistributedDataParallel(state)
    out = []
    for step in range(3):
        net.zero_grad()
        a = fn(ddp(state), zoo_input(rank, step))
        b = fn(ddp(state), zoo_input(rank, step + 10))  # a second call before backward
        torch.autograd.backward(a.sum() + b.sum())
        out.append(zoo_grads(net))
    return out


def test_static_graph_multi_forward() -> None:
    """Two forwards (two ddp(state) calls), one backward: the average of both, as torch's."""
    size = 2
    results = ranks.world(size).run(_multi_forward)
    for step in range(3):
        net = multi_net()
        for r in range(size):
            a, b = net(zoo_input(r, step)), net(zoo_input(r, step + 10))
            torch.autograd.backward((a.sum() + b.sum()) / size)
        for got in results:
            for name, p in net.named_parameters():
                torch.testing.assert_close(got[step][name], p.grad, **TOL, msg=f"{step} {name}")


# ---------------------------------------------------------------- create_graph, checkpoints
# distributed_test.py: test_ddp_create_graph, test_save_load_checkpoint.


class Square(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.tensor(1.0))

    def forward(self) -> torch.Tensor:
        return self.p.pow(2)


def _create_graph(rank: int, size: int) -> list[torch.Tensor]:
    net = Square()
    fn, state = fdp.make_functional(net)
    ddp = fdp.DistributedDataParallel(state)
    out = []
    for _ in range(6):  # torch's loop: .grad accumulates, with its graph
        torch.autograd.backward(fn(ddp(state)) * (rank + 1), create_graph=True)
        assert all(p.requires_grad for p in net.parameters())
        grad = net.p.grad
        assert grad is not None
        assert grad.requires_grad
        out.append(grad.detach().clone())
    return out


def test_ddp_create_graph() -> None:
    size = 2
    net = Square()
    expected = []
    for _ in range(6):
        losses = [net() * (r + 1) for r in range(size)]
        with warnings.catch_warnings():  # torch's own warning about .grad with a graph
            warnings.filterwarnings("ignore", "Using backward.. with create_graph=True")
            torch.autograd.backward(torch.stack(losses).mean(), create_graph=True)
        expected.append(net.p.grad.detach().clone())  # type: ignore[union-attr]
    for got in ranks.world(size).run(_create_graph):
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g, e)


def checkpoint_net() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 2))


def _train(fn: Any, state: dict[str, torch.Tensor], call: Any, rank: int, steps: range) -> None:
    opt = torch.optim.SGD([v for v in state.values() if v.requires_grad], lr=0.1)
    for step in steps:
        opt.zero_grad()
        x = zoo_input(rank, step)[:, :2]
        torch.autograd.backward(torch.nn.functional.mse_loss(fn(call(state), x), x.flip(1)))
        opt.step()


def _unchanged(tree: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return tree


def _save_load(rank: int, size: int, path: str) -> dict[str, dict[str, torch.Tensor]]:
    """Train 2 steps with DDP, save; load into fresh tensors; 2 more with DDP and locally."""
    net = checkpoint_net()
    fn, state = fdp.make_functional(net)
    ddp = fdp.DistributedDataParallel(state)
    _train(fn, state, ddp, rank, range(2))
    if rank == 0:
        torch.save({k: v.detach() for k, v in state.items()}, path)
    torch.distributed.barrier()
    loaded = torch.load(path)
    fresh = {k: v.clone().requires_grad_() for k, v in loaded.items()}
    again = fdp.DistributedDataParallel(fresh)
    _train(fn, fresh, again, rank, range(2, 4))
    local = {k: v.clone().requires_grad_() for k, v in loaded.items()}
    _train(fn, local, _unchanged, rank, range(2, 4))  # no DDP: this rank's own steps
    _train(fn, state, ddp, rank, range(2, 4))  # the uninterrupted run, same DDP

    def detach(tree: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in tree.items()}

    return {"resumed": detach(fresh), "local": detach(local), "uninterrupted": detach(state)}


def test_save_load_checkpoint(tmp_path: Any) -> None:
    # Before, the local training after a DDP step raised the false "second backward".
    size = 2
    results = ranks.world(size).run(_save_load, str(tmp_path / "ckpt.pt"))
    net = checkpoint_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)

    def step(module: nn.Module, optimizer: Any, data: list[torch.Tensor]) -> None:
        optimizer.zero_grad()
        losses = [torch.nn.functional.mse_loss(module(x), x.flip(1)) for x in data]
        torch.autograd.backward(torch.stack(losses).mean())
        optimizer.step()

    for s in range(2):
        step(net, opt, [zoo_input(r, s)[:, :2] for r in range(size)])
    saved = {k: v.detach().clone() for k, v in net.state_dict().items()}
    for s in range(2, 4):
        step(net, opt, [zoo_input(r, s)[:, :2] for r in range(size)])
    for rank, got in enumerate(results):
        local = checkpoint_net()
        local.load_state_dict(saved)
        local_opt = torch.optim.SGD(local.parameters(), lr=0.1)
        for s in range(2, 4):
            step(local, local_opt, [zoo_input(rank, s)[:, :2]])
        for name, p in net.state_dict().items():
            torch.testing.assert_close(got["resumed"][name], p, **TOL, msg=name)
            torch.testing.assert_close(got["uninterrupted"][name], p, **TOL, msg=name)
            torch.testing.assert_close(got["local"][name], local.state_dict()[name], **TOL)
