"""``DiLoCo.join``: workers with different numbers of batches.

A DiLoCo worker communicates only at its synchronisations, so a worker that
runs out of data and stops calling ``update`` leaves the others waiting in
their next synchronisation's collectives until the process group's
timeout. Inside ``join`` a worker that leaves its loop keeps stepping the
count on its own (no collective between synchronisations) and takes part in
each synchronisation the others start at it, with a zero pseudo-gradient and
a training flag of 0 in the exchange's check (:mod:`fdp._ft._exchange`): the
others' mean is taken over the workers still training, and every worker
takes the same outer steps. The quantized wire's second phase and the
landings run on the same counts as on a training worker, so the collectives
match. When a synchronisation's flags are all 0, every worker has left: that
reduction is dropped, the ones still in flight land in the order they
started, and the block ends everywhere at the same count.
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["Joined", "mirror"]


class Joined:
    """One ``join`` block: this worker's latest parameters and state (read them after it)."""

    def __init__(self, params: Any, state: dict[str, Any]) -> None:
        self.params, self.state = params, state
        self.mirroring = False


class Communicates(Protocol):
    """What the mirror needs of a DiLoCo: the synchronisation half of ``update``."""

    def _communicate(
        self, state: dict[str, Any], params: Any, count: int, *, training: bool
    ) -> tuple[Any, dict[str, Any], bool]: ...

    def _land(self, i: int, state: dict[str, Any], params: Any) -> tuple[Any, dict[str, Any]]: ...


def mirror(algorithm: Communicates, joined: Joined) -> None:
    """This worker has left: mirrors the others until none trains, then lands what flies."""
    joined.mirroring = True
    params, state, ended = joined.params, joined.state, False
    while not ended:
        count = int(state["count"]) + 1
        state = {**state, "count": state["count"] + 1}
        params, state, ended = algorithm._communicate(state, params, count, training=False)
        joined.params, joined.state = params, state
    flying = sorted(
        (slot["started"], i) for i, slot in enumerate(state["in_flight"]) if slot["started"] >= 0
    )
    for _, i in flying:
        params, state = algorithm._land(i, state, params)
        joined.params, joined.state = params, state
