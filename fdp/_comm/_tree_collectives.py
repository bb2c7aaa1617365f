"""The collective building blocks for parameter pytrees: ``broadcast_params``, ``all_reduce_grads``.

Both pack a tree's tensor leaves into flat buffers by device and dtype
(``fdp/_bucket.py``) and check first that every rank holds the same tree
(``fdp/_comm/_agreement.py``). ``all_reduce_grads`` caches its plans and buffers
per tree signature and process group; :func:`clear_plans` releases them.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from fdp import _bucket, _caches, _compat, _mode, _sharded, _tree
from fdp._comm import _agreement, _differentiable, _groups, _raw, _transforms

__all__ = ["all_reduce_grads", "broadcast_params"]

T = TypeVar("T")

# torch's own default for broadcasting module states.


@_transforms.eager_under_transforms("fdp.broadcast_params")
def broadcast_params(tree: T, *, src: int = 0, group: ProcessGroup | None = None) -> T:
    """Gives every rank's tensor leaves rank ``src``'s values, in place.

    Leaves are packed into flat buffers by device and dtype (up to 250 MB
    each), so a tree of many small tensors costs a few collectives. All ranks
    first check that they hold the same tree (structure, shapes, dtypes) and
    raise the same ``ValueError`` if not.

    Args:
        tree: a pytree of tensors (``None`` leaves are skipped).
        src: the global rank whose values win.
        group: the process group (default: the world).

    Returns:
        ``tree`` itself, its leaves overwritten.

    Example::

        params = fdp.broadcast_params(params)  # after fdp.init_distributed()
    """
    call = "fdp.broadcast_params"
    with _agreement.local_checks(call, "tree", group):  # an error on one rank: on every
        _agreement.require_member(call, group)
        _sharded.refuse_over_own_group(
            call,
            "tree",
            tree,
            group,
            why=f"which rank {src}'s would replace; broadcast the parameters before "
            "fsdp.shard(params)",
        )
        leaves, _spec, tensors = _tree.tensor_leaves(tree, call=call, arg="tree", float_only=False)
        described = _agreement.signature(tree, leaves, "tree", requires_grad=False)
    with _compat.functorch_disabled():
        _agreement.check(described, group=group, call=call, arg="tree")
    # Leaves of the autograd graph are overwritten as data (initial weights);
    # computed tensors, dual tensors and transformed ones carry the derivative.
    grad_mode = torch.is_grad_enabled()
    if _mode.transformed(tensors) or any(
        t is not None and grad_mode and t.requires_grad and t.grad_fn is not None for t in tensors
    ):
        _broadcast_differentiable(tensors, src, group)
        return tree
    buckets = _bucket.plan(tensors, cap_bytes=_bucket.BROADCAST_CAP_BYTES)
    _raw.broadcast_coalesced(buckets, tensors, src=_groups.group_rank(group, src), group=group)
    return tree


def _broadcast_differentiable(
    tensors: list[torch.Tensor | None], src: int, group: ProcessGroup | None
) -> None:
    """broadcast_params on results of autograd or a transform: in place, with the derivative.

    ``t.copy_(broadcast(t))`` rebases ``t``'s history on the broadcast, whose
    transpose sums every rank's cotangent onto rank ``src`` (zero elsewhere).
    """
    mine = _groups.group_rank(group, src)
    for t in tensors:
        if t is not None:
            t.copy_(_differentiable.broadcast(t, mine, group))


@_transforms.eager_under_transforms("fdp.all_reduce_grads")
def all_reduce_grads(
    grads: T,
    *,
    group: ProcessGroup | None = None,
    bucket_cap_mb: float = _bucket.BUCKET_CAP_MB,
    average: bool = True,
) -> T:
    """All-reduces a tree of gradients in buckets of about ``bucket_cap_mb``.

    Tensor leaves are packed into flat buffers by device and dtype, in reverse
    leaf order; every bucket's all-reduce is launched before the first is
    waited for. ``None`` leaves stay ``None``. The input tensors are left as
    they are. Every call checks, with one tiny all-reduce hidden behind
    packing the first bucket, that all ranks pass the same tree (paths,
    shapes, dtypes); if not, every rank raises the same ``ValueError``
    naming the first differing leaf (rather than reducing unrelated leaves
    together, or aborting in the backend). Plans and buffers are cached per
    tree signature and process group (up to 8), safely across threads;
    :func:`fdp.clear_caches` releases them.

    Args:
        grads: a pytree of floating-point tensors and ``None``.
        group: the process group (default: the world).
        bucket_cap_mb: the size of a bucket in MiB.
        average: average instead of summing: each rank's gradients are
            divided by the group size as they are packed, as in torch's DDP.

    Returns:
        A tree of ``grads``' structure whose tensor leaves are views into the
        reduced flat buffers (no copy back).

    Example::

        grads = torch.func.grad(loss)(params, batch)
        grads = fdp.all_reduce_grads(grads)
        params = optree.tree_map(lambda p, g: p - lr * g, params, grads)
    """
    call = "fdp.all_reduce_grads"
    cap = _agreement.check_cap(bucket_cap_mb, "bucket_cap_mb", call=call)
    _agreement.require_member(call, group)
    try:
        leaves, spec, tensors = _checked_grads(call, grads)
        _sharded.refuse_over_own_group(
            call,
            "grads",
            grads,
            group,
            what="shards' gradients",
            why="averaged over the group by the backward's reduce-scatter already; an "
            "all-reduce would add other elements together",
        )
    except (TypeError, ValueError) as e:
        # The others are in the signature check, this call's first collective (eager)
        if not _mode.traced() and dist.get_world_size(group) > 1:
            _agreement.share_error(call, "grads", grads, e, group)
        raise
    scale = 1.0 / dist.get_world_size(group) if average else 1.0
    reduced: T = _reduce(grads, leaves, spec, tensors, group, cap, scale)
    return reduced


def _checked_grads(call: str, grads: Any) -> tuple[list[Any], Any, list[torch.Tensor | None]]:
    leaves, spec, tensors = _tree.tensor_leaves(grads, call=call, arg="grads", float_only=False)
    for i, t in enumerate(tensors):
        if t is not None and not (t.is_floating_point() or t.is_complex()):
            raise TypeError(
                f"{call}: `grads` leaf {_tree.path(grads, i, 'grads')} expected a floating-point "
                f"tensor; got {_tree.describe(t)}"
            )
    return leaves, spec, tensors


def _reduce_traced(
    grads: Any,
    leaves: list[Any],
    spec: _tree.Spec,
    tensors: list[torch.Tensor | None],
    group: ProcessGroup | None,
    cap: int,
    scale: float,
) -> Any:
    """One functional all-reduce per bucket: a graph of its own (no hooks, no plan cache)."""
    return _tree.unflatten(spec, _all_reduce_traceable(leaves, tensors, group, cap, scale))


@_mode.traced_as(_reduce_traced)
def _reduce(
    grads: Any,
    leaves: list[Any],
    spec: _tree.Spec,
    tensors: list[torch.Tensor | None],
    group: ProcessGroup | None,
    cap: int,
    scale: float,
) -> Any:
    """The bucketed all-reduces, asynchronous; under autograd or a transform, psum's."""
    if _mode.needs_rules(tensors):
        out = _all_reduce_differentiable(grads, leaves, tensors, group, cap, scale)
        return _tree.unflatten(spec, out)
    call = "fdp.all_reduce_grads"
    plan = _cached_plan(grads, spec, leaves, tensors, cap, group)
    out = list(leaves)
    # Divided while packing, as torch's DDP does: one pass over the bytes.
    with torch.no_grad():
        checking = plan.fingerprint.start(group)
        flats = plan.claim()
        works = []
        for k, bucket in enumerate(plan.buckets):  # pack bucket k+1 while bucket k travels
            views = bucket.views(flats[k])
            sources = [tensors[i] for i in bucket.indices]
            bucket.pack(sources, scale=scale, out=flats[k], views=views)
            if k == 0:  # the check's latency hides behind the first pack
                plan.fingerprint.finish(checking, group=group, call=call, arg="grads")
            works.append(dist.all_reduce(flats[k], group=group, async_op=True))
            for i, view in zip(bucket.indices, views, strict=True):
                out[i] = view
        if not plan.buckets:
            plan.fingerprint.finish(checking, group=group, call=call, arg="grads")
        for work in works:
            work.wait()
    return _tree.unflatten(spec, out)


def _all_reduce_differentiable(
    grads: Any,
    leaves: list[Any],
    tensors: list[torch.Tensor | None],
    group: ProcessGroup | None,
    cap: int,
    scale: float,
) -> list[Any]:
    """all_reduce_grads under autograd or a transform: one :func:`_differentiable.psum` per bucket.

    The result is differentiable at any depth (the reduction's derivatives
    are the same reduction) and batches under ``vmap``.
    """
    with torch.no_grad(), _compat.functorch_disabled():
        described = _agreement.signature(grads, leaves, "grads", requires_grad=False)
        fingerprint = _agreement.Fingerprint(described)
        fingerprint.finish(
            fingerprint.start(group), group=group, call="fdp.all_reduce_grads", arg="grads"
        )
    buckets = _bucket.plan(tensors, cap_bytes=cap)
    reduced = _transforms.reduce_buckets(buckets, tensors, scale=scale, group=group)
    return [leaf if t is None else t for leaf, t in zip(leaves, reduced, strict=True)]


def _all_reduce_traceable(
    leaves: list[Any],
    tensors: list[torch.Tensor | None],
    group: ProcessGroup | None,
    cap: int,
    scale: float,
) -> list[Any]:
    """all_reduce_grads while compiling: functional collectives, which dynamo traces.

    Every bucket's all-reduce is issued before any result is used, so the
    waits inserted at first use let them overlap.
    """
    out = list(leaves)
    buckets = _bucket.plan(tensors, cap_bytes=cap)
    reduced = [
        _raw.all_reduce(b.pack([tensors[i] for i in b.indices]), group=group) for b in buckets
    ]
    for bucket, total in zip(buckets, reduced, strict=True):
        for i, view in zip(bucket.indices, bucket.views(total * scale), strict=True):
            out[i] = view
    return out


class _Plan:
    """The bucket layout of one tree signature and its fingerprint."""

    def __init__(self, layout: _bucket.Layout, fingerprint: _agreement.Fingerprint) -> None:
        self.layout = layout
        self.buckets = layout.buckets
        self.fingerprint = fingerprint

    def claim(self) -> list[torch.Tensor]:
        """A flat buffer per bucket that no one else uses, reused when possible."""
        return [self.layout.buffer(k) for k in range(len(self.buckets))]


_PlanKey = tuple[Any, ...]
_plans: collections.OrderedDict[_PlanKey, _Plan] = collections.OrderedDict()
_plans_lock = threading.Lock()


def _cached_plan(
    tree: Any,
    spec: _tree.Spec,
    leaves: list[Any],
    tensors: list[torch.Tensor | None],
    cap_bytes: int,
    group: ProcessGroup | None,
) -> _Plan:
    """The plan for this tree signature, group and cap: planned once, then reused.

    A training loop reduces the same tree every step: planning once and
    reusing the flat buffers (when the caller has dropped the last result)
    saves the planning and the page faults of fresh tens-of-MB buffers.
    Keyed by group too: two groups never share buffers.
    """
    metas = tuple(None if t is None else (t.shape, t.stride(), t.dtype, t.device) for t in tensors)
    key = (cap_bytes, group, spec, metas)
    with _plans_lock:
        plan = _plans.get(key)
        if plan is not None:
            _plans.move_to_end(key)
            return plan
    described = _agreement.signature(tree, leaves, "grads", requires_grad=False)
    plan = _Plan(_bucket.Layout(tensors, cap_bytes=cap_bytes), _agreement.Fingerprint(described))
    with _plans_lock:
        plan = _plans.setdefault(key, plan)
        _plans.move_to_end(key)
        while len(_plans) > 8:
            _plans.popitem(last=False)
    return plan


@_caches.register
def clear_plans() -> None:
    """Drops every cached plan and its buffers (see :func:`fdp.clear_caches`)."""
    with _plans_lock:
        _plans.clear()
