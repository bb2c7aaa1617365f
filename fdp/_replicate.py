"""Copying a parameter tree to several devices, differentiably.

A replica on a leaf's own device *is* that leaf (no copy, no autograd node):
its gradient reaches the leaf through ordinary accumulation, and buffers
updated in place (BatchNorm running statistics) persist. Leaves that must
cross devices go through one :class:`_Broadcast` call: forward packs them into
one flat buffer per (source device, real dtype) with the bucket planner of
``all_reduce_grads`` (uncapped), copies each buffer once per target device and
hands out views; backward packs the replicas' gradients the same
way and reduce-adds them onto each source leaf's device (the C++ seed's
``ReduceAdd``).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from fdp import _bucket, _mode, _tree
from fdp._device import DeviceLike, all_cpu, as_devices

__all__ = ["replicate"]

# One copy job: a bucket of the Function's tensor inputs (one source device,
# one real dtype; the planner of all_reduce_grads and DDP, with no size cap)
# and the device it is copied to. A non-strided tensor (sparse) travels alone,
# as a one-leaf bucket that is never packed.
_Copy = tuple[_bucket.Bucket, torch.device]


def _copy_group(
    bucket: _bucket.Bucket, tensors: Sequence[torch.Tensor], device: torch.device
) -> list[torch.Tensor]:
    """Copies a bucket's tensors to ``device`` with one transfer."""
    non_blocking = device.type != "cpu"
    if len(tensors) == 1:
        return [tensors[0].to(device, non_blocking=non_blocking)]
    flat = bucket.pack(tensors).to(device, non_blocking=non_blocking)
    return bucket.views(flat)


class _Broadcast(torch.autograd.Function):
    """Forward: coalesced copies; backward: coalesced reduce-add to the sources.

    Written in the ``setup_context`` style so that it runs under
    ``torch.func.grad``; ``copies`` is a non-tensor input. A copy is linear:
    the backward is plain differentiable ops, ``vmap`` batches the forward,
    and :class:`_BroadcastForward` adds the jvp.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(copies: tuple[_Copy, ...], *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outputs: list[torch.Tensor] = []
        for bucket, device in copies:
            outputs.extend(_copy_group(bucket, [tensors[i] for i in bucket.indices], device))
        return tuple(outputs)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        copies: tuple[_Copy, ...] = inputs[0]
        ctx.copies = copies
        ctx.sources = [(t.device, t.shape, t.dtype) for t in inputs[1:]]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        totals: list[torch.Tensor | None] = [None] * len(ctx.sources)
        offset = 0
        for bucket, _device in ctx.copies:
            indices = bucket.indices
            group_grads = list(grads[offset : offset + len(indices)])
            offset += len(indices)
            for i, g in zip(indices, _copy_group(bucket, group_grads, bucket.device), strict=True):
                total = totals[i]
                totals[i] = g if total is None else total + g
        return (None, *totals)


class _BroadcastForward(_Broadcast):
    """:class:`_Broadcast` with a jvp: the tangents are copied the same way.

    The jvp goes through this Function again, so that nests of transforms
    compose. Eager only: dynamo cannot trace a Function with a custom jvp
    (torch 2.13).
    """

    @staticmethod
    def jvp(ctx: Any, _copies: None, *tangents: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        filled = [
            t if t is not None else torch.zeros(shape, device=device, dtype=dtype)
            for t, (device, shape, dtype) in zip(tangents, ctx.sources, strict=True)
        ]
        out: tuple[torch.Tensor, ...] = _BroadcastForward.apply(ctx.copies, *filled)  # type: ignore[no-untyped-call]
        return out


def _plan(tensors: list[torch.Tensor], targets: list[torch.device]) -> tuple[_Copy, ...]:
    if all(t.device == target for t in tensors for target in targets):
        return ()  # nothing crosses devices: no planning on the hot path
    strided = [t if t.layout == torch.strided else None for t in tensors]
    buckets = _bucket.plan(strided, cap_bytes=sys.maxsize)
    buckets += [
        _bucket.plan([t if j == i else None for j in range(len(tensors))], cap_bytes=0)[0]
        for i, t in enumerate(tensors)
        if t.layout != torch.strided
    ]
    return tuple((b, target) for target in targets for b in buckets if b.device != target)


def _function_traced(tensors: list[torch.Tensor]) -> type[torch.autograd.Function]:
    """While tracing: reverse mode only (a compiled jvp over copies is refused first)."""
    return _Broadcast


@_mode.traced_as(_function_traced)
def _function(tensors: list[torch.Tensor]) -> type[torch.autograd.Function]:
    """The Function copying ``tensors``: one with a forward-mode rule where tangents may flow."""
    if _mode.transformed(tensors):
        return _BroadcastForward
    return _Broadcast


def replicate(params: Any, devices: Sequence[DeviceLike]) -> list[Any]:
    """Copies a parameter pytree to each device, differentiably.

    Replica ``i`` lives on ``devices[i]``. On a leaf's own device the replica
    holds the leaf itself; elsewhere it holds a copy made by one coalesced
    transfer per (source device, real dtype). Gradients of the replicas are summed
    back onto each source leaf's device. Leaves that do not require grad
    (buffers) are copied without autograd, and each replica owns its copy:
    replica 0 holds the leaf itself when on the leaf's device, every other
    replica a copy of its own, even on the same device, so in-place updates
    (BatchNorm running statistics) never mix between replicas. A tensor
    that appears at several leaves (tied weights) is copied once and stays
    tied in every replica.

    Args:
        params: a pytree whose leaves are tensors or ``None``.
        devices: one device per replica; repeats allowed.

    Returns:
        A list of pytrees with the structure of ``params``, one per device.

    Raises:
        TypeError: a leaf of ``params`` is neither a tensor nor ``None``.

    Example:
        >>> import torch, fdp
        >>> w = torch.ones(3, requires_grad=True)
        >>> a, b = fdp.replicate({"w": w}, ["cpu", "cpu"])
        >>> (a["w"].sum() + 2 * b["w"].sum()).backward()
        >>> w.grad.tolist()
        [3.0, 3.0, 3.0]
    """
    call = "fdp.replicate"
    return replicate_on(params, as_devices(devices, call=call), call=call)


def _unique_leaves(
    params: Any, leaves: list[Any], *, call: str
) -> tuple[list[torch.Tensor], list[int]]:
    """The distinct tensors, and per leaf its slot among them (-1 for ``None``).

    Deduplicated by identity: a tensor tied at two leaves enters the Function
    once (pytorch/pytorch#183604) and its copies stay tied.
    """
    for i, leaf in enumerate(leaves):
        if leaf is not None and not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"{call}: `params` leaf {_tree.path(params, i, 'params')} expected a tensor "
                f"or None; got {_tree.describe(leaf)}{_tree.torch_habit(leaf)}"
            )
    tied = _tree.ties(leaves)
    firsts = [i for i, leaf in enumerate(leaves) if leaf is not None and i not in tied]
    slot = {i: k for k, i in enumerate(firsts)}
    leaf_slots = [-1 if leaf is None else slot[tied.get(i, i)] for i, leaf in enumerate(leaves)]
    return [leaves[i] for i in firsts], leaf_slots


def replicate_on(
    params: Any,
    devs: list[torch.device],
    *,
    call: str,
    copied_state: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> list[Any]:
    """:func:`replicate` on normalised devices.

    ``copied_state``, if given, receives (leaf, replica 0's copy) for each
    leaf that does not require grad and that replica 0 holds as a copy.
    """
    # Nothing to copy: each replica is a tree of its own holding the leaves.
    if type(params) is dict and _shared_as_is(params.values(), devs):
        return [params.copy() for _ in devs]  # a flat dict (make_functional's state)
    leaves, spec = _tree.flatten(params)
    if _shared_as_is(leaves, devs):
        return [_tree.unflatten(spec, leaves) for _ in devs]
    targets = list(dict.fromkeys(devs))
    unique, leaf_slots = _unique_leaves(params, leaves, call=call)
    per_device: dict[torch.device, list[torch.Tensor]] = {d: list(unique) for d in targets}
    if _plan(unique, targets):  # anything to copy at all (usually not, on one device)
        _copy_to(per_device, unique, targets, call=call)
    state_slots = [s for s, t in enumerate(unique) if not t.requires_grad]

    def build(i: int, device: torch.device) -> Any:
        mine = list(per_device[device])
        for s in state_slots:
            # State (buffers) is private to each replica: only replica 0 may
            # hold the leaf itself, so that exactly one replica's in-place
            # update (BatchNorm statistics) lands on it, as with DataParallel.
            # Differentiable: under a torch.func transform or while tracing,
            # a parameter may not report requires_grad and still need grads.
            if i > 0 and (mine[s] is unique[s] or device in devs[:i]):
                mine[s] = mine[s].clone()
        return _tree.unflatten(spec, [None if s < 0 else mine[s] for s in leaf_slots])

    # Replicas on one device share one copy of each parameter (a forward pass
    # only reads parameters) but each gets a tree of its own.
    if copied_state is not None:
        first = per_device[devs[0]]
        copied_state.extend((unique[s], first[s]) for s in state_slots if first[s] is not unique[s])
    return [build(i, d) for i, d in enumerate(devs)]


# Leaf types shared as they are: other tensor subclasses may place or copy
# themselves their own way, so they take the general path.
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _shared_as_is(leaves: Iterable[Any], targets: list[torch.device]) -> bool:
    """Whether every replica gets the leaves themselves (the usual case on one device).

    So when every leaf is ``None`` or a parameter that requires grad and
    already sits on every target: nothing to copy, no state to keep private.
    """
    if all_cpu(targets):
        # CPU replicas: Tensor.is_cpu costs half of .device and a comparison,
        # which matters at 1 us per leaf and call (docs/performance.md).
        for leaf in leaves:
            if leaf is not None and (
                type(leaf) not in _PLAIN or not leaf.requires_grad or not leaf.is_cpu
            ):
                return False
        return True
    for leaf in leaves:
        if leaf is None:
            continue
        if type(leaf) not in _PLAIN or not leaf.requires_grad:
            return False
        where = leaf.device
        for target in targets:  # a loop, not any(): a generator costs more than the test
            if where != target:
                return False
    return True


def _copy_to(
    per_device: dict[torch.device, list[torch.Tensor]],
    unique: list[torch.Tensor],
    targets: list[torch.device],
    *,
    call: str,
) -> None:
    """Fills ``per_device`` with each target's copies of ``unique`` (differentiably)."""
    differentiable = torch.is_grad_enabled()
    grad_slots = [s for s, t in enumerate(unique) if differentiable and t.requires_grad]
    plain_slots = [s for s, t in enumerate(unique) if not (differentiable and t.requires_grad)]
    for slots, use_autograd in ((grad_slots, True), (plain_slots, False)):
        tensors = [unique[s] for s in slots]
        copies = _plan(tensors, targets)
        if not copies:
            continue
        # Up to torch 2.14, compiling a transform loses _Broadcast's backward,
        # so the replicas' gradients would never reach the leaves.
        _mode.refuse_compiled_transform(
            call, "copying params to other devices", lost="their gradients", inputs=tensors
        )
        if use_autograd:
            fn = _function(tensors)
            outputs: Sequence[torch.Tensor] = fn.apply(copies, *tensors)  # type: ignore[no-untyped-call]
        else:
            with torch.no_grad():
                outputs = _Broadcast.forward(copies, *tensors)
        offset = 0
        for bucket, device in copies:
            indices = bucket.indices
            for i, out in zip(indices, outputs[offset : offset + len(indices)], strict=True):
                per_device[device][slots[i]] = out
            offset += len(indices)
