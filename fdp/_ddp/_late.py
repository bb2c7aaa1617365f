"""A second gradient for a leaf in one backward under ``DistributedDataParallel``.

A nested backward (reentrant activation checkpointing) gives a leaf used in
several places one gradient per backward. Before the leaf's bucket is
launched the gradient is added to the leaf's slot; after, it is kept aside
and reduced when the backward ends (:func:`reduce`), while the engine gets
it for a ``.grad`` that the hand-out replaces (never the bucket, which the
collective may be using).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fdp import _compat
from fdp._ddp._reduction import StepState


def again(step: StepState, i: int, k: int, grad: torch.Tensor) -> torch.Tensor:
    """Leaf ``i``'s second gradient (bucket ``k``), folded in or set aside: what the engine gets."""
    if step.returned:
        raise RuntimeError(
            f"fdp.DistributedDataParallel: params leaf {step.reduction.paths[i]} got a second "
            "gradient in one backward (a nested backward, as reentrant activation "
            "checkpointing runs) under torch.autograd.grad or torch.func.grad, which "
            "return one gradient per leaf; use checkpoint(..., use_reentrant=False), or "
            "loss.backward()"
        )
    step.used.add(i)
    grad = _compat.unwrap_functorch(grad)
    leaf = step.leaves[i]
    if k >= step.next_launch:
        view = step.view(i)
        view.add_(grad, alpha=step.prescale)
        return step.into_bucket(leaf, view)
    scale = (
        step.prescale
        if step.reduction.hook is None
        else 1.0 / dist.get_world_size(step.reduction.group)
    )
    late = step.late.get(i)
    step.late[i] = grad * scale if late is None else late.add_(grad, alpha=scale)
    leaf.grad = None
    return grad


def reduce(step: StepState) -> None:
    """Reduces the gradients that missed their bucket, on every rank (some had them)."""
    # Note [late gradients]: why every bucket, on every rank. Whether a gradient came late
    # depends on this rank's graph (a reentrant checkpoint, a leaf used
    # twice), so ranks differ; one more all-reduce per bucket, zeros where
    # nothing was late, keeps their collectives paired whatever happened.
    for k, bucket in enumerate(step.reduction.layout.buckets):
        extra = bucket.empty().view(-1).zero_()
        for j, view in enumerate(bucket.views(extra)):
            late = step.late.get(bucket.indices[j])
            if late is not None:
                view.copy_(late)
        dist.all_reduce(extra, group=step.reduction.group)
        flat = step.buckets[k].flat
        if flat is not None:  # the last bucket's may carry the usage counts after it
            flat[: bucket.numel].add_(extra)
    step.late.clear()
