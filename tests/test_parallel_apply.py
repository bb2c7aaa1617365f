"""parallel_apply against a sequential loop: results, errors, threads and carried state."""

from __future__ import annotations

import sys
import threading
from typing import Any

import pytest
import torch

import fdp


def affine(p: dict[str, torch.Tensor], x: torch.Tensor, *, shift: float = 0.0) -> torch.Tensor:
    return x @ p["w"] + shift


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_matches_a_sequential_loop(n: int) -> None:
    torch.manual_seed(n)
    replicas = [{"w": torch.randn(3, 2)} for _ in range(n)]
    inputs = [torch.randn(4, 3) for _ in range(n)]  # bare tensors count as one argument
    kwargs = [{"shift": float(i)} for i in range(n)]
    got = fdp.parallel_apply(affine, replicas, inputs, kwargs, ["cpu"] * n)
    for out, p, x, kw in zip(got, replicas, inputs, kwargs, strict=True):
        torch.testing.assert_close(out, affine(p, x, **kw))


def test_replicas_run_concurrently() -> None:
    # Each replica waits for all the others: a sequential loop would time out.
    barrier = threading.Barrier(3, timeout=10)

    def fn(p: int, x: int) -> int:
        barrier.wait()
        return p * x

    assert fdp.parallel_apply(fn, [1, 2, 3], [(10,), (10,), (10,)]) == [10, 20, 30]


def test_concurrent_cpu_replicas_share_intra_op_threads() -> None:
    total = torch.get_num_threads()
    barrier = threading.Barrier(2, timeout=10)

    def fn(p: Any, x: Any) -> int:
        barrier.wait()
        return torch.get_num_threads()

    assert fdp.parallel_apply(fn, [0, 0], [(0,), (0,)]) == [max(1, total // 2)] * 2
    assert torch.get_num_threads() == total


def test_tiny_replicas_run_on_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    # Replicas shorter than a thread wake-up run in a loop from the second call on.
    monkeypatch.setattr(sys.modules["fdp.parallel_apply"], "_SMALL_S", 10.0)
    idents: list[int] = []

    def fn(p: Any, x: Any) -> int:
        idents.append(threading.get_ident())
        return 0

    fdp.parallel_apply(fn, [0, 1, 2], [(0,)] * 3)
    idents.clear()
    fdp.parallel_apply(fn, [0, 1, 2], [(0,)] * 3)
    assert idents == [threading.get_ident()] * 3


def test_thread_pool_is_reused() -> None:
    def whoami(p: Any, x: Any) -> int:
        return threading.get_ident()

    seen = {i for _ in range(20) for i in fdp.parallel_apply(whoami, [0] * 3, [(0,)] * 3)}
    # The caller runs replica 0; two pool workers run the rest, every time.
    assert threading.get_ident() in seen
    assert len(seen) <= 1 + 3  # at most the caller and one pool's workers


def test_first_exception_by_replica_index_after_all_finish() -> None:
    finished: list[int] = []

    def fn(p: int, x: int) -> int:
        if p in (1, 3):
            raise KeyError(f"bad {p}")
        finished.append(p)
        return p

    with pytest.raises(
        KeyError, match=r"fdp.parallel_apply: replica 1 on device cpu raised KeyError: 'bad 1'"
    ) as err:
        fdp.parallel_apply(fn, [0, 1, 2, 3], [(0,)] * 4, devices=["cpu"] * 4)
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
    n = 3
    expected_default = (True, False, False, torch.float32)
    assert fdp.parallel_apply(state_probe, [0] * n, [(0,)] * n) == [expected_default] * n
    with torch.no_grad():
        assert (
            fdp.parallel_apply(state_probe, [0] * n, [(0,)] * n)
            == [(False, False, False, torch.float32)] * n
        )
    with torch.inference_mode():
        got = fdp.parallel_apply(state_probe, [0] * n, [(0,)] * n)
    assert got == [(False, True, False, torch.float32)] * n
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = fdp.parallel_apply(state_probe, [0] * n, [(0,)] * n)
    assert got == [(True, False, True, torch.bfloat16)] * n


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
