"""Side-by-side timing shared by the benchmarks.

The machine may be shared and noisy, so the benchmarks report ratios of two
measurements interleaved round by round, taking the median over rounds.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

# glibc's allocator held steady, read when a process starts: a fixed mmap
# threshold above a step's largest block, and no trimming, so freed blocks
# stay in the heap for the next step (as CUDA's caching allocator keeps them).
STEADY_ALLOCATOR = {
    "MALLOC_MMAP_THRESHOLD_": str(256 * 2**20),
    "MALLOC_TRIM_THRESHOLD_": str(2**30),
}


def timed(fn: Callable[[], Any], repeats: int, sync: Callable[[], None]) -> float:
    """Seconds per call, over ``repeats`` calls."""
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - start) / repeats


def _alternated(
    a: Callable[[], Any],
    b: Callable[[], Any],
    rounds: int,
    repeats: int,
    sync: Callable[[], None],
) -> tuple[list[float], list[float]]:
    """Seconds per call of ``a`` and ``b``, one of each per round, in alternating order."""
    for _ in range(max(2, repeats // 4)):  # warm-up: pools, allocator, caches
        a()
        b()
    ta, tb = [], []
    for r in range(rounds):
        # Alternate which goes first so drift does not favour one side.
        first, second = (a, b) if r % 2 == 0 else (b, a)
        t1 = timed(first, repeats, sync)
        t2 = timed(second, repeats, sync)
        ta.append(t1 if r % 2 == 0 else t2)
        tb.append(t2 if r % 2 == 0 else t1)
    return ta, tb


def side_by_side(
    a: Callable[[], Any],
    b: Callable[[], Any],
    *,
    rounds: int,
    repeats: int,
    sync: Callable[[], None] = lambda: None,
) -> tuple[float, float]:
    """Median seconds per call of ``a`` and ``b``, interleaved round by round."""
    ta, tb = _alternated(a, b, rounds, repeats, sync)
    return statistics.median(ta), statistics.median(tb)


def paired(
    a: Callable[[], Any],
    b: Callable[[], Any],
    *,
    rounds: int,
    repeats: int,
    sync: Callable[[], None] = lambda: None,
) -> tuple[float, float, float]:
    """``b`` against ``a`` head to head: the median of each round's ratio ``b / a``.

    Each round times the two back to back, alternating which goes first;
    a round's ratio compares two timings seconds apart, so drift over the
    run cancels, which a ratio of two medians over the run does not.
    Returns ``(ratio, median seconds of a, median seconds of b)``.
    """
    ta, tb = _alternated(a, b, rounds, repeats, sync)
    ratio = statistics.median(y / x for x, y in zip(ta, tb, strict=True))
    return ratio, statistics.median(ta), statistics.median(tb)


def interleaved(
    fns: dict[str, Callable[[], Any]],
    *,
    rounds: int,
    repeats: int,
    sync: Callable[[], None] = lambda: None,
) -> dict[str, float]:
    """Median seconds per call of each of ``fns``, interleaved round by round.

    The order rotates every round, so that drift and the cost of switching
    from one function to the next fall on each of them alike.
    """
    names = list(fns)
    for _ in range(max(2, repeats // 4)):
        for name in names:
            fns[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            times[name].append(timed(fns[name], repeats, sync))
    return {name: statistics.median(t) for name, t in times.items()}


def run_ranks(target: Callable[..., None], size: int, *args: Any, timeout_s: float = 1800) -> None:
    """``target(rank, size, port, *args)`` on ``size`` spawned processes (gloo on 127.0.0.1).

    Exits with the ranks' exit codes if any fails; a rank still running at
    the timeout is killed.
    """
    import multiprocessing as mp
    import socket
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(rank, size, port, *args)) for rank in range(size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    if any(p.exitcode != 0 for p in procs):
        for p in procs:
            if p.is_alive():
                p.kill()
        sys.exit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
