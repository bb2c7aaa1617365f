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
from collections.abc import Sequence
from typing import Any

import torch

from fdp import _compat, _grad


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
    wanted = [leaves[j] for j in bucket if leaves[j].requires_grad]
    first = None
    if wanted and _grad.differentiating():
        # Likely fdp.grad's own autograd.grad: only autograd.grad returns a
        # leaf's gradient, and it accumulates none, so one returned leaf
        # answers for the bucket and the probe (each query costs 13-90 us, a
        # raised error where returned; a GPT-2 bucket of 16 leaves: 0.4 ms).
        first = _compat.leaf_destination(wanted[0])
        if first == "returned":
            return True, True
    if _compat.leaf_destination(probe) == "accumulated":
        return False, False
    returned = first != "accumulated" and all(
        _compat.leaf_destination(t) != "accumulated" for t in wanted[1 if first else 0 :]
    )
    return returned, True


def left_out(leaf: torch.Tensor) -> bool:
    """Whether the running, selecting backward leaves ``leaf`` out (its node ran for others)."""
    return _compat.leaf_destination(leaf) == "none"
