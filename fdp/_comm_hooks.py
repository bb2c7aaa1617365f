"""Comm hooks: how ``DistributedDataParallel`` reduces one bucket.

The signature mirrors ``DistributedDataParallel.register_comm_hook`` in torch,
without the state argument (close over it instead): ``hook(bucket, group)``
returns a future of the averaged bucket.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

__all__ = ["CommHook", "allreduce_hook", "bf16_compress_hook", "fp16_compress_hook"]

ProcessGroup = dist.ProcessGroup

CommHook = Callable[[torch.Tensor, "ProcessGroup | None"], "torch.futures.Future[torch.Tensor]"]
"""``hook(bucket, group) -> Future[Tensor]``, called once per bucket and step.

``bucket`` is a flat 1-D tensor with this rank's gradients for one bucket
(full precision). The future must resolve to the *average* over the ranks of
``group`` with ``bucket``'s shape, dtype and device; it may be ``bucket``
itself, reduced in place. Every rank must issue the same collectives.
"""


def reduced_tensor(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
    """The one tensor a single-tensor collective's future resolves to."""
    return fut.value()[0]


def allreduce_hook(
    bucket: torch.Tensor, group: ProcessGroup | None
) -> torch.futures.Future[torch.Tensor]:
    """The default: averages ``bucket`` in place with one asynchronous all-reduce.

    Example::

        ddp = fdp.DistributedDataParallel(params, comm_hook=fdp.allreduce_hook)
    """
    # Divide first, as torch's DDP does: one pass, and no overflow in the sum.
    bucket.div_(dist.get_world_size(group))
    work = dist.all_reduce(bucket, group=group, async_op=True)
    future: torch.futures.Future[list[torch.Tensor]] = work.get_future()
    return future.then(reduced_tensor)


def _compressed(
    bucket: torch.Tensor, group: ProcessGroup | None, dtype: torch.dtype
) -> torch.futures.Future[torch.Tensor]:
    if bucket.dtype == dtype:
        return allreduce_hook(bucket, group)
    compressed = bucket.to(dtype).div_(dist.get_world_size(group))
    work = dist.all_reduce(compressed, group=group, async_op=True)
    future: torch.futures.Future[list[torch.Tensor]] = work.get_future()
    return future.then(lambda fut: bucket.copy_(reduced_tensor(fut)))


def fp16_compress_hook(
    bucket: torch.Tensor, group: ProcessGroup | None
) -> torch.futures.Future[torch.Tensor]:
    """Reduces each bucket in float16 (half the bytes) and hands back full precision.

    Example::

        ddp = fdp.DistributedDataParallel(params, comm_hook=fdp.fp16_compress_hook)
    """
    return _compressed(bucket, group, torch.float16)


def bf16_compress_hook(
    bucket: torch.Tensor, group: ProcessGroup | None
) -> torch.futures.Future[torch.Tensor]:
    """Reduces each bucket in bfloat16 (half the bytes, float32's range).

    Example::

        ddp = fdp.DistributedDataParallel(params, comm_hook=fdp.bf16_compress_hook)
    """
    return _compressed(bucket, group, torch.bfloat16)
