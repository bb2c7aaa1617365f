"""Which leaves had a gradient on any rank: a step's usage counts, summed over ranks.

Under ``loss.backward()`` a leaf no rank used keeps ``.grad`` ``None``, as
in local training, and a sparse gradient on any rank makes the leaf's
reduction sparse; one more slot says whether any rank has late gradients
(``fdp/_ddp/_late.py``). Each rank counts 1 for a dense user, world + 1 for
a sparse one, so one sum says both. The counts ride the last bucket's
all-reduce where it can sum them exactly (``fdp/_ddp/_reduction.py``:
Note [usage rides the last bucket]), else they take one small all-reduce
of their own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from fdp import _compat
from fdp._ddp._reduction import StepState


def counts(step: StepState) -> list[float]:
    """This rank's count for each hooked leaf, then whether it has late gradients."""
    if not step.sparse and len(step.used) == len(step.hooked):
        # The common step: every hooked leaf had a dense gradient here (``used``
        # holds hooked leaves only), and no per-leaf test is needed.
        return [*(1.0 for _ in step.hooked), float(bool(step.late))]
    sparse = float(dist.get_world_size(step.reduction.group) + 1)
    return [
        *(
            sparse
            if i in step.sparse
            else 1.0
            if i in step.used or step.leaves[i].grad is not None
            else 0.0
            for i in step.hooked
        ),
        float(bool(step.late)),  # last: whether any rank has late gradients
    ]


def launch(step: StepState) -> tuple[torch.Tensor, Any]:
    """The counts in an all-reduce of their own: the tensor and its work.

    Laid out as the riding tail is, a slot per bucketed leaf: the same
    length on every rank, whichever leaves each rank's call hooked (a leaf
    frozen on some ranks only), and for ``join``'s mirroring ranks.
    """
    layout = step.reduction.layout
    summed = torch.empty(len(layout.order) + 1, device=layout.buckets[0].device)
    write(step, summed)
    return summed, _compat.all_reduce_sum(summed, step.reduction.group)


def write(step: StepState, tail: torch.Tensor) -> None:
    """The counts in the last bucket's tail: a slot per bucketed leaf, then late ones."""
    if not step.sparse and len(step.used) == len(step.hooked) and not step.late:
        tail.copy_(step.plan.all_used(tail))  # the common step: made once, on the device
        return
    *mine, late = counts(step)
    values = [0.0] * tail.numel()
    slots = step.reduction.slots
    for i, count in zip(step.hooked, mine, strict=True):
        values[slots[i]] = count
    values[-1] = late
    tail.copy_(torch.tensor(values, dtype=tail.dtype))


def summed(
    step: StepState, usage: tuple[torch.Tensor, Any] | None
) -> tuple[Sequence[float], float, list[int]] | None:
    """The counts of the hooked leaves and of late gradients over ranks, once reduced.

    From the last bucket's tail where they rode it, else from ``usage``
    (:func:`launch`'s); None where the step counted nothing. Third, the
    leaves any rank flagged sparse, of every bucketed leaf (hooked here or
    not: a leaf frozen on this rank only still takes part in their
    reductions), in the usage slots' order, the same on every rank.
    """
    if step.rides:
        last = step.buckets[-1].flat
        if last is None:
            raise RuntimeError("fdp internal error: the last bucket was never launched")
        values = last[step.reduction.layout.buckets[-1].numel :].tolist()
    elif usage is None:
        return None
    else:
        reduced, work = usage
        work.wait()
        values = reduced.tolist()
    return step.plan.counts(values), values[-1], _sparse(step, values)


def _sparse(step: StepState, values: list[float]) -> list[int]:
    """The bucketed leaves whose summed count says some rank's gradient was sparse."""
    sparse = float(dist.get_world_size(step.reduction.group) + 1)
    if max(values[:-1], default=0.0) < sparse:  # the common step: a C-level test
        return []
    order = step.reduction.layout.order
    return [i for i, count in zip(order, values, strict=False) if count >= sparse]
