"""Which backward a DDP step is in: how it hands out gradients, and which leaves it asks for.

A step's first hook decides (:func:`decide`). ``loss.backward()`` accumulates
into ``.grad``; ``torch.autograd.grad`` returns what the hooks return;
``backward(create_graph=True)`` reduces ``.grad`` differentiably at the end.

One node aliases a run of a bucket's leaves (``fdp/_ddp/_reducer.py``), so
with ``backward(inputs=...)`` its hooks also run for the leaves the call
leaves out (:func:`left_out`), which must then keep what local training
gives them.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from fdp import _compat


class Delivery(enum.Enum):
    """How one backward hands out the reduced gradients; its first hook decides."""

    UNDECIDED = "undecided"
    RETURNED = "returned"  # autograd.grad, torch.func.grad: each hook's return value
    ACCUMULATED = "accumulated"  # loss.backward(): into .grad
    GRAPHED = "graphed"  # loss.backward(create_graph=True): .grad reduced differentiably


def decide(
    leaves: list[Any], i: int, bucket: Sequence[int], probe: torch.Tensor | None
) -> tuple[bool, bool]:
    """Whether the running backward returns the gradients (else accumulates), and selects leaves.

    Called from leaf ``i``'s hook; ``bucket``: the leaves of its bucket;
    ``probe``: a leaf that every alias node of that device takes and never
    gives a gradient, or None where each leaf has a node of its own (then
    only a leaf in the backward has its hook run, and it tells).

    Whether the engine runs the probe's node says at one query's cost
    whether the backward selects leaves: asking for every leaf costs about
    9 us a leaf in a plain backward (the engine walks its graph per query).
    Selecting, the bucket (its node's run and more) tells: a leaf
    accumulated means ``backward(inputs=...)``; none means
    ``autograd.grad``, of leaves or of the call's outputs.
    """
    if probe is None:
        return _compat.leaf_destination(leaves[i]) != "accumulated", False
    if _compat.leaf_destination(probe) == "accumulated":
        return False, False
    returned = all(
        _compat.leaf_destination(leaves[j]) != "accumulated"
        for j in bucket
        if leaves[j].requires_grad
    )
    return returned, True


def left_out(leaf: torch.Tensor) -> bool:
    """Whether the running, selecting backward leaves ``leaf`` out (its node ran for others)."""
    return _compat.leaf_destination(leaf) == "none"


# While fdp.grad's torch.autograd.grad runs: id(leaf) -> [its reduced gradient].
# A leaf this rank did not use comes back None from autograd.grad, though the
# other ranks' average reached its bucket; torch.func.grad gives that average.
_ASKED: dict[int, list[torch.Tensor | None]] = {}
_ASKED_LOCK = threading.Lock()


@contextmanager
def returning_unused(leaves: Sequence[torch.Tensor]) -> Iterator[list[list[torch.Tensor | None]]]:
    """The reduced gradients of ``leaves`` this rank did not use, handed out by DDP's finish.

    Scoped to one call (``fdp/_grad.py``): nothing is kept after it. The
    finish may run on another thread (a device's backward thread): hence ids
    under a lock, not a thread-local.
    """
    slots: list[list[torch.Tensor | None]] = [[None] for _ in leaves]
    with _ASKED_LOCK:
        _ASKED.update({id(t): slot for t, slot in zip(leaves, slots, strict=True)})
    try:
        yield slots
    finally:
        with _ASKED_LOCK:
            for t in leaves:
                _ASKED.pop(id(t), None)


def hand_unused(leaf: torch.Tensor, reduced: torch.Tensor) -> None:
    """Gives :func:`returning_unused` the reduced gradient of a leaf this rank did not use."""
    with _ASKED_LOCK:
        slot = _ASKED.get(id(leaf))
    if slot is not None:
        slot[0] = reduced


def asked() -> bool:
    return bool(_ASKED)
