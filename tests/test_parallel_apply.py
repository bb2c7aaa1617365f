"""parallel_apply against a sequential loop: results, errors, threads and carried state."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

import fdp
from tests.helpers import fake

FAKE = [fake(i) for i in range(4)]  # distinct devices: replicas run in threads


def affine(p: dict[str, torch.Tensor], x: torch.Tensor, *, shift: float = 0.0) -> torch.Tensor:
    return x @ p["w"] + shift


def concurrently(fn: Callable[..., Any], n: int) -> Callable[..., Any]:
    """fn behind a barrier of n: every replica must run on a thread of its own, or time out."""
    barrier = threading.Barrier(n, timeout=10)

    def wrapped(*args: Any) -> Any:
        barrier.wait()
        return fn(*args)

    return wrapped


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("on", ["cpu", "fake"])
def test_matches_a_sequential_loop(n: int, on: str) -> None:
    torch.manual_seed(n)
    replicas = [{"w": torch.randn(3, 2)} for _ in range(n)]
    inputs = [torch.randn(4, 3) for _ in range(n)]  # bare tensors count as one argument
    kwargs = [{"shift": float(i)} for i in range(n)]
    devices: list[Any] = ["cpu"] * n if on == "cpu" else FAKE[:n]
    got = fdp.parallel_apply(affine, replicas, inputs, kwargs, devices)
    for out, p, x, kw in zip(got, replicas, inputs, kwargs, strict=True):
        torch.testing.assert_close(out, affine(p, x, **kw))


def test_replicas_on_distinct_devices_run_concurrently() -> None:
    fn = concurrently(lambda p, x: p * x, 3)
    assert fdp.parallel_apply(fn, [1, 2, 3], [(10,)] * 3, None, FAKE[:3]) == [10, 20, 30]


def test_cpu_replicas_run_in_a_loop_while_intra_op_threads_use_the_cores() -> None:
    idents: list[int] = []

    def fn(p: Any, x: Any) -> int:
        idents.append(threading.get_ident())
        return 0

    old = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        fdp.parallel_apply(fn, [0, 1, 2], [(0,)] * 3, None, ["cpu"] * 3)
        assert idents == [threading.get_ident()] * 3
        torch.set_num_threads(1)  # no intra-op parallelism: threads put the cores to use
        got = fdp.parallel_apply(concurrently(fn, 2), [0, 1], [(0,)] * 2, None, ["cpu"] * 2)
        assert got == [0, 0]
    finally:
        torch.set_num_threads(old)


def test_tiny_replicas_run_on_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    # Replicas shorter than a thread wake-up run in a loop from the second call on.
    monkeypatch.setattr(sys.modules["fdp.parallel_apply"], "_SMALL_S", 10.0)
    idents: list[int] = []

    def fn(p: Any, x: Any) -> int:
        idents.append(threading.get_ident())
        return 0

    fdp.parallel_apply(fn, [0, 1, 2], [(0,)] * 3, None, FAKE[:3])
    idents.clear()
    fdp.parallel_apply(fn, [0, 1, 2], [(0,)] * 3, None, FAKE[:3])
    assert idents == [threading.get_ident()] * 3


def test_worker_threads_are_reused() -> None:
    def whoami(p: Any, x: Any) -> int:
        return threading.get_ident()

    seen: set[int] = set()
    for _ in range(10):
        fn = concurrently(whoami, 3)
        seen.update(fdp.parallel_apply(fn, [0] * 3, [(0,)] * 3, None, FAKE[:3]))
    # The caller runs replica 0; persistent workers run the rest, every time.
    assert threading.get_ident() in seen
    assert len(seen) <= 1 + 3


@pytest.mark.parametrize("on", ["cpu", "fake"])
def test_first_exception_by_replica_index_after_all_finish(on: str) -> None:
    devices: list[Any] = ["cpu"] * 4 if on == "cpu" else FAKE
    finished: list[int] = []

    def fn(p: int, x: int) -> int:
        if p in (1, 3):
            raise KeyError(f"bad {p}")
        finished.append(p)
        return p

    with pytest.raises(
        KeyError,
        match=rf"parallel_apply: replica 1 on device {devices[1]} raised KeyError: 'bad 1'",
    ) as err:
        fdp.parallel_apply(fn, [0, 1, 2, 3], [(0,)] * 4, devices=devices)
    assert isinstance(err.value.__cause__, KeyError)
    assert sorted(finished) == [0, 2]


def test_exception_in_replica_zero_and_odd_constructors() -> None:
    class OddError(Exception):
        def __init__(self, a: int, b: int) -> None:
            super().__init__(a, b)

    def fn(p: int, x: int) -> int:
        raise OddError(1, 2)

    with pytest.raises(RuntimeError, match=r"replica 0 on device cpu raised OddError") as err:
        fdp.parallel_apply(fn, [0, 1], [(0,), (0,)])
    assert isinstance(err.value.__cause__, OddError)
    with pytest.raises(RuntimeError, match=r"replica 0 on device cpu raised OddError"):
        fdp.parallel_apply(fn, [0], [(0,)])


def test_length_mismatches() -> None:
    with pytest.raises(ValueError, match=r"`inputs` expected one entry per replica \(2\); got 1"):
        fdp.parallel_apply(affine, [0, 1], [(0,)])
    with pytest.raises(ValueError, match=r"`kwargs` expected one dict per replica \(2\); got 3"):
        fdp.parallel_apply(affine, [0, 1], [(0,)] * 2, [{}] * 3)
    with pytest.raises(ValueError, match=r"`devices` expected one device per replica \(2\); got 1"):
        fdp.parallel_apply(affine, [0, 1], [(0,)] * 2, None, ["cpu"])


def state_probe(p: Any, x: Any) -> tuple[bool, bool, bool, torch.dtype]:
    return (
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        torch.is_autocast_enabled("cpu"),
        (torch.ones(2, 2) @ torch.ones(2, 2)).dtype,
    )


def test_grad_inference_and_autocast_state_reach_the_workers() -> None:
    def probe() -> list[Any]:
        # The barrier makes replicas 1 and 2 run on worker threads.
        fn = concurrently(state_probe, 3)
        return fdp.parallel_apply(fn, [0] * 3, [(0,)] * 3, None, FAKE[:3])

    assert probe() == [(True, False, False, torch.float32)] * 3
    with torch.no_grad():
        assert probe() == [(False, False, False, torch.float32)] * 3
    with torch.inference_mode():
        assert probe() == [(False, True, False, torch.float32)] * 3
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert probe() == [(True, False, True, torch.bfloat16)] * 3


def test_runs_inline_under_torch_func_transforms() -> None:
    main = threading.get_ident()
    idents: list[int] = []

    def fn(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        idents.append(threading.get_ident())
        return (p * x).sum()

    def loss(p: torch.Tensor) -> torch.Tensor:
        outs = fdp.parallel_apply(fn, [p, p, p], [(torch.ones(2) * k,) for k in (1, 2, 3)])
        return torch.stack(outs).sum()

    grad = torch.func.grad(loss)(torch.randn(2))
    assert idents == [main] * 3
    torch.testing.assert_close(grad, torch.full((2,), 6.0))


def test_nested_data_parallel_does_not_deadlock() -> None:
    params = {"w": torch.randn(3, 3)}
    x = torch.randn(8, 3)

    def inner(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ p["w"])

    def outer(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return fdp.data_parallel(inner, p, x, devices=["cpu"] * 4) * 2  # type: ignore[no-any-return]

    got = fdp.data_parallel(outer, params, x, devices=["cpu"] * 4)
    torch.testing.assert_close(got, inner(params, x) * 2)
