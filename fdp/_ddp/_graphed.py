"""``backward(create_graph=True)`` through ``ddp(params)``: ``.grad`` reduced with its graph.

The hooks leave each gradient to the engine, which accumulates it into
``.grad`` with its graph; the step's finish then replaces each ``.grad`` by
the average over ranks through a differentiable all-reduce (the psum rule),
so that a gradient penalty differentiates the global batch's gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fdp import _compat
from fdp._comm import _comm_hooks, _transforms
from fdp._ddp._delivery import Delivery
from fdp._ddp._reduction import StepState


def on_grad(step: StepState, i: int, grad: torch.Tensor | None) -> torch.Tensor | None:
    """Leaf ``i``'s gradient with its graph: counted, refused where it cannot be reduced."""
    with step.lock:
        where = f"params leaf {step.reduction.paths[i]}"
        if grad is not None and grad.is_sparse:
            raise RuntimeError(
                f"fdp.DistributedDataParallel: backward with create_graph=True reached "
                f"{where} with a sparse gradient; use dense gradients for double backward"
            )
        if step.delivery is Delivery.UNDECIDED:
            if step.decide(i):
                raise RuntimeError(
                    f"fdp.DistributedDataParallel: torch.autograd.grad(..., "
                    f"create_graph=True) reached {where}; the gradients it returns are "
                    "taken before the reduction can give them a graph. Use "
                    "loss.backward(create_graph=True) and read .grad (reduced, with its "
                    "graph), or torch.func.grad around ddp(params)"
                )
            step.delivery = Delivery.GRAPHED
        if step.reduction.hook not in (None, _comm_hooks.allreduce_hook):
            raise RuntimeError(
                f"fdp.DistributedDataParallel: backward with create_graph=True reached "
                f"{where} with a comm hook, whose reduction cannot carry a graph; use "
                "the default reduction for double backward"
            )
        if grad is not None and not step.dropped(i):
            step.used.add(i)
        if not step.queued:
            _compat.queue_backward_callback(step.finish)
            step.queued = True
        return grad


def finish(step: StepState) -> None:
    """``.grad`` becomes the average over ranks, differentiably."""
    counts, work = step.launch_usage()
    work.wait()
    used = step.plan.counts(counts.tolist())
    grads: list[torch.Tensor | None] = [None] * len(step.leaves)
    for i in step.hooked:
        grads[i] = step.leaves[i].grad
    group = step.reduction.group
    with torch.enable_grad():
        reduced = _transforms.reduce_buckets(
            step.reduction.layout.buckets,
            grads,
            scale=1.0 / dist.get_world_size(group),
            group=group,
        )
    for i, count in zip(step.hooked, used, strict=True):
        if count > 0:
            step.leaves[i].grad = reduced[i]
