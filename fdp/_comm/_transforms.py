"""fdp's collectives as linear maps with a rule for every ``torch.func`` transform (the psum rule).

Every collective fdp runs is linear in its input, so its derivatives are
collectives too, as with JAX's ``psum``: the vjp reduces the cotangent the
same way, the jvp reduces the tangent the same way, and under ``vmap`` each
batched slice is reduced. :class:`_AllReduce` carries these rules once, as
an ``autograd.Function`` with ``setup_context``, ``backward``, ``jvp`` and
``vmap``; its backward and jvp call the Function itself, so the rules hold
at any nesting depth (``grad(grad)``, ``jvp(grad)``, ``vmap(grad)``,
``jacrev``, ``jacfwd``, ``hessian``, ``torch.autograd.forward_ad``).
Broadcast, all-gather and reduce-scatter are built from it (a masked or
zero-padded all-reduce, exact because adding zeros is), so one Function
holds every rule. These are the paths taken when a result must be
differentiable; the fast paths (in-place, bucketed, overlapped) stay where
nothing requires grad and no transform runs, and while compiling (dynamo
cannot trace a Function with a custom ``jvp``) the functional collectives.

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
import torch.distributed as dist

from fdp import _bucket, _compat, _tree
from fdp._comm import _groups
from fdp._comm._groups import ProcessGroup

F = TypeVar("F", bound=Callable[..., Any])


class _AllReduce(torch.autograd.Function):
    """``scale *`` the sum over the ranks of ``group`` of ``t``; linear, so self-transposed."""

    @staticmethod
    def forward(t: torch.Tensor, scale: float, group: ProcessGroup | None) -> torch.Tensor:
        out = _groups.all_reduce(t, group=group)
        return out if scale == 1.0 else out.mul_(scale)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.scale, ctx.group = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return psum(grad, scale=ctx.scale, group=ctx.group), None, None

    @staticmethod
    def jvp(ctx: Any, tangent: torch.Tensor, *_: Any) -> torch.Tensor:
        return psum(tangent, scale=ctx.scale, group=ctx.group)

    @staticmethod
    def vmap(
        info: Any, in_dims: tuple[Any, ...], t: torch.Tensor, scale: float, group: Any
    ) -> tuple[torch.Tensor, int | None]:
        # Every rank runs the same program, so every rank batches the same
        # way: the batch dimension goes first everywhere and slices pair up.
        dim = in_dims[0]
        if dim is None:
            return psum(t, scale=scale, group=group), None
        return psum(t.movedim(dim, 0), scale=scale, group=group), 0


def psum(t: torch.Tensor, *, scale: float = 1.0, group: ProcessGroup | None = None) -> torch.Tensor:
    """``scale`` times the sum of ``t`` over the ranks of ``group``, differentiable at any depth."""
    out: torch.Tensor = _AllReduce.apply(t, scale, group)  # type: ignore[no-untyped-call]
    return out


def broadcast(t: torch.Tensor, src: int, group: ProcessGroup | None) -> torch.Tensor:
    """Rank ``src``'s ``t`` (a group rank) on every rank; the transpose sums onto ``src``."""
    # Zeros that depend on ``t``: every rank's psum then has the same
    # derivatives to run (zeros_like would give the other ranks none: a hang).
    mine = dist.get_rank(group) == src
    return psum(t if mine else torch.where(torch.tensor(False), t, 0), group=group)


def all_gather(t: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """``t`` from every rank stacked along a new dim 0; the transpose is a reduce-scatter."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    rows = [t if r == rank else torch.where(torch.tensor(False), t, 0) for r in range(world)]
    return psum(torch.stack(rows), group=group)


def reduce_scatter(t: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Row ``rank`` of the sum over ranks of ``t`` (shape ``(world, ...)``)."""
    return psum(t, group=group)[dist.get_rank(group)]


def needs_rule(leaves: Sequence[Any]) -> bool:
    """Whether a collective over ``leaves`` must carry derivative or batching rules.

    True under any ``torch.func`` transform, when grad mode is on and a
    leaf requires grad, and when a leaf carries a forward-mode tangent.
    """
    if _compat.functorch_active():
        return True
    grad_mode = torch.is_grad_enabled()
    for t in leaves:
        if isinstance(t, torch.Tensor) and (
            (grad_mode and t.requires_grad) or _compat.has_tangent(t)
        ):
            return True
    return False


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

    ``buckets`` index ``leaves``. A leaf that does not require grad and that
    no transform wraps (a buffer the function closes over) comes back as it
    went in: as an output of the Function it would require grad, and ops
    that refuse a differentiable buffer (``batch_norm``'s running
    statistics) would raise.
    """
    order = [i for b in buckets for i in b.indices]
    slot = {i: s for s, i in enumerate(order)}
    local = tuple(
        dataclasses.replace(b, indices=tuple(slot[i] for i in b.indices)) for b in buckets
    )
    how = (scale, group, dtype)
    outputs = _Replicated.apply(local, how, *(leaves[i] for i in order))  # type: ignore[no-untyped-call]
    result = list(leaves)
    for s, i in enumerate(order):
        t = leaves[i]
        if t.requires_grad or _compat.is_transformed(t) or _compat.has_tangent(t):
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
            # Note: the compiled fallback. Dynamo traces the call when it can
            # keep the derivatives (no transform, no dual tensor); otherwise
            # the disabled copy runs eagerly, a graph break, since a right
            # result outside the graph beats a wrong one inside it.
            if torch.compiler.is_compiling() and _transformed(args, kwargs):
                return eager(*args, **kwargs)
            return fn(*args, **kwargs)

        return cast(F, entry)

    return wrap


def _transformed(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if _compat.functorch_active():
        return True
    leaves, _ = _tree.flatten((args, kwargs))
    return any(isinstance(t, torch.Tensor) and _compat.has_tangent(t) for t in leaves)
