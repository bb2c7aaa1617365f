"""Prefetching: the next unit's all-gather runs while the current unit computes.

Forward: ``FullyShardedDataParallel.apply`` and ``gather`` record the order
in which the units are used and, having gathered unit k, start the
asynchronous all-gather of the unit that followed k last time (after the
same unit before k; the first time, the unit after k in the plan), so that
its communication overlaps k's function. A pass ends when a unit comes
again; nothing used in this pass is prefetched. The next call
takes that result if it asks for that unit with the same shard tensors at
the same versions; otherwise it waits for it and drops it: a wrong guess
costs one gather, never a result, and at most one unit is held ahead.

Backward: each unit resharded by ``apply`` links (weakly) to the unit
applied before it in the same pass, and refilling a unit starts the
asynchronous refill of that one (``fdp/_sharding/_fsdp_reshard.py``).

Every rank runs the same program, so the ranks start the same collectives
in the same order. Eager only: under a ``torch.func`` transform or while
compiling, nothing is prefetched (:func:`eligible`).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence

import torch

from fdp import _compat, _mode
from fdp._sharding import _fsdp_gather, _fsdp_reshard, _fsdp_unit


def _eligible_traced(shards: Sequence[torch.Tensor]) -> bool:
    """Never while dynamo traces: prefetches are asynchronous work kept between calls."""
    return False


@_mode.traced_as(_eligible_traced)
def eligible(shards: Sequence[torch.Tensor]) -> bool:
    """Whether prefetching can run: plain tensors, no transform."""
    return not (_mode.transform_running() or _mode.wrapped(shards))


class Started:
    """The asynchronous all-gathers of one unit's shards."""

    def __init__(self, state: _fsdp_unit.UnitState, shards: Sequence[torch.Tensor]) -> None:
        self.name, self.shards = state.name, tuple(shards)
        hows = [state.policy_for(k, t) for k, t in enumerate(shards)]
        self.versions = tuple(t._version for t in shards)
        # Eager only: a profiler trace shows it.
        with _compat.label(f"fdp::fsdp.all_gather {self.name}"):
            started = [_fsdp_gather.start(t, how) for t, how in zip(shards, hows, strict=True)]
        self.flats = [flat for flat, _ in started]
        self.works = [work for _, work in started]

    def wait(self) -> list[torch.Tensor]:
        explain = _fsdp_gather.in_step(f"the all-gather of unit {self.name!r}")
        with explain, _compat.label(f"fdp::fsdp.wait {self.name}"):
            for work in self.works:
                work.wait()
        self.works = []
        return self.flats

    def matches(self, name: str, shards: Sequence[torch.Tensor]) -> bool:
        return (
            name == self.name
            and len(shards) == len(self.shards)
            and all(a is b for a, b in zip(shards, self.shards, strict=True))
            and tuple(t._version for t in shards) == self.versions
        )


def start(state: _fsdp_unit.UnitState, shards: Sequence[torch.Tensor]) -> Started:
    """The asynchronous all-gathers of a unit's ``shards``, as its ``state``'s policy has them."""
    return Started(state, shards)


class Prefetcher:
    """One FullyShardedDataParallel's prefetching: the order seen, the gather ahead."""

    def __init__(self, plan: Sequence[str], *, enabled: bool) -> None:
        self.enabled = enabled
        self._plan = list(plan)
        # The unit that came after each pair of consecutive uses, last time:
        # a pair, not a unit, because a unit used twice in a step (a tied
        # embedding) is followed by different units each time.
        self._after: dict[tuple[str | None, str], str] = {}
        self._last: tuple[str | None, str | None] = (None, None)
        self._pass: list[str] = []  # the units used in this pass, in order
        self._ahead: Started | None = None
        self._held: weakref.ref[_fsdp_reshard.Held] | None = None  # the last one resharded

    def visit(self, name: str) -> str | None:
        """Records that ``name`` is used now; returns the unit expected next, if any.

        Never a unit already used in this pass: using one again starts a new
        pass, most often the next step, whose shards are not those of now.
        """
        before, last = self._last
        if last is not None:
            self._after[(before, last)] = name
        self._last = (last, name)
        if name in self._pass:  # a new pass (the next step, or a unit used twice)
            self._pass, self._held = [], None
        self._pass.append(name)
        # Note [prefetch is a guess]: never a promise. The unit that followed this pair of
        # units last time (or the next in the plan, the first time) is
        # gathered ahead; ``take`` checks the shards are the ones it was
        # gathered from, and a wrong guess is waited for and dropped: a
        # wasted all-gather, made by every rank alike, never a wrong value.
        guess = self._after.get((last, name))
        if guess is None and name in self._plan:
            following = self._plan[self._plan.index(name) + 1 :]
            guess = following[0] if following else None
        return None if guess is None or guess in self._pass else guess

    def take(self, name: str, shards: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
        """The gathered flat buffers of ``name`` if they were prefetched from ``shards``."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        flats = ahead.wait()  # collectives complete in order, used or not
        return flats if ahead.matches(name, shards) else None

    def put(self, ahead: Started) -> None:
        """Holds ``ahead`` (started) for the next :meth:`take`."""
        self.drop()
        self._ahead = ahead

    def drop(self) -> None:
        """Waits for and forgets any gather ahead (it holds one unit's memory)."""
        self.take("", ())

    def held(self, buffers: Sequence[_fsdp_reshard.Resharded]) -> _fsdp_reshard.Held:
        """``buffers`` as one resharded unit, linked to the one before it in this pass."""
        before = self._held() if self._held is not None and self.enabled else None
        held = _fsdp_reshard.Held(buffers, before)
        self._held = weakref.ref(held)
        return held

    def ready(
        self,
        state: _fsdp_unit.UnitState,
        shards: Mapping[str, Sequence[torch.Tensor]],
        states: Mapping[str, _fsdp_unit.UnitState],
    ) -> list[torch.Tensor] | None:
        """``state``'s unit's flat buffers if prefetched; starts the gather of the next unit."""
        name = state.name
        mine = shards[name]
        if not (self.enabled and eligible(mine)):
            self.drop()
            return None
        ready = self.take(name, mine)
        if ready is None:  # gathered now, before the next unit's gather starts
            ready = start(state, mine).wait()
        following = self.visit(name)
        if following is not None:
            self.put(start(states[following], shards[following]))
        return ready
