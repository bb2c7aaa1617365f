"""Storage, foreach ops, wrapper subclasses and user-registered pytree nodes.

Part of :mod:`fdp._compat` (its docstring says how each function degrades).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch


def storage_users(t: torch.Tensor) -> int:
    """How many tensors share ``t``'s storage (``t`` included); huge if unknown."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:  # private API gone: never reuse
        return 1 << 30
    # The temporary Storage object made by untyped_storage() holds one more.
    return int(use_count(t.untyped_storage()._cdata)) - 1


def foreach_copy_(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for all i in one call (one kernel per group on CUDA).

    ``torch._foreach_copy_`` is private (torch >= 2.1). If it disappears, the
    loop below is the exact fallback.
    """
    foreach = getattr(torch, "_foreach_copy_", None)
    if foreach is None:
        for d, s in zip(dst, src, strict=True):
            d.copy_(s)
    elif dst:
        foreach(dst, src)


def foreach_mul_(tensors: Sequence[torch.Tensor], scale: float) -> None:
    """``t.mul_(scale)`` for every t in one call (the scale as :func:`number_as_tensor`).

    ``torch._foreach_mul_`` is private; the loop below is the exact fallback.
    """
    foreach = getattr(torch, "_foreach_mul_", None)
    if foreach is None:
        for t in tensors:
            t.mul_(scale)
    elif tensors:
        foreach(tensors, number_as_tensor(tensors, scale))


_WIDE = (torch.float32, torch.float64)
_DENSE = (torch.Tensor, torch.nn.Parameter)


def number_as_tensor(tensors: Sequence[torch.Tensor], number: float) -> float | torch.Tensor:
    """``number`` as a 0-d tensor of ``tensors``' dtype, where an op's result is the same.

    On CPU an op given a Python number wraps it in a new float64 tensor and
    casts it in the op's loop, per tensor: 1.7 us more a call than with a
    0-d tensor of the operand's dtype (``torch.mul(g, 0.5, out=v)``, 256
    floats: 2.9 against 1.2 us; torch 2.13), about what a foreach kernel
    over 200 tensors pays 200 times. float32 and float64 compute with the
    number rounded to their dtype either way, so the results are the same
    to the bit; half precision computes with the number unrounded (torch's
    ``Scalar`` overloads), and other devices take a number without the
    cost. For dense CPU tensors of one of those two dtypes, then, the 0-d
    tensor; otherwise the number as it is. Eager code only: made while
    dynamo traces, the tensor would be a constant of the graph.
    """
    if not tensors or type(tensors[0]) not in _DENSE or tensors[0].dtype not in _WIDE:
        return number
    dtype = tensors[0].dtype
    for t in tensors:
        if type(t) not in _DENSE or t.dtype is not dtype or not t.is_cpu or t.is_sparse:
            return number
    return torch.tensor(number, dtype=dtype)


def fused_optimizer_kernel(name: str) -> Callable[..., None] | None:
    """torch's fused optimizer kernel ``torch._fused_<name>_`` (``adam``, ``adamw``, ``sgd``).

    Private (torch >= 2.4 on CPU). ``None`` if it disappears: ``fdp.optim``
    then runs its foreach step, the same values to rounding.
    """
    kernel: Callable[..., None] | None = getattr(torch, f"_fused_{name}_", None)
    return kernel


def fused_optimizer_devices() -> frozenset[str]:
    """The device types torch's fused optimizer kernels run on (none if unknown)."""
    from torch.utils import _foreach_utils

    supported = getattr(_foreach_utils, "_get_fused_kernels_supported_devices", None)
    return frozenset(supported()) if supported is not None else frozenset()


Flatten = Any  # obj -> (children, context)


Unflatten = Any  # (context, children) -> obj


def registered_node(kind: type) -> tuple[Flatten, Unflatten] | None:
    """How a user-registered pytree node type flattens, whichever registry it is in.

    Looks in optree's registry under every namespace (optree has no public
    listing of namespaces: ``_NODETYPE_REGISTRY``, checked on optree 0.20) and
    in ``torch.utils._pytree``'s ``SUPPORTED_NODES``. Without them, a user's
    node type is not split and, holding tensors, is refused with an error.
    """
    import optree
    import torch.utils._pytree as torch_pytree

    registry: dict[Any, Any] = getattr(optree.registry, "_NODETYPE_REGISTRY", {})
    for key, entry in registry.items():
        if key is kind or (isinstance(key, tuple) and key[1] is kind):

            def flatten(obj: Any, entry: Any = entry) -> tuple[list[Any], Any]:
                out = entry.flatten_func(obj)
                return list(out[0]), out[1]

            return flatten, lambda context, children, e=entry: e.unflatten_func(context, children)
    node = torch_pytree.SUPPORTED_NODES.get(kind)
    if node is not None:
        return (
            lambda obj: (lambda out: (list(out[0]), out[1]))(node.flatten_fn(obj)),
            lambda context, children: node.unflatten_fn(children, context),
        )
    return None


def storage_free(
    cls: type[torch.Tensor], like: torch.Tensor, *, requires_grad: bool, device: Any = None
) -> torch.Tensor:
    """A ``cls`` instance with ``like``'s shape and dtype, on ``device`` (default ``like``'s),
    and no storage at all.

    A wrapper subclass (its ``__torch_dispatch__`` decides what any op does):
    what stands in for a fully sharded parameter whose unit is not gathered.
    """
    make: Any = torch.Tensor._make_wrapper_subclass
    out: torch.Tensor = make(
        cls,
        like.shape,
        dtype=like.dtype,
        device=like.device if device is None else device,
        requires_grad=requires_grad,
    )
    return out
