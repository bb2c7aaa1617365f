"""``fdp.optim.clip_by_global_norm``: ``torch.nn.utils.clip_grad_norm_`` over a gradient tree.

Pure: the clipped gradients are new tensors, so the function runs under
autograd, every ``torch.func`` transform and ``torch.compile`` (no
data-dependent branch: the scale is clamped, as torch clamps it). Gradients
that :class:`fdp.DistributedDataParallel` or :func:`fdp.all_reduce_grads`
averaged are the same on every rank, so each rank computes the same norm
with no collective. :class:`fdp.ZeroRedundancy` holds only a slice of the
averaged gradients: its ``step(..., max_norm=...)`` adds the one reduction
that needs. The gradients of a :class:`fdp.FullyShardedDataParallel`'s
shards are clipped by their norm over every rank's shards, as its
``clip_grad_norm`` clips them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TypeVar

import torch

from fdp import _sharded, _tree

T = TypeVar("T")

EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s, added to the norm before dividing


def clip_by_global_norm(
    grads: T, max_norm: float | torch.Tensor, *, norm_type: float = 2.0
) -> tuple[T, torch.Tensor]:
    """Scales a gradient tree so that its global norm is at most ``max_norm``.

    The same computation as ``torch.nn.utils.clip_grad_norm_``: the norm of
    the leaves' norms, and every leaf multiplied by
    ``min(1, max_norm / (norm + 1e-6))``. ``None`` leaves stay ``None``.

    Args:
        grads: a tree of gradient tensors (and ``None``).
        max_norm: the largest global norm kept.
        norm_type: the ``p`` of the p-norm, ``math.inf`` for the largest
            absolute value.

    Returns:
        The clipped gradients (new tensors) and the global norm before
        clipping (a 0-d tensor; ``nan`` or ``inf`` when a gradient is not
        finite, as in torch).

    Raises:
        ValueError: ``max_norm`` is negative or ``norm_type`` not positive.
        TypeError: a leaf of ``grads`` is neither a tensor nor ``None``.

    Example:
        >>> import torch, fdp
        >>> grads = {"w": torch.tensor([3.0, 4.0]), "b": None}
        >>> clipped, norm = fdp.optim.clip_by_global_norm(grads, 1.0)
        >>> norm.item(), [round(v, 4) for v in clipped["w"].tolist()]
        (5.0, [0.6, 0.8])
    """
    call = "fdp.optim.clip_by_global_norm"
    if not isinstance(max_norm, torch.Tensor) and not max_norm >= 0:
        raise ValueError(f"{call}: `max_norm` expected a number >= 0; got {max_norm!r}")
    norm_type = check_norm_type(call, norm_type)
    leaves, spec = _tree.flatten(grads)
    for i, g in enumerate(leaves):
        if g is not None and not isinstance(g, torch.Tensor):
            raise TypeError(
                f"{call}: `grads` leaf {_tree.path(grads, i, 'grads')} expected a tensor or "
                f"None; got {_tree.describe(g)}"
            )
    owner = _sharded.owner(grads, none_ok=True)
    if owner is not None:  # each rank's shards hold other elements: the norm is over all
        shards: T
        shards, norm = owner.clip_grad_norm(grads, max_norm, norm_type=norm_type)
        return shards, norm
    present = [g for g in leaves if g is not None]
    if not present:
        return grads, torch.zeros(())
    norm = global_norm(present, norm_type=float(norm_type))
    scale = clip_scale(norm, max_norm)
    clipped = [None if g is None else g * scale.to(g.device) for g in leaves]
    return _tree.unflatten(spec, clipped), norm


def check_norm_type(call: str, norm_type: object) -> float:
    """``norm_type`` as a float, or fdp's error: a number > 0 or ``math.inf``."""
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)):
        raise TypeError(f"{call}: `norm_type` expected a number > 0 or math.inf; got {norm_type!r}")
    if not float(norm_type) > 0:
        raise ValueError(
            f"{call}: `norm_type` expected a number > 0 or math.inf; got {norm_type!r}"
        )
    return float(norm_type)


def global_norm(tensors: list[torch.Tensor], *, norm_type: float) -> torch.Tensor:
    """The p-norm of the tensors' p-norms, on the first tensor's device (torch's recipe)."""
    device = tensors[0].device
    norms = [torch.linalg.vector_norm(t, norm_type).to(device) for t in tensors]
    total: torch.Tensor = torch.linalg.vector_norm(torch.stack(norms), norm_type)
    return total


def sharded_norm(
    tensors: list[torch.Tensor],
    *,
    norm_type: float,
    combine: Callable[[torch.Tensor, str], torch.Tensor],
) -> torch.Tensor:
    """The p-norm of tensors whose elements are spread over ranks, each element on one rank.

    This rank's share is the sum of the p-th powers of its tensors' elements
    (:func:`_powers`, in float64; the largest norm for ``math.inf``);
    ``combine(share, "sum" or "max")`` joins the ranks' shares (one
    collective of one number: FSDP's shards, ZeRO's slices). The result is
    in float32, or float64 where a tensor is.
    """
    wide = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
    device = tensors[0].device
    if norm_type in (math.inf, -math.inf):  # not math.isinf: it may be symbolic, compiled
        # An empty shard (a rank that holds none of a unit) has no maximum: 0.
        norms = [
            torch.linalg.vector_norm(t, norm_type, dtype=wide).to(device)
            if t.numel()
            else torch.zeros((), dtype=wide, device=device)
            for t in tensors
        ]
        return combine(torch.stack(norms).max(), "max")
    share = torch.stack([_powers(t, norm_type, wide).to(device) for t in tensors]).sum()
    total: torch.Tensor = combine(share, "sum") ** (1.0 / norm_type)
    return total.to(wide)


# Elements per row of a shard's norm: one row's float32 sum of squares is exact to ~3e-8.
ROW = 256


def _powers(t: torch.Tensor, p: float, wide: torch.dtype) -> torch.Tensor:
    """The sum of ``|t|**p`` over ``t``'s elements, in float64.

    A flat shard holds millions of elements, and the CPU's norm kernel adds
    them into one float32 accumulator: 7M squares come out 2e-4 low (torch's
    per-leaf ``clip_grad_norm_`` errs as much on a leaf that large). Norms of
    rows of ``ROW`` elements, whose p-th powers are summed in float64, are
    within ~3e-8 of a float64 norm, at about one float32 norm's time.
    """
    flat = t.reshape(-1)
    n = flat.numel() // ROW * ROW
    rows = torch.linalg.vector_norm(flat[:n].view(-1, ROW), p, dim=1, dtype=wide)
    rest = torch.linalg.vector_norm(flat[n:], p, dtype=wide).reshape(1)
    return (torch.cat([rows, rest]).double() ** p).sum()


def clip_scale(norm: torch.Tensor, max_norm: float | torch.Tensor) -> torch.Tensor:
    """The factor of the clipped gradients: ``min(1, max_norm / (norm + 1e-6))``, as torch's."""
    return torch.clamp(max_norm / (norm + EPS), max=1.0)
