"""A fully sharded gradient's global norm and clipping (``fsdp.clip_grad_norm``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar, cast

import torch

from fdp import _mode
from fdp._comm import _differentiable, _raw
from fdp._sharding import _fsdp_plan
from fdp.optim import _clip

G = TypeVar("G", bound=Mapping[str, tuple[torch.Tensor | None, ...]])  # shards' gradients


def clip_grad_norm(
    call: str,
    units: Sequence[Any],
    group: Any,
    grads: G,
    max_norm: float | torch.Tensor,
    norm_type: float,
) -> tuple[G, torch.Tensor]:
    """``grads`` (the shards' gradients, checked here) clipped to ``max_norm``; their norm before.

    Each rank's shards hold disjoint elements (a tied tensor is sharded
    once), so the p-th powers of the local norms sum over ranks to the
    unsharded tree's: one all-reduce of one number.
    """
    _fsdp_plan.check_shards(call, units, grads, none_ok=True)
    p = _clip.check_norm_type(call, norm_type)
    if p != 2.0 and any(any(b.complex_) for u in units for b in u.buckets):
        raise NotImplementedError(
            f"{call}: `norm_type` {norm_type!r} over complex leaves needs each element's "
            "|z|, whose real and imaginary parts may sit in two ranks' shards; got a tree "
            "with complex leaves (use norm_type=2, which needs no pairing)"
        )
    # A unit no backward reached (None) adds nothing: zeros stand in for it.
    tensors = [
        t if t is not None else torch.zeros(size, dtype=bucket.dtype, device=bucket.device)
        for unit in units
        for t, size, bucket in zip(grads[unit.name], unit.sizes, unit.buckets, strict=True)
    ]

    def combine(share: torch.Tensor, op: str) -> torch.Tensor:
        if not _mode.needs_rules([share]):
            return _raw.all_reduce(share, group=group, op=op)
        if op == "max":
            raise NotImplementedError(
                f"{call}: `norm_type=inf` takes a maximum over ranks, which fdp does not "
                "differentiate; got gradients that require grad or are under a torch.func "
                "transform (use a finite norm_type there)"
            )
        return _differentiable.psum(share, group=group)

    total = _clip.sharded_norm(tensors, norm_type=p, combine=combine)
    scale = _clip.clip_scale(total, max_norm)
    clipped = {
        k: tuple(None if t is None else t * scale.to(t.dtype) for t in ts)
        for k, ts in grads.items()
    }
    return cast(G, clipped), total
