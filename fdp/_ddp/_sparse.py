"""Sparse gradients under ``DistributedDataParallel`` (``nn.Embedding(sparse=True)``).

A sparse gradient cannot be packed into a dense bucket. As torch's DDP does,
each leaf that any rank got one for is all-reduced on its own, as a sparse
tensor, after the buckets, in leaf order, on every rank: a rank without one
(its loss did not use the table, or it left a ``join``) takes part with an
empty one. A step flags such leaves in its usage all-reduce
(``fdp/_reducer.py``), so every rank knows which reductions come.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def reduce_sparse(
    leaf: torch.Tensor,
    kept: torch.Tensor | None,
    scale: float,
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """``leaf.grad`` plus ``kept``, as a sparse tensor, summed over ranks, times ``scale``.

    A call every rank makes, in the same order, for each leaf any rank
    flagged sparse (a rank without such a gradient, and ``join``'s ranks
    that left, with an empty one).
    """
    grad = empty_sparse(leaf.shape, leaf.dtype, leaf.device)
    for part in (leaf.grad, kept):
        if part is not None:
            grad = grad + (part if part.is_sparse else part.to_sparse(sparse_dim=1))
    grad = grad.coalesce()
    dist.all_reduce(grad, group=group)
    return grad.mul_(scale)


def empty_sparse(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A sparse COO tensor of ``shape`` with no element (sparse in the first dimension)."""
    indices = torch.zeros(1, 0, dtype=torch.long, device=device)
    values = torch.zeros(0, *shape[1:], dtype=dtype, device=device)
    return torch.sparse_coo_tensor(indices, values, shape).coalesce()
