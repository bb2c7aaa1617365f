"""The persistent worker threads that run replicas beside the caller (``parallel_apply``).

A job is claimed by whichever thread gets to it first (see :class:`Job`);
the workers are daemons, stopped at interpreter exit and forgotten in a
forked child.
"""

from __future__ import annotations

import atexit
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

_SPIN_S = 200e-6

_worker = threading.local()  # .active on the pool's threads


class Job:
    """One replica's call, run by whichever thread claims it first.

    The caller queues replicas 1..n-1 for the workers, runs replica 0, then
    claims and runs inline whatever no worker has started yet. Waking a
    blocked thread costs tens of microseconds, more than a small replica's
    whole forward: stealing makes small calls cost no hand-off at all, while
    large replicas (workers wake long before replica 0 finishes) still run in
    parallel. A caller can always finish its own jobs, so nothing deadlocks
    however many threads call at once.
    """

    __slots__ = ("call", "claim", "done", "error", "result")

    def __init__(self, call: Callable[[], Any]) -> None:
        self.call = call
        self.claim = threading.Lock()
        self.done = threading.Lock()
        self.done.acquire()
        self.result: Any = None
        self.error: BaseException | None = None

    def run_if_unclaimed(self) -> None:
        if not self.claim.acquire(blocking=False):
            return
        try:
            self.result = self.call()
        except BaseException as err:  # handed to the caller, which re-raises it
            self.error = err
        finally:
            # The worker must not keep the replica's arguments (an autograd
            # graph) alive until its next job.
            self.call = _done
            self.done.release()

    def wait(self) -> None:
        done = self.done
        if done.acquire(blocking=False):
            return
        # Poll briefly before blocking (sleep(0) releases the GIL): the last
        # microseconds of a worker's job are cheaper to wait out than a wake-up.
        deadline = time.perf_counter() + _SPIN_S
        while not done.acquire(blocking=False):
            if time.perf_counter() > deadline:
                done.acquire()
                return
            time.sleep(0)


def _done() -> None:
    return None


class Pool:
    """The persistent daemon workers and their queue (``None`` stops a worker)."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()

    def ensure(self, n: int) -> None:
        """Starts workers until there are at least ``n``."""
        with self.lock:
            while len(self.threads) < n:
                name = f"fdp-replica-{len(self.threads)}"
                thread = threading.Thread(target=_work, args=(self.jobs,), name=name, daemon=True)
                thread.start()
                self.threads.append(thread)

    def stop(self, timeout_s: float) -> None:
        """Stops and joins the workers, so none dies inside torch at interpreter exit."""
        with self.lock:
            threads, self.threads = self.threads, []
        for _ in threads:
            self.jobs.put(None)
        deadline = time.monotonic() + timeout_s
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))


def _work(jobs: queue.SimpleQueue[Job | None]) -> None:
    _worker.active = True
    while (job := jobs.get()) is not None:
        job.run_if_unclaimed()
        del job  # the next get() may block for a long time


_pool = Pool()


def _stop_pool() -> None:
    _pool.stop(timeout_s=10.0)


def _reset_pool_after_fork() -> None:
    # The child has none of the parent's threads; a queue they served would
    # collect every job (and its autograd graph) forever.
    global _pool
    _pool = Pool()


# A daemon thread still holding a replica's graph when the interpreter
# finalizes can abort the process (std::terminate); stop workers first.
atexit.register(_stop_pool)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_pool_after_fork)


def start(jobs: Sequence[Job]) -> None:
    """Queues ``jobs`` for the workers, starting as many as there are jobs."""
    pool = _pool
    pool.ensure(len(jobs))
    for job in jobs:
        pool.jobs.put(job)


def threads() -> list[threading.Thread]:
    """The workers now running (a copy)."""
    return list(_pool.threads)


def inside_worker() -> bool:
    """Whether the calling thread is one of the workers."""
    return bool(getattr(_worker, "active", False))
