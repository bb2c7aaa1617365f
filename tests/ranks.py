"""Gloo process groups for the tests: ranks spawned once, reused, never hanging.

``World(n)`` spawns ``n`` processes that join a gloo group on 127.0.0.1 (with
a process-group timeout) and then serve calls: ``world.run(fn, *args)`` runs
``fn(rank, world_size, *args)`` on every rank and returns the results in rank
order. ``fn`` must be a module-level function (it is pickled by name). A rank
that raises makes ``run`` raise ``RankError`` with every rank's traceback; a
call that does not finish within its join timeout kills the ranks and raises
``TimeoutError``. Either way the world is closed, and :func:`world` starts a
fresh one for the next test.
"""

from __future__ import annotations

import datetime
import gc
import multiprocessing as mp
import queue
import socket
import time
import traceback
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.distributed as dist

PG_TIMEOUT_S = 30.0
# A call's bound: cold inductor compiles in every rank, on a machine busy with
# other suites, took over 120 s (torch 2.11's CUDA build); a hang still fails.
JOIN_TIMEOUT_S = 240.0
# How long ranks asked to leave may take to exit before they are killed.
CLOSE_TIMEOUT_S = 10.0


class RankError(RuntimeError):
    """One or more ranks raised."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(rank: int, size: int, port: int, pg_timeout_s: float, inbox: Any, outbox: Any) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        outbox.put((rank, True, "ready"))
    except BaseException as e:
        outbox.put((rank, False, "".join(traceback.format_exception(e))))
        return
    while True:
        job = inbox.get()
        if job is None:
            break
        fn, args = job
        try:
            outbox.put((rank, True, _sendable(fn, fn(rank, size, *args))))
        except BaseException as e:
            outbox.put((rank, False, "".join(traceback.format_exception(e))))
    dist.destroy_process_group()
    # The interpreter's exit collects every object torch and the tests made
    # (0.4 s to over 2 s a rank, CPU bound); frozen, they are left alone.
    gc.freeze()


def _sendable(fn: Any, result: Any) -> Any:
    """``result``, checked to pickle here: the queue pickles in a background thread, and a
    result it cannot send would be dropped there, leaving the caller to its timeout."""
    try:
        ForkingPickler.dumps(result)  # the queue's pickler: torch's tensor reductions
    except Exception as e:
        raise TypeError(
            f"tests.ranks: `{getattr(fn, '__name__', fn)}` returned a result that cannot be "
            f"sent back ({type(e).__name__}: {e}); expected plain values (detach tensors)"
        ) from e
    return result


class World:
    """``size`` gloo ranks serving calls; see the module docstring."""

    def __init__(self, size: int, *, pg_timeout_s: float = PG_TIMEOUT_S) -> None:
        ctx = mp.get_context("spawn")
        self.size = size
        self.closed = False
        self.inboxes = [ctx.Queue() for _ in range(size)]
        self.outbox = ctx.Queue()
        port = free_port()
        self.procs = [
            ctx.Process(
                target=_serve,
                args=(rank, size, port, pg_timeout_s, self.inboxes[rank], self.outbox),
                daemon=True,
            )
            for rank in range(size)
        ]
        for p in self.procs:
            p.start()
        self._collect(range(size), JOIN_TIMEOUT_S, what="joining the process group")

    def _collect(self, ranks: Any, timeout_s: float, *, what: str) -> list[Any]:
        wanted = set(ranks)
        results: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout_s
        while wanted - results.keys():
            try:
                rank, ok, value = self.outbox.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.close()
                missing = sorted(wanted - results.keys())
                raise TimeoutError(
                    f"ranks {missing} did not finish {what} within {timeout_s} s"
                ) from None
            results[rank] = (ok, value)
        failed = {r: v for r, (ok, v) in results.items() if not ok}
        if failed:
            self.close()
            raise RankError(
                "\n".join(f"--- rank {r} raised:\n{tb}" for r, tb in sorted(failed.items()))
            )
        return [results[r][1] for r in sorted(wanted)]

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout_s: float = JOIN_TIMEOUT_S,
        ranks: Any = None,
    ) -> list[Any]:
        """``fn(rank, size, *args)`` on every rank; the results of ``ranks`` (default all)."""
        if self.closed:
            raise RuntimeError("this World is closed")
        for inbox in self.inboxes:
            inbox.put((fn, args))
        return self._collect(
            range(self.size) if ranks is None else ranks, timeout_s, what=fn.__name__
        )

    def close(self) -> None:
        self._stop()
        self._join(time.monotonic() + CLOSE_TIMEOUT_S)

    def _stop(self) -> None:
        """Asks the ranks to leave; `_join` waits for their exits."""
        if self.closed:
            return
        self.closed = True
        for p, inbox in zip(self.procs, self.inboxes, strict=True):
            if p.is_alive():
                inbox.put(None)

    def _join(self, deadline: float) -> None:
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(5)


_worlds: dict[int, World] = {}


def world(size: int) -> World:
    """A live shared world of ``size`` ranks (a fresh one after a failure)."""
    current = _worlds.get(size)
    if current is None or current.closed or not all(p.is_alive() for p in current.procs):
        if current is not None:
            current.close()
        current = _worlds[size] = World(size)
    return current


def close_all() -> None:
    """Closes every world, their ranks exiting side by side."""
    for w in _worlds.values():
        w._stop()
    deadline = time.monotonic() + CLOSE_TIMEOUT_S
    for w in _worlds.values():
        w._join(deadline)
    _worlds.clear()
