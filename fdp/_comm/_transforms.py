"""Parameters and their gradients under ``torch.func`` transforms, on fdp's psum rule.

The differentiable collectives themselves live in :mod:`fdp._comm._differentiable`.
Here: when a collective must carry derivatives (``_mode.needs_rules``), the
bucketed average of gradients through :func:`~fdp._comm._differentiable.psum`
(:func:`reduce_buckets`), and :func:`eager_under_transforms`, the
decorator that runs an entry point eagerly where dynamo would drop a
collective's derivatives.

:class:`_Replicated` is ``ddp(params)`` under a transform: the identity
forward, a bucketed average of the cotangents backward (through
:func:`psum`, so the backward is itself differentiable), the identity on
tangents forward (a tangent of replicated parameters is itself replicated).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import torch
from torch.distributed import ProcessGroup

from fdp import _bucket, _compat, _mode, _tree
from fdp._comm._differentiable import psum

F = TypeVar("F", bound=Callable[..., Any])


def reduce_buckets(
    buckets: Sequence[_bucket.Bucket],
    tensors: Sequence[torch.Tensor | None],
    *,
    scale: float,
    group: ProcessGroup | None,
    dtype: torch.dtype | None = None,
) -> list[torch.Tensor | None]:
    """``scale`` times the sum over ranks of every bucketed tensor, one :func:`psum` per bucket.

    ``tensors`` is indexed like the buckets' ``indices``; a ``None`` there
    (a leaf this rank did not use) reduces zeros, so that every rank issues
    the same collectives, and gets the other ranks' share back. ``dtype``
    is what the bucket travels in (a compression hook's), the result comes
    back in the leaves' own.
    """
    out: list[torch.Tensor | None] = [None] * len(tensors)
    for bucket in buckets:
        parts = [tensors[i] for i in bucket.indices]
        flat = psum(torch.cat(bucket.pieces(parts, scale=scale, dtype=dtype)), group=group)
        for i, view in zip(bucket.indices, bucket.unpack(flat.to(bucket.dtype)), strict=True):
            out[i] = view
    return out


class _Replicated(torch.autograd.Function):
    """``ddp(params)`` under a transform: identity forward, bucketed average backward."""

    generate_vmap_rule = True

    @staticmethod
    def forward(
        buckets: tuple[_bucket.Bucket, ...], how: tuple[Any, ...], *leaves: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        return tuple(t.view_as(t) for t in leaves)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.buckets, ctx.how = inputs[0], inputs[1]
        ctx.n = len(inputs) - 2

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        scale, group, dtype = ctx.how
        reduced = reduce_buckets(ctx.buckets, grads, scale=scale, group=group, dtype=dtype)
        return (None, None, *reduced)

    @staticmethod
    def jvp(ctx: Any, *tangents: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        # The forward returns views, so must the jvp (autograd checks).
        return tuple(None if t is None else t.view_as(t) for t in tangents[2:])


def replicated(
    leaves: Sequence[Any],
    buckets: Sequence[_bucket.Bucket],
    *,
    scale: float,
    group: ProcessGroup | None,
    dtype: torch.dtype | None = None,
) -> list[Any]:
    """``leaves`` through :class:`_Replicated`: the bucketed leaves only, the rest as they are.

    ``buckets`` index ``leaves``. A leaf that does not require grad comes
    back as it went in where no transform wraps it (a buffer the function
    closes over) or where the innermost transform is a ``grad`` that does not
    differentiate it (a buffer passed outside ``argnums``): as an output of
    the Function it would require grad, and ops that refuse a differentiable
    buffer (``batch_norm``'s running statistics, in train and eval mode)
    would raise.
    """
    order = [i for b in buckets for i in b.indices]
    slot = {i: s for s, i in enumerate(order)}
    local = tuple(
        dataclasses.replace(b, indices=tuple(slot[i] for i in b.indices)) for b in buckets
    )
    how = (scale, group, dtype)
    outputs = _Replicated.apply(local, how, *(leaves[i] for i in order))  # type: ignore[no-untyped-call]
    result = list(leaves)
    plain_at_grad = _compat.innermost_is_grad()
    for s, i in enumerate(order):
        t = leaves[i]
        wrapped = _mode.wrapped([t]) and not plain_at_grad
        if t.requires_grad or wrapped or _mode.dual([t]):
            result[i] = outputs[s]
    return result


def eager_under_transforms(call: str) -> Callable[[F], F]:
    """Decorates an entry point that runs collectives: compiled under a
    ``torch.func`` transform or on forward-mode dual tensors, it runs eagerly.

    Dynamo drops, refuses or miscomputes the derivatives of collectives
    there (measured on torch 2.13: a jvp through ``all_reduce_grads`` came
    back zero, a vmap of it wrong); eagerly fdp's psum rule is right.
    Without ``fullgraph=True`` this is a graph break; with it, dynamo
    raises and shows the reason below.
    """
    reason = (
        f"{call} is not compiled under a torch.func transform or on forward-mode dual "
        "tensors: torch 2.13 drops or refuses the derivatives of collectives there "
        "(pytorch/pytorch#193279). Without fullgraph=True, fdp runs it eagerly here (a graph "
        "break) and the result is right; or call it outside the compiled function"
    )

    def wrap(fn: F) -> F:
        eager = _compat.compiler_disable(fn, reason=reason)

        @functools.wraps(fn)
        def entry(*args: Any, **kwargs: Any) -> Any:
            # Note [the compiled fallback]: Dynamo traces the call when it can
            # keep the derivatives (no transform, no dual tensor); otherwise
            # the disabled copy runs eagerly, a graph break, since a right
            # result outside the graph beats a wrong one inside it.
            if _mode.traced() and _mode.transformed(_tree.flatten((args, kwargs))[0]):
                return eager(*args, **kwargs)
            return fn(*args, **kwargs)

        return cast(F, entry)

    return wrap
