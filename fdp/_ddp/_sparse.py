"""Sparse gradients under ``DistributedDataParallel`` (``nn.Embedding(sparse=True)``).

A sparse gradient cannot be packed into a dense bucket. As torch's DDP does,
each leaf that any rank got one for is all-reduced on its own, as a sparse
tensor, after the buckets, in leaf order, on every rank: a rank without one
(its loss did not use the table, or it left a ``join``) takes part with an
empty one. A step flags such leaves in its usage all-reduce
(``fdp/_ddp/_step.py``), so every rank knows which reductions come. With a
comm hook, the hook reduces that sparse tensor as a bucket of its own (its
``buffer()`` is sparse), as torch's DDP hands its hooks a sparse bucket.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fdp._comm import _comm_hooks


def reduce_sparse(
    leaf: torch.Tensor,
    kept: torch.Tensor | None,
    scale: float,
    group: dist.ProcessGroup | None,
    *,
    hook: Any = None,
    bucket: tuple[Any, int, bool, str] | None = None,
    own: bool = True,
) -> torch.Tensor:
    """``leaf.grad`` plus ``kept``, as a sparse tensor, summed over ranks, times ``scale``.

    A call every rank makes, in the same order, for each leaf any rank
    flagged sparse (a rank without such a gradient, and ``join``'s ranks
    that left, with an empty one). With ``hook`` (a comm hook; ``bucket``:
    its state, the bucket's index, whether it is the last, the leaf's
    path), the hook's average instead. ``own=False``: ``leaf.grad`` left out
    (a leaf this rank does not train takes part with nothing).
    """
    grad = empty_sparse(leaf.shape, leaf.dtype, leaf.device)
    for part in (leaf.grad if own else None, kept):
        if part is not None:
            grad = grad + (part if part.is_sparse else part.to_sparse(sparse_dim=1))
    grad = grad.coalesce()
    if hook is not None and bucket is not None:
        return _hooked(leaf, grad, hook, *bucket)
    dist.all_reduce(grad, group=group)
    return grad.mul_(scale)


def _hooked(
    leaf: torch.Tensor, grad: torch.Tensor, hook: Any, state: Any, index: int, last: bool, path: str
) -> torch.Tensor:
    bucket = _comm_hooks.GradBucket(
        grad, index=index, is_last=last, gradients=[grad], parameters=[leaf]
    )
    future = hook(state, bucket)
    _comm_hooks.check_future(future)
    out = _comm_hooks.resolved(future)
    if not isinstance(out, torch.Tensor) or out.shape != leaf.shape:
        raise TypeError(
            f"fdp.DistributedDataParallel: `comm_hook` expected to resolve the sparse "
            f"bucket of params leaf {path} to a tensor of shape {tuple(leaf.shape)}; got "
            f"{type(out).__name__} {tuple(getattr(out, 'shape', ()))}"
        )
    return out.coalesce() if out.is_sparse else out


def empty_sparse(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A sparse COO tensor of ``shape`` with no element (sparse in the first dimension)."""
    indices = torch.zeros(1, 0, dtype=torch.long, device=device)
    values = torch.zeros(0, *shape[1:], dtype=dtype, device=device)
    return torch.sparse_coo_tensor(indices, values, shape).coalesce()
