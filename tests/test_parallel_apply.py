"""parallel_apply against a sequential loop: results, errors, threads and carried state."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import fdp
from fdp import _parallel_apply, _workers
from tests.helpers import fake, label

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


@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_replicas_run_in_a_loop_whatever_the_intra_op_threads(threads: int) -> None:
    idents: list[int] = []

    def fn(p: int, x: Any) -> int:
        idents.append(threading.get_ident())
        return p

    old = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        assert fdp.parallel_apply(fn, [0, 1, 2], [(0,)] * 3, None, ["cpu"] * 3) == [0, 1, 2]
        assert idents == [threading.get_ident()] * 3
    finally:
        torch.set_num_threads(old)


def test_the_thread_or_loop_choice_does_not_depend_on_timing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A tiny function on distinct devices: the threaded path on every call,
    # however fast replica 0 was the call before.
    paths: list[str] = []
    for name in ("_threaded", "_loop"):
        original = getattr(_parallel_apply, name)

        def recording(*args: Any, _name: str = name, _original: Any = original, **kw: Any) -> Any:
            paths.append(_name)
            return _original(*args, **kw)

        monkeypatch.setattr(_parallel_apply, name, recording)
    for _ in range(5):
        fdp.parallel_apply(lambda p, x: p, [0, 1, 2], [(0,)] * 3, None, FAKE[:3])
    assert paths == ["_threaded"] * 5


def test_worker_threads_are_reused() -> None:
    def whoami(p: Any, x: Any) -> threading.Thread:
        # Thread objects, not idents: an ident is reused once a thread exits,
        # so a pool making a thread per call could pass an ident count.
        return threading.current_thread()

    seen: set[threading.Thread] = set()
    fdp.parallel_apply(concurrently(whoami, 3), [0] * 3, [(0,)] * 3, None, FAKE[:3])
    pool = _workers.threads()
    for _ in range(10):
        fn = concurrently(whoami, 3)
        seen.update(fdp.parallel_apply(fn, [0] * 3, [(0,)] * 3, None, FAKE[:3]))
    # The caller runs replica 0; the same persistent workers run the rest, every time.
    assert threading.current_thread() in seen
    assert seen - {threading.current_thread()} <= set(pool)
    assert _workers.threads() == pool


@pytest.mark.parametrize("on", ["cpu", "fake"])
def test_first_exception_by_replica_index_after_all_finish(on: str) -> None:
    devices: list[Any] = ["cpu"] * 4 if on == "cpu" else FAKE
    finished: list[int] = []
    raised: dict[int, KeyError] = {}

    def fn(p: int, x: int) -> int:
        if p in (1, 3):
            raised[p] = KeyError(f"bad {p}")
            raise raised[p]
        finished.append(p)
        return p

    with pytest.raises(KeyError) as err:
        fdp.parallel_apply(fn, [0, 1, 2, 3], [(0,)] * 4, devices=devices)
    # The replica's own exception object, untouched but for a note.
    assert err.value is raised[1]
    assert err.value.args == ("bad 1",)
    assert getattr(err.value, "__notes__", None) == [
        f"fdp.parallel_apply: raised by replica 1 on device {devices[1]}"
    ]
    assert sorted(finished) == [0, 2]


class OddError(Exception):
    def __init__(self, a: int, b: int) -> None:
        super().__init__(a, b)
        self.total = a + b


@pytest.mark.parametrize("on", ["cpu", "fake"])
@pytest.mark.parametrize("replica", [0, 1])
def test_exceptions_keep_their_identity(on: str, replica: int) -> None:
    devices: list[Any] = ["cpu"] * 2 if on == "cpu" else FAKE[:2]

    def identity(p: int, x: int) -> int:
        return p

    fn = concurrently(identity, 2) if on == "fake" else identity

    def raising(exc: BaseException) -> Callable[..., Any]:
        def body(p: int, x: int) -> int:
            fn(p, x)
            if p == replica:
                raise exc
            return p

        return body

    with pytest.raises(OddError) as odd:
        fdp.parallel_apply(raising(OddError(1, 2)), [0, 1], [(0,)] * 2, None, devices)
    assert (odd.value.args, odd.value.total) == ((1, 2), 3)
    with pytest.raises(SystemExit) as exit_:
        fdp.parallel_apply(raising(SystemExit(0)), [0, 1], [(0,)] * 2, None, devices)
    assert exit_.value.code == 0
    assert "raised by replica" in getattr(exit_.value, "__notes__", [""])[0]


def test_keyboard_interrupt_in_replica_zero_waits_for_the_others() -> None:
    finished = threading.Event()
    started = threading.Event()

    def fn(p: int, x: int) -> int:
        if p == 0:
            started.wait(10)  # replica 1 is running on a worker
            raise KeyboardInterrupt
        started.set()
        time.sleep(0.05)  # still running when replica 0 raises; no result depends on it
        finished.set()
        return p

    with pytest.raises(KeyboardInterrupt):
        fdp.parallel_apply(fn, [0, 1], [(0,)] * 2, None, FAKE[:2])
    assert finished.is_set()


def test_bad_replicas() -> None:
    with pytest.raises(ValueError, match=r"`replicas` expected at least one replica; got none"):
        fdp.parallel_apply(affine, [], [])
    with pytest.raises(TypeError, match=r"`replicas` expected a sequence .* got dict"):
        fdp.parallel_apply(affine, {"a": 1}, [(0,)])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"`kwargs\[1\]` expected a dict .* got int"):
        fdp.parallel_apply(affine, [0, 1], [(0,)] * 2, [{}, 3])  # type: ignore[list-item]


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
        return fdp.data_parallel(inner, p, x, devices=["cpu"] * 4) * 2

    got = fdp.data_parallel(outer, params, x, devices=["cpu"] * 4)
    torch.testing.assert_close(got, inner(params, x) * 2)


def flops_of(run: Callable[[], Any]) -> int:
    with FlopCounterMode(display=False) as counter:
        run()
    return int(counter.get_total_flops())


@pytest.mark.parametrize("devices", [FAKE[:3], ["cpu"] * 3])
def test_dispatch_modes_see_every_replica(
    devices: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # One intra-op thread: CPU replicas would run in workers (as fake devices do).
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    ps = [{"w": torch.randn(5, 4)} for _ in range(3)]
    xs = [(torch.randn(6, 5),) for _ in range(3)]
    expected = flops_of(lambda: [affine(p, *x) for p, x in zip(ps, xs, strict=True)])
    assert expected > 0
    assert flops_of(lambda: fdp.parallel_apply(affine, ps, xs, None, devices)) == expected


def test_saved_tensor_hooks_reach_every_replica(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    packed: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append(threading.get_ident())
        return t

    w = torch.randn(5, 4, requires_grad=True)
    x = torch.randn(6, 5)

    def fn(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ p).sum()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(w, x)
        n_reference = len(packed)
        packed.clear()
        outs = fdp.parallel_apply(fn, [w, w, w], [(x,)] * 3, None, ["cpu"] * 3)
    assert len(packed) == 3 * n_reference > 0
    torch.autograd.backward(torch.stack(outs).sum())
    reference = torch.func.grad(lambda w: 3 * fn(w, x))(w)
    torch.testing.assert_close(w.grad, reference)


def test_default_device_context_reaches_the_workers() -> None:
    def fn(p: Any, x: Any) -> torch.device:
        return torch.empty(1).device

    probe = concurrently(fn, 3)
    with torch.device("meta"):
        got = fdp.parallel_apply(probe, [0] * 3, [(0,)] * 3, None, FAKE[:3])
    assert got == [torch.device("meta")] * 3


def _thread_mode_calls(n_calls: int) -> torch.Tensor:
    """The last output (its graph alive) after ``n_calls`` calls, replicas on worker threads."""
    w = label(torch.randn(32, 32, requires_grad=True), 0)
    x = label(torch.randn(64, 32), 0)
    for _ in range(n_calls):
        y: torch.Tensor = fdp.data_parallel(lambda p, x: torch.tanh(x @ p), w, x, devices=FAKE[:3])
    return y


def test_a_forked_child_gets_fresh_workers(tmp_path: Any) -> None:
    if not hasattr(os, "fork"):
        pytest.skip("no os.fork on this platform")
    _thread_mode_calls(2)  # the parent's workers exist
    script = tmp_path / "child.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, sys, threading, weakref, torch, fdp
            dev = [torch.device("meta", i) for i in range(3)]
            fdp.parallel_apply(lambda p, x: p, [0, 1, 2], [(0,)] * 3, None, dev)
            pid = os.fork()
            if pid == 0:
                barrier = threading.Barrier(3, timeout=10)
                class Out: pass
                def fn(p, x):
                    barrier.wait()  # needs a thread per replica: real workers
                    return Out()
                for _ in range(5):
                    outs = fdp.parallel_apply(fn, [1, 2, 3], [(2,)] * 3, None, dev)
                refs = [weakref.ref(o) for o in outs]
                del outs
                # Nothing keeps the results alive (a queue no thread serves would).
                os._exit(0 if all(r() is None for r in refs) else 3)
            _, status = os.waitpid(pid, 0)
            sys.exit(os.waitstatus_to_exitcode(status))
            """
        )
    )
    done = subprocess.run([sys.executable, str(script)], timeout=120, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()[-2000:]


def test_clean_exit_after_thread_mode_calls(tmp_path: Any) -> None:
    # A graph still alive at exit, built by replicas in worker threads: the
    # workers must be gone before the interpreter finalizes (it used to abort
    # with "terminate called without an active exception" about 1 run in 20;
    # a few runs here, more in the closing note of issue 8).
    script = tmp_path / "exit.py"
    script.write_text(
        f"import sys\nsys.path.insert(0, {os.getcwd()!r})\nfrom tests.test_parallel_apply import "
        "_thread_mode_calls\ny = _thread_mode_calls(20)\n"
    )
    for _ in range(3):
        done = subprocess.run([sys.executable, str(script)], timeout=120, capture_output=True)
        assert done.returncode == 0, done.stderr.decode()[-2000:]
