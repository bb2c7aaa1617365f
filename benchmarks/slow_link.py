"""A simulated wide-area link between ranks, for benchmarks (not part of fdp).

Inside ``with SlowLink(latency_s=0.05, gbit_s=1.0) as link:`` every
all-reduce, all-to-all and all-gather that fdp starts runs as usual over
gloo, and then completes no earlier than the link allows: each one occupies
the link (one per rank, in the order started) for ``bytes / bandwidth`` and
arrives ``latency`` after that. ``bytes`` is what this rank sends: a ring
all-reduce ``2 (world - 1) / world`` times the buffer, an all-to-all
``(world - 1) / world`` of its input, an all-gather ``world - 1`` times its
part. A blocking call sleeps until its arrival; a started one returns a work
whose ``wait()`` does, so a reduction started early overlaps whatever runs
before its wait. ``link.sent`` counts the bytes.

The hooks replace ``torch.distributed.all_reduce`` and
``torch.distributed.all_to_all_single`` (called through the module by fdp)
and fdp's all-gather entry point, and put them back on exit.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

import fdp._compat


class _Arriving:
    """A started collective's work that waits until the link delivers it."""

    def __init__(self, work: Any, due: float) -> None:
        self.work, self.due = work, due

    def wait(self, *args: Any) -> bool:
        if self.work is not None:
            self.work.wait(*args)
        time.sleep(max(0.0, self.due - time.perf_counter()))
        return True

    def is_completed(self) -> bool:
        return bool(self.work is None or self.work.is_completed()) and (
            time.perf_counter() >= self.due
        )


class SlowLink:
    """Delays fdp's collectives by latency + bytes / bandwidth (see the module)."""

    def __init__(self, *, latency_s: float, gbit_s: float) -> None:
        self.latency_s, self.bytes_s = latency_s, gbit_s * 1e9 / 8
        self.sent, self.free_at = 0, 0.0
        self._saved: list[tuple[Any, str, Any]] = []

    def _due(self, nbytes: float) -> float:
        self.sent += int(nbytes)
        start = max(time.perf_counter(), self.free_at)
        self.free_at = start + nbytes / self.bytes_s
        return self.free_at + self.latency_s

    def _wrap(self, fn: Any, share: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            due = self._due(share(*args, **kwargs))
            work = fn(*args, **kwargs)
            # fdp's all-gather entry point always starts its collective. (A bound
            # method is made anew at each access: ``fn is self._gather`` is never true.)
            if kwargs.get("async_op", fn == self._gather):
                return _Arriving(work, due)
            _Arriving(None, due).wait()
            return work

        return call

    def _gather(self, out: torch.Tensor, part: torch.Tensor, group: Any) -> Any:
        return self._saved_gather(out, part, group)

    def __enter__(self) -> SlowLink:
        self._saved_gather = fdp._compat.all_gather_single
        for owner, name, share in (
            (dist, "all_reduce", _ring),
            (dist, "all_to_all_single", _spread),
            (fdp._compat, "all_gather_single", _gathered),
        ):
            original = getattr(owner, name)
            self._saved.append((owner, name, original))
            fn = self._gather if name == "all_gather_single" else original
            setattr(owner, name, self._wrap(fn, share))
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()


def _world(group: Any) -> int:
    return int(dist.get_world_size(group))


def _ring(t: torch.Tensor, *args: Any, group: Any = None, **kwargs: Any) -> float:
    """A ring all-reduce: each rank sends 2 (world - 1) / world of the buffer."""
    return 2 * (_world(group) - 1) / _world(group) * t.nbytes


def _spread(out: torch.Tensor, t: torch.Tensor, *args: Any, group: Any = None, **kw: Any) -> float:
    """An all-to-all: every chunk but this rank's own."""
    return (_world(group) - 1) / _world(group) * t.nbytes


def _gathered(out: torch.Tensor, part: torch.Tensor, group: Any) -> float:
    """An all-gather: this rank's part to every other rank."""
    return float((_world(group) - 1) * part.nbytes)
