"""fdp.FaultTolerance's step, healing and refusals, on a one-process stand-in for torchft's Manager.

The stand-in keeps torchft's protocol (quorum, state-dict callbacks, errors,
commit) for one replica group, so these run without torchft; the drills of
``tests/test_fault_tolerance.py`` run the real one across processes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import pytest
import torch

import fdp


class _Done:
    """A collective's work that finished (or failed) at once."""

    def __init__(self, tensors: list[torch.Tensor], error: Exception | None) -> None:
        self.future: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
        if error is None:
            self.future.set_result(tensors)
        else:
            self.future.set_exception(error)  # type: ignore[arg-type]

    def wait(self) -> bool:
        self.future.wait()
        return True

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        return self.future


# Replica groups in the stand-in's quorum: more than one, so that a sum that
# was meant to be a mean is PARTICIPANTS times too large.
PARTICIPANTS = 3


class _QuorumProcessGroup:
    """The sum over a quorum of PARTICIPANTS replica groups that each hold this one's tensor
    (the others train on the same data), in place, as torchft's process group sums.
    ``fail`` makes the next one fail."""

    fail: Exception | None = None

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> _Done:
        error, self.fail = self.fail, None
        assert opts.reduceOp == torch.distributed.ReduceOp.SUM
        if error is None:
            for t in tensors:
                t.copy_(quorum_sum(t))
        return _Done(tensors, error)


def quorum_sum(t: torch.Tensor) -> torch.Tensor:
    """What the quorum's sum gives when every replica group holds ``t``: added in group order."""
    total = t
    for _ in range(PARTICIPANTS - 1):
        total = total + t
    return total


def quorum_mean(g: Any) -> Any:
    """One process's model of ``all_reduce_grads``: each group's share ``g / PARTICIPANTS``,
    summed over the quorum."""
    return optree.tree_map(lambda t: quorum_sum(t * (1.0 / PARTICIPANTS)), g)


class FakeManager:
    """torchft.Manager's protocol for one of PARTICIPANTS replica groups; ``peer`` is healed from
    at the quorum."""

    def __init__(self, *, init_sync: bool = False, async_quorum: bool = False) -> None:
        self._pg = _QuorumProcessGroup()
        self._init_sync = init_sync
        self._use_async_quorum = async_quorum
        self.step = 0
        self.error: Exception | None = None
        self.fns: dict[str, tuple[Callable[[Any], None], Callable[[], Any]]] = {}
        self.peer: dict[str, Any] | None = None

    def register_state_dict_fn(
        self, key: str, load: Callable[[Any], None], save: Callable[[], Any]
    ) -> None:
        self.fns[key] = (load, save)

    def start_quorum(self) -> None:
        self.error = None
        if self.peer is not None:
            self.fns["fdp"][0](self.peer["user"]["fdp"])
            self.step, self.peer = self.peer["torchft"]["step"], None

    def allreduce(self, tensor: torch.Tensor) -> _Done:
        """torchft's averaging all-reduce (fdp sums on ``_pg`` instead: never called)."""
        raise AssertionError("fdp reduces on the manager's process group")

    def should_commit(self) -> bool:
        ok = self.error is None
        self.step += int(ok)
        return ok

    def report_error(self, e: Exception) -> None:
        self.error = e

    def errored(self) -> Exception | None:
        return self.error

    def num_participants(self) -> int:
        return PARTICIPANTS

    def current_step(self) -> int:
        return self.step

    def shutdown(self, wait: bool = True) -> None:
        pass

    def checkpoint(self) -> dict[str, Any]:
        """What torchft sends a healing peer: the user state dicts and the step."""
        return {
            "user": {k: save() for k, (_, save) in self.fns.items()},
            "torchft": {"step": self.step},
        }


def optimizer() -> fdp.optim.Optimizer:
    """SGD with momentum: its step scales with the gradient (AdamW's barely does), so a sum
    over the quorum where a mean belongs changes the result."""
    return fdp.optim.sgd(0.1, momentum=0.9)


def state0() -> dict[str, Any]:
    return {
        "params": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.zeros(3)},
        "opt": optimizer().init({"w": torch.zeros(2, 3), "b": torch.zeros(3)}),
        "data": 0,
        "name": "run",
    }


def loss(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return ((x @ params["w"] + params["b"]) ** 2).mean()


def make_step(ft: fdp.FaultTolerance, *, fail: bool = False) -> Callable[[Any], Any]:
    opt = optimizer()

    def step(s: dict[str, Any]) -> dict[str, Any]:
        x = torch.ones(4, 2) * (s["data"] + 1)
        grads = ft.all_reduce_grads(torch.func.grad(loss)(s["params"], x))
        if fail:
            ft.manager.report_error(RuntimeError("this replica group failed"))
        params, o = opt.update(grads, s["opt"], s["params"])
        return {**s, "params": params, "opt": o, "data": s["data"] + 1}

    return step


def reference(steps: int) -> dict[str, Any]:
    s, opt = state0(), optimizer()
    for _ in range(steps):
        x = torch.ones(4, 2) * (s["data"] + 1)
        grads = quorum_mean(torch.func.grad(loss)(s["params"], x))
        params, o = opt.update(grads, s["opt"], s["params"])
        s = {**s, "params": params, "opt": o, "data": s["data"] + 1}
    return s


def assert_same(a: Any, b: Any) -> None:
    la, sa = fdp._tree.flatten(a)
    lb, sb = fdp._tree.flatten(b)
    assert sa == sb
    for x, y in zip(la, lb, strict=True):
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y


def test_committed_steps_equal_plain_training_and_a_discarded_one_keeps_the_old_state() -> None:
    ft = fdp.FaultTolerance(FakeManager())
    s = state0()
    for _ in range(3):
        s = ft.step(make_step(ft), s)
    assert ft.current_step() == 3
    assert_same(s, reference(3))
    kept = ft.step(make_step(ft, fail=True), s)
    assert kept is s
    assert ft.current_step() == 3


def test_a_healing_replica_group_takes_its_peers_state_bitwise() -> None:
    peer_manager = FakeManager()
    peer = fdp.FaultTolerance(peer_manager)
    s = state0()
    for _ in range(2):
        s = peer.step(make_step(peer), s)
    peer._heal.offer(s)  # what the peer offers at its next quorum
    manager = FakeManager()
    manager.peer = peer_manager.checkpoint()
    ft = fdp.FaultTolerance(manager)
    fresh = state0()
    fresh["params"]["w"].requires_grad_()
    seen: list[dict[str, Any]] = []

    def look(t: dict[str, Any]) -> dict[str, Any]:
        seen.append(t)
        return t

    healed = ft.step(look, fresh)
    assert_same(healed, s)
    assert ft.current_step() == 3  # healed to the peer's step 2, then committed one
    assert seen[0]["params"]["w"].requires_grad  # the leaf's own flag
    assert seen[0]["params"]["w"] is not s["params"]["w"]


def test_a_peer_with_another_tree_is_named() -> None:
    peer_manager = FakeManager()
    peer = fdp.FaultTolerance(peer_manager)
    peer._heal.offer({"params": {"w": torch.zeros(3, 3), "b": torch.zeros(3)}})
    manager = FakeManager()
    manager.peer = peer_manager.checkpoint()
    ft = fdp.FaultTolerance(manager)
    s = {"params": {"w": torch.zeros(2, 3), "b": torch.zeros(3)}}
    with pytest.raises(ValueError, match=r"`state` leaf state\['params'\]\['w'\] expected what"):
        ft.step(lambda t: t, s)


def test_all_reduce_grads_outside_a_step_is_refused() -> None:
    ft = fdp.FaultTolerance(FakeManager())
    with pytest.raises(RuntimeError, match=r"all_reduce_grads: called outside FaultTolerance.step"):
        ft.all_reduce_grads({"w": torch.ones(2)})


def test_none_leaves_stay_none_and_integer_leaves_are_refused() -> None:
    ft = fdp.FaultTolerance(FakeManager())
    grads = {"w": torch.ones(2), "frozen": None}
    out = ft.step(lambda s: ft.all_reduce_grads(s), grads)
    assert out["frozen"] is None
    torch.testing.assert_close(out["w"], quorum_mean(torch.ones(2)), rtol=0, atol=0)
    with pytest.raises(TypeError, match=r"`grads` leaf grads\['n'\] expected a floating-point"):
        ft.step(lambda s: ft.all_reduce_grads(s), {"n": torch.ones(2, dtype=torch.int64)})


@pytest.mark.parametrize("fail", [False, True])
def test_the_ddp_comm_hook_averages_in_a_future_and_a_failure_discards_the_step(
    fail: bool,
) -> None:
    manager = FakeManager()
    ft = fdp.FaultTolerance(manager)
    flat = torch.arange(4.0)
    bucket = fdp.GradBucket(flat, index=0, is_last=True, gradients=[flat], parameters=[flat])

    def step(s: torch.Tensor) -> torch.Tensor:
        manager._pg.fail = RuntimeError("lost a peer") if fail else None
        return fdp.FaultTolerance.comm_hook(ft, bucket).wait() + s

    out = ft.step(step, torch.zeros(4))
    # The hook sums, then divides (torch's allreduce_hook order).
    mean = quorum_sum(torch.arange(4.0)) / PARTICIPANTS
    torch.testing.assert_close(out, torch.zeros(4) if fail else mean, rtol=0, atol=0)
    assert ft.current_step() == int(not fail)


@pytest.mark.parametrize("transform", ["grad", "vmap", "jvp"])
def test_all_reduce_grads_under_a_transform_is_refused(transform: str) -> None:
    ft = fdp.FaultTolerance(FakeManager())
    x = torch.ones(3)

    def inside(t: torch.Tensor) -> torch.Tensor:
        return ft.all_reduce_grads({"g": t})["g"].sum()

    def run(_: object) -> object:
        if transform == "grad":
            return torch.func.grad(inside)(x)
        if transform == "vmap":
            return torch.func.vmap(inside)(x.unsqueeze(1))
        return torch.func.jvp(inside, (x,), (x,))

    with pytest.raises(TypeError, match=r"`grads` expected gradients \(plain tensors\)"):
        ft.step(run, None)


@pytest.mark.compile
def test_a_compiled_step_reduces_outside_the_graph() -> None:
    ft = fdp.FaultTolerance(FakeManager())
    compiled = torch.compile(make_step(ft), backend="eager")
    s = state0()
    for _ in range(3):
        s = ft.step(compiled, s)
    # Compiled, the step may round apart from eager by an ulp (fused multiply-adds).
    la, sa = fdp._tree.flatten(s)
    lb, sb = fdp._tree.flatten(reference(3))
    assert sa == sb
    for x, y in zip(la, lb, strict=True):
        if isinstance(x, torch.Tensor):
            torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)
        else:
            assert x == y


def test_an_asynchronous_quorum_and_a_bad_cap_are_refused() -> None:
    with pytest.raises(ValueError, match=r"fdp.FaultTolerance: `manager` expected a torchft"):
        fdp.FaultTolerance(FakeManager(async_quorum=True))
    with pytest.raises(ValueError, match=r"`bucket_cap_mb` expected a positive number; got 0"):
        fdp.FaultTolerance(FakeManager(), bucket_cap_mb=0)


def test_diloco_refuses_a_fault_tolerance_that_copies_one_state_at_the_first_sync() -> None:
    ft = fdp.FaultTolerance(FakeManager(init_sync=True))
    with pytest.raises(ValueError, match=r"`group` expected a FaultTolerance made with init_sync"):
        fdp.DiLoCo(fdp.optim.sgd(0.1), sync_every=2, group=ft)


def test_diloco_join_refuses_replica_groups() -> None:
    """Replica groups leave the quorum instead of joining."""
    ft = fdp.FaultTolerance(FakeManager(init_sync=False))
    diloco = fdp.DiLoCo(fdp.optim.sgd(0.1), sync_every=2, group=ft)
    params = {"w": torch.ones(3)}
    state = diloco.init(params)
    with (
        pytest.raises(ValueError, match=r"fdp.DiLoCo.join: expected a process group as `group`"),
        diloco.join(params, state),
    ):
        pass


def test_diloco_refuses_a_quantized_wire_across_replica_groups() -> None:
    ft = fdp.FaultTolerance(FakeManager(init_sync=False))
    with pytest.raises(ValueError, match=r"`sync_dtype` expected a floating-point dtype with a"):
        fdp.DiLoCo(fdp.optim.sgd(0.1), sync_every=2, group=ft, sync_dtype=torch.int8)
    with pytest.raises(RuntimeError, match=r"fdp.FaultTolerance.mean_start: called outside"):
        ft.mean_start([torch.ones(2)])
