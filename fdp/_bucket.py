"""Bucket planning and flat pack/unpack over the tensor leaves of a flattened tree.

A bucket is a run of leaves that share a device and a dtype and travel as one
flat buffer: one collective per bucket instead of one per leaf. Planning
follows ``DistributedDataParallel``: leaves are visited in reverse order (the
order backward produces gradients for parameters used in order), each (device,
dtype) pair keeps one open bucket that closes once it reaches its size cap, the
first bucket of each pair gets a small cap so that communication starts early,
and buckets are ordered by when they close.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

MB = 1024 * 1024


@dataclass(frozen=True)
class Bucket:
    """Leaves (indices into the flattened tree) that share one flat buffer."""

    indices: tuple[int, ...]
    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]  # where each leaf starts in the flat buffer
    numel: int
    dtype: torch.dtype
    device: torch.device

    def empty(self) -> torch.Tensor:
        return torch.empty(self.numel, dtype=self.dtype, device=self.device)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``flat``, one per leaf, shaped like the leaves."""
        return [
            flat[start : start + shape.numel()].view(shape)
            for start, shape in zip(self.offsets, self.shapes, strict=True)
        ]

    def pack(
        self,
        tensors: Sequence[torch.Tensor | None],
        *,
        scale: float = 1.0,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """A flat buffer (``out``, or a new one) holding ``tensors`` times ``scale``.

        ``None`` packs zeros. Scaling while packing costs no extra pass.
        """
        if scale == 1.0 and all(t is not None for t in tensors):
            flat_leaves = [t.reshape(-1) for t in tensors if t is not None]
            return torch.cat(flat_leaves) if out is None else torch.cat(flat_leaves, out=out)
        flat = self.empty() if out is None else out
        for view, t in zip(self.views(flat), tensors, strict=True):
            if t is None:
                view.zero_()
            elif scale == 1.0:
                view.copy_(t)
            else:
                torch.mul(t, scale, out=view)
        return flat


def plan(
    tensors: Sequence[torch.Tensor | None],
    *,
    cap_bytes: int,
    first_cap_bytes: int | None = None,
) -> list[Bucket]:
    """Groups the non-None ``tensors`` (leaves of one flattened tree) into buckets.

    Args:
        tensors: one entry per leaf; ``None`` marks a leaf that is not bucketed.
        cap_bytes: a bucket closes once it holds at least this many bytes.
        first_cap_bytes: the cap of the first bucket of each (device, dtype);
            ``cap_bytes`` when None.
    """
    first = cap_bytes if first_cap_bytes is None else first_cap_bytes
    open_: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    sizes: dict[tuple[torch.device, torch.dtype], int] = {}
    closed_count: dict[tuple[torch.device, torch.dtype], int] = {}
    done: list[list[int]] = []
    for i in reversed(range(len(tensors))):
        t = tensors[i]
        if t is None:
            continue
        key = (t.device, t.dtype)
        open_.setdefault(key, []).append(i)
        sizes[key] = sizes.get(key, 0) + t.numel() * t.element_size()
        cap = first if closed_count.get(key, 0) == 0 else cap_bytes
        if sizes[key] >= cap:
            done.append(open_.pop(key))
            sizes[key] = 0
            closed_count[key] = closed_count.get(key, 0) + 1
    done.extend(open_.values())
    return [_bucket(indices, tensors) for indices in done]


def _bucket(indices: list[int], tensors: Sequence[torch.Tensor | None]) -> Bucket:
    shapes, offsets, numel = [], [], 0
    for i in indices:
        t = tensors[i]
        if t is None:  # plan() never puts a None in a bucket
            raise RuntimeError("fdp internal error: a None leaf in a bucket")
        shapes.append(t.shape)
        offsets.append(numel)
        numel += t.numel()
    head = tensors[indices[0]]
    if head is None:
        raise RuntimeError("fdp internal error: a None leaf in a bucket")
    return Bucket(
        indices=tuple(indices),
        shapes=tuple(shapes),
        offsets=tuple(offsets),
        numel=numel,
        dtype=head.dtype,
        device=head.device,
    )
