"""fdp inside torch.compile: graph breaks, numerics against eager, recompiles, threads.

Most tests compile with the "eager" or "aot_eager" backends (dynamo and
AOTAutograd, no code generation) to keep the suite fast; one compiles with
inductor. Every result is compared with a plain single-call eager reference.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any
from unittest import mock

import optree
import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import fdp
from fdp import _bucket, _parallel_apply, _replicate
from tests import ranks
from tests.helpers import (
    PER_RANK,
    Pair,
    batch,
    detached_copy,
    grads_of,
    leaves,
    mlp,
    mlp_params,
    shard,
    tree_allclose,
)

pytestmark = pytest.mark.compile
DEVICES = ["cpu", "cpu"]


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def make_params(seed: int = 0) -> dict[str, Any]:
    return mlp_params(seed, depth=1)


model = mlp


def loss_dp(params: dict[str, Any], x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = fdp.data_parallel(model, params, x, devices=DEVICES)
    return out.square().mean()


def loss_ref(params: dict[str, Any], x: torch.Tensor) -> torch.Tensor:
    return model(params, x).square().mean()


def data(n: int = 7, seed: int = 1) -> torch.Tensor:
    return batch(n, seed=seed)[0]


def test_data_parallel_traces_into_one_graph() -> None:
    explanation = torch._dynamo.explain(loss_dp)(make_params(), data())
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_data_parallel_matches_eager(backend: str) -> None:
    params, x = make_params(), data()
    reference = detached_copy(params)
    torch.autograd.backward(loss_ref(reference, x))
    compiled = torch.compile(loss_dp, fullgraph=True, backend=backend)
    out = compiled(params, x)
    torch.testing.assert_close(out, loss_ref(reference, x))
    torch.autograd.backward(out)
    for got, expected in zip(grads_of(params), grads_of(reference), strict=True):
        torch.testing.assert_close(got, expected)


def test_compiled_func_grad_over_data_parallel() -> None:
    params, x = make_params(), data()
    plain = optree.tree_map(lambda t: t.detach(), params["layers"])
    head = params["head"].first.detach()

    def loss(layers: Any, head: torch.Tensor, fn: Any) -> torch.Tensor:
        result: torch.Tensor = fn({"layers": layers, "head": Pair(head, None)}, x)
        return result

    grad = torch.func.grad(loss, argnums=(0, 1))
    expected = grad(plain, head, loss_ref)
    got = torch.compile(grad, fullgraph=True, backend="aot_eager")(plain, head, loss_dp)
    tree_allclose(got, expected)


def test_inductor_training_matches_eager() -> None:
    params, reference = make_params(), make_params()
    compiled = torch.compile(loss_dp, backend="inductor")
    for step in range(3):
        x = data(seed=step)
        for p, fn in ((params, compiled), (reference, loss_ref)):
            torch.autograd.backward(fn(p, x))
            with torch.no_grad():
                for t in leaves(p):
                    if t is not None:
                        t -= 0.1 * t.grad
                        t.grad = None
    tree_allclose(params, reference, rtol=1e-5, atol=1e-5)


def test_a_training_loop_compiles_once() -> None:
    counter = CompileCounterWithBackend("eager")

    @torch.compile(backend=counter, fullgraph=True)
    def step(params: Any, x: torch.Tensor) -> Any:
        grads = torch.func.grad(lambda p: loss_dp({**p, "head": Pair(p["head"], None)}, x))(params)
        return optree.tree_map(lambda p, g: p - 0.1 * g, params, grads)

    params: Any = {"layers": make_params()["layers"], "head": make_params()["head"].first}
    params = optree.tree_map(lambda t: t.detach(), params)
    for i in range(12):  # new parameter tensors and new data every step
        params = step(params, data(seed=i))
    assert counter.frame_count == 1


def test_batches_of_other_sizes_compile_a_dynamic_graph_that_matches_eager() -> None:
    # A smaller last batch: dynamo recompiles with a symbolic batch size, which
    # the split must take (divmod of one failed under fullgraph=True).
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(loss_dp, fullgraph=True, backend=counter)
    for n in (8, 6, 7, 5, 9):
        params, x = make_params(), data(n, seed=n)
        reference = detached_copy(params)
        expected = loss_ref(reference, x)
        torch.autograd.backward(expected)
        out = compiled(params, x)
        torch.testing.assert_close(out, expected)
        torch.autograd.backward(out)
        for got, want in zip(grads_of(params), grads_of(reference), strict=True):
            torch.testing.assert_close(got, want)
    # The first size, then a symbolic one, for an even and an odd batch (the
    # remainder is specialized); the later sizes reuse those.
    assert counter.frame_count <= 3


def test_compiled_function_in_worker_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    # CPU replicas forced onto fdp's worker threads, the path replicas on
    # distinct devices take (a compiled function on a fake device is not traceable).
    module = _parallel_apply
    monkeypatch.setattr(module, "_all_cpu", lambda devices: False)
    threads: set[int] = set()
    original = module._call
    # In thread mode (state given) both replicas meet at a barrier, so replica 1
    # runs on a worker whatever the scheduling (the caller cannot steal it).
    barrier = threading.Barrier(len(DEVICES), timeout=30)

    def recording(*args: Any, **kwargs: Any) -> Any:
        threads.add(threading.get_ident())
        if args[5] is not None:
            barrier.wait()
        return original(*args, **kwargs)

    monkeypatch.setattr(module, "_call", recording)
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(model, backend=counter)
    params = make_params()
    x = data(n=64)
    with torch.no_grad():
        expected = model(params, x)
        first = fdp.data_parallel(compiled, params, x, devices=DEVICES)
        compiles = counter.frame_count
        for _ in range(5):
            torch.testing.assert_close(
                fdp.data_parallel(compiled, params, x, devices=DEVICES), expected
            )
    torch.testing.assert_close(first, expected)
    assert compiles == counter.frame_count == 1  # warmed on the caller, never again
    assert len(threads) > 1  # later calls did run in workers


# --- the trap: compiled torch.func.grad drops a custom Function's backward ----


@pytest.fixture
def forced_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Makes replicate copy even onto the source device, as it does across GPUs."""

    def plan(tensors: list[torch.Tensor], targets: list[torch.device]) -> Any:
        buckets = _bucket.plan(tensors, cap_bytes=1 << 40)
        return tuple((bucket, target) for target in targets for bucket in buckets)

    monkeypatch.setattr(_replicate, "_plan", plan)
    monkeypatch.setattr(_replicate, "_shared_as_is", lambda leaves, targets: False)


def replica_sum_loss(params: dict[str, torch.Tensor]) -> torch.Tensor:
    a, b = fdp.replicate(params, DEVICES)
    total: torch.Tensor = (a["w"] * a["v"]).sum() + 2 * (b["w"] * b["v"]).sum()
    return total


class _Doubled(torch.autograd.Function):
    """The identity whose backward doubles: shows whether compiling keeps a custom backward."""

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return x * 1.0

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return 2 * grad


def _compiled_grad_keeps_custom_backward() -> bool:
    """Whether this torch keeps a Function's backward in a compiled torch.func.grad (#193279)."""
    torch._dynamo.reset()

    def loss(x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = _Doubled.apply(x)  # type: ignore[no-untyped-call]
        return out.sum()

    got = torch.compile(torch.func.grad(loss), backend="aot_eager", fullgraph=True)(torch.ones(2))
    torch._dynamo.reset()
    return bool((got == 2).all())


@pytest.mark.usefixtures("forced_copies")
def test_copies_under_compiled_func_grad_are_correct_or_raise() -> None:
    # Where torch drops the copies' custom backward (up to 2.14), the compiled
    # gradients would be silently wrong: dynamo then gives up on the transform
    # (it runs eagerly, correct), or fullgraph=True raises fdp's error. Where
    # torch keeps it (2.15), the fullgraph compile is right.
    params = {"w": torch.ones(3), "v": torch.full((3,), 2.0)}
    copies = 0
    copy_group = _replicate._copy_group

    def counted(*args: Any) -> list[torch.Tensor]:
        nonlocal copies
        copies += 1
        return copy_group(*args)

    with mock.patch.object(_replicate, "_copy_group", counted):
        eager = torch.func.grad(replica_sum_loss)(params)
    assert copies > 0  # the copies exist, and are correct
    torch.testing.assert_close(eager["w"], torch.full((3,), 6.0))
    compiled = torch.compile(torch.func.grad(replica_sum_loss), backend="aot_eager")(params)
    tree_allclose(compiled, eager)
    keeps = _compiled_grad_keeps_custom_backward()
    strict = torch.compile(torch.func.grad(replica_sum_loss), backend="aot_eager", fullgraph=True)
    if keeps:
        tree_allclose(strict(params), eager)
    else:
        with pytest.raises(Exception, match=r"(?s)pytorch/pytorch#193279.*\.backward\(\)"):
            strict(params)


@pytest.mark.usefixtures("forced_copies")
def test_copies_in_a_compiled_loss_with_backward_are_correct() -> None:
    params = {"w": torch.ones(3, requires_grad=True), "v": torch.full((3,), 2.0)}
    torch.autograd.backward(torch.compile(replica_sum_loss, backend="aot_eager")(params))
    assert params["w"].grad is not None
    torch.testing.assert_close(params["w"].grad, torch.full((3,), 6.0))


# --- across processes ----------------------------------------------------------


def _compiled_sgd(rank: int, size: int, steps: int) -> Any:
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")

    @torch.compile(backend=counter, fullgraph=True)
    def step(params: Any, x: torch.Tensor) -> Any:
        grads = torch.func.grad(lambda p: loss_ref({**p, "head": Pair(p["head"], None)}, x))(params)
        grads = fdp.all_reduce_grads(grads, bucket_cap_mb=1e-4)  # several buckets
        return optree.tree_map(lambda p, g: p - 0.1 * g, params, grads)

    full = make_params()
    params: Any = {"layers": full["layers"], "head": full["head"].first}
    params = optree.tree_map(lambda t: t.detach(), params)
    for i in range(steps):
        params = step(params, shard(data(n=size * PER_RANK, seed=i), rank))
    return params, counter.frame_count


def test_compiled_step_with_all_reduce_grads_matches_full_batch_training() -> None:
    size, steps = 2, 4
    results = ranks.world(size).run(_compiled_sgd, steps)
    full = make_params()
    reference: Any = {"layers": full["layers"], "head": full["head"].first}
    reference = optree.tree_map(lambda t: t.detach(), reference)
    for i in range(steps):
        x = data(n=size * PER_RANK, seed=i)
        grads = torch.func.grad(lambda p, x=x: loss_ref({**p, "head": Pair(p["head"], None)}, x))(
            reference
        )
        reference = optree.tree_map(lambda p, g: p - 0.1 * g, reference, grads)
    for params, frames in results:
        tree_allclose(params, reference, rtol=1e-5, atol=1e-6)
        assert frames == 1


def _compiled_ddp(rank: int, size: int) -> Any:
    torch._dynamo.reset()
    params = make_params()
    x = shard(data(n=size * PER_RANK), rank)
    ddp = fdp.DistributedDataParallel(params, bucket_cap_mb=1e-4, first_bucket_cap_mb=1e-4)
    compiled = torch.compile(lambda p, x: loss_ref(ddp(p), x), backend="aot_eager")
    torch.autograd.backward(compiled(params, x))
    backward_grads = grads_of(params)

    layers = optree.tree_map(lambda t: t.detach(), params["layers"])
    head = params["head"].first.detach()
    ddp2 = fdp.DistributedDataParallel({"layers": layers, "head": Pair(head, None)})

    def loss(layers: Any, head: torch.Tensor) -> torch.Tensor:
        return loss_ref(ddp2({"layers": layers, "head": Pair(head, None)}), x)

    grad = torch.func.grad(loss, argnums=(0, 1))
    func_grads = torch.compile(grad, backend="aot_eager")(layers, head)
    return backward_grads, func_grads


def test_ddp_in_compiled_losses_reduces_correctly() -> None:
    size = 2
    (backward_grads, func_grads), *_ = ranks.world(size).run(_compiled_ddp)
    reference = make_params()
    torch.autograd.backward(loss_ref(reference, data(n=size * PER_RANK)))
    expected = grads_of(reference)
    for got, ref in zip(backward_grads, expected, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    layers, head = func_grads
    got_func = [*leaves(layers), head]
    ordered = [*(t.grad for t in leaves(reference["layers"])), reference["head"].first.grad]
    for got, ref in zip(got_func, ordered, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


class _Checkpointed(torch.nn.Module):
    """Non-reentrant checkpointing around a block with a graph break: dynamo leaves it eager."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(6, 8)
        self.outer = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 3)

    def block(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inner(x))
        torch._dynamo.graph_break()
        return torch.tanh(self.outer(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)
        return self.head(h)  # type: ignore[no-any-return]


def _checkpointed_net() -> tuple[_Checkpointed, dict[str, torch.Tensor]]:
    """The net, and state unlike its own tensors: a recompute with the module's is wrong."""
    torch.manual_seed(0)
    net = _Checkpointed()
    state = {k: (v.detach() * 1.5 + 0.1).requires_grad_() for k, v in net.state_dict().items()}
    return net, state


def _compiled_ddp_checkpointed(rank: int, size: int) -> list[torch.Tensor | None]:
    torch._dynamo.reset()
    net, state = _checkpointed_net()
    fn, _ = fdp.make_functional(net)
    ddp = fdp.DistributedDataParallel(state, bucket_cap_mb=1e-4, first_bucket_cap_mb=1e-4)
    x = shard(data(n=size * PER_RANK), rank)
    compiled = torch.compile(lambda s, x: fn(ddp(s), x).square().mean(), backend="aot_eager")
    torch.autograd.backward(compiled(state, x))
    return [t.grad for t in state.values()]


@pytest.mark.filterwarnings(
    # dynamo reads .grad of the resumed frame's non-leaf input (torch 2.13), a warning
    "ignore:The .grad attribute of a Tensor that is not a leaf Tensor:UserWarning"
)
def test_ddp_in_a_compiled_loss_with_a_graph_broken_checkpoint_reduces_correctly() -> None:
    size = 2
    results = ranks.world(size).run(_compiled_ddp_checkpointed)
    net, state = _checkpointed_net()
    net.load_state_dict({k: v.detach() for k, v in state.items()})
    torch.autograd.backward(net(data(n=size * PER_RANK)).square().mean())
    for got in results:
        for g, p in zip(got, net.parameters(), strict=True):
            torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-6)
