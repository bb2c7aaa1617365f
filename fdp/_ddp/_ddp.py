"""``DistributedDataParallel`` for parameter pytrees, across processes on ``torch.distributed``.

It overlaps the gradient all-reduce with backward, as
``torch.nn.parallel.DistributedDataParallel`` does for modules. The bucket
layout lives in ``fdp/_bucket.py``, the cross-rank agreement checks in
``fdp/_comm/_agreement.py``, the per-step reduction (how DDP hooks into backward)
in ``fdp/_ddp/_step.py``, the compiled reduction in ``fdp/_ddp/_traced.py``,
buffers in ``fdp/_ddp/_buffers.py`` and ``join`` in ``fdp/_ddp/_join.py``;
``docs/design.md`` draws the data flow.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from fdp import _bucket, _compat, _mode, _tree
from fdp._comm import _agreement, _comm_hooks, _transforms
from fdp._comm._comm_hooks import CommHook
from fdp._ddp import _buffers, _forgotten, _join, _join_hooks, _reuse, _traced
from fdp._ddp._join import Joiner
from fdp._ddp._reducer import Reducer
from fdp._ddp._reduction import Reduction
from fdp._ddp._replicas import Replicas

__all__ = ["DistributedDataParallel"]


def _ddp_eagerly(ddp: DistributedDataParallel, params: Any) -> Any:
    return ddp(params)


# Where ddp(params) cannot be compiled, dynamo calls it eagerly (a graph
# break) and, under fullgraph=True, reports fdp's reason.
_UNDER_TRANSFORM = _compat.compiler_disable(_ddp_eagerly, reason=_traced.UNDER_TRANSFORM)
_IN_JOIN = _compat.compiler_disable(_ddp_eagerly, reason=_traced.IN_JOIN)

T = TypeVar("T")


class DistributedDataParallel:
    """Averages the gradients of a parameter tree across ranks, overlapping backward.

    Construction:
        ``ddp = DistributedDataParallel(params)`` plans buckets once: tensor
        leaves grouped by device and dtype in the reverse of the order they
        were put in the tree (each dict's insertion order, so a
        ``make_functional`` state buckets as torch's DDP buckets
        ``reversed(model.parameters())``), a first bucket of about
        ``first_bucket_cap_mb`` so communication starts early, then buckets
        of about ``bucket_cap_mb``. Construction is collective: all ranks
        check that they hold the same tree (and dicts in the same key order)
        and raise the same ``ValueError``, naming the first differing leaf,
        if not.

    Each step:
        ``ddp(params)`` returns the same tree with an alias (the same memory)
        of each leaf that requires grad. Every backward that passes through
        a call's output all-reduces (averages) each bucket as soon as all its
        gradients exist, while the rest of backward runs, launching buckets
        in the same order on every rank; a backward that does not is local
        and communicates nothing (torch's DDP through ``ddp.module``), but
        before any call has reduced, one that accumulates into ``.grad``
        outside :meth:`no_sync` raises (a forgotten ``ddp(params)``). So a
        call's output may be reused: ``retain_graph=True``, several forwards
        then several backwards, or ``p = ddp(params)`` kept across steps all
        reduce every backward once; a call with the module tensors of the
        last call gets that call's aliases back (``fdp/_ddp/_reuse.py``
        says when). Gradients are handed out only once reduced:

        - ``loss.backward()``: every leaf's ``.grad`` holds the average over
          ranks, including leaves this rank did not use (they count as
          zero); a leaf that no rank used keeps ``.grad`` ``None``, as in
          local training. Gradients keep their parameter's strides
          (``channels_last``); complex parameters are reduced as their real
          view.
        - ``torch.autograd.grad``: the returned gradients are averaged. A
          leaf this rank did not use at all comes back ``None``, while the
          other ranks still receive its contribution as zero.

    Transforms and compile:
        Under ``torch.func`` transforms (``grad``, ``jacrev``, ``hessian``,
        ``vmap``, ``jvp`` and their nests) of a function that calls
        ``ddp(params)`` on what they transform, ``ddp(params)`` is an
        identity whose backward averages each bucket through a
        differentiable all-reduce (the psum rule, ``docs/transforms.md``),
        after the model's backward; every rank gets the average, also of
        leaves it did not use. Inside ``torch.compile`` (``fullgraph=True``
        included) ``ddp(params)`` is traced: the same buckets are
        all-reduced by functional collectives in the compiled backward
        (``fdp/_ddp/_traced.py``), with the default hook or the fp16/bf16 ones;
        there a leaf that no rank used gets a zero ``.grad``.

    Buffers:
        Construction gives every rank rank 0's parameters and buffers, in
        place, as torch's DDP does (``init_sync=False`` for those who sync
        themselves). Buffers are the tensor leaves that do not require grad
        and are not ``nn.Parameter``s (BatchNorm's running statistics,
        integer counters; a frozen parameter in ``make_functional``'s state
        is an ``nn.Parameter`` and is synced at construction only, as torch
        does; in a plain tree, wrap a frozen weight in
        ``nn.Parameter(w, requires_grad=False)`` to say the same). With
        ``broadcast_buffers``, they get rank 0's values in place when
        torch's DDP broadcasts them: on a training call whose previous
        training call was synchronised (the first micro-batch under
        ``no_sync``); inside ``join`` from the highest rank still training;
        coalesced into one broadcast per device and dtype, eagerly, under
        ``torch.func`` and while compiling. A call under ``torch.no_grad``,
        or of a tree with no buffer, communicates nothing, so one rank may
        evaluate alone.

    Double backward:
        ``loss.backward(create_graph=True)`` leaves in ``.grad`` the average
        over ranks through a differentiable all-reduce, so a gradient
        penalty on it differentiates the global batch's gradient.

    Sparse gradients (``nn.Embedding(sparse=True)``, of 2-D leaves) are
        all-reduced on their own after the buckets (with a comm hook, each
        one is a bucket of its own for the hook); ``.grad`` stays sparse.

    Refused, with a clear error:
        ``torch.autograd.grad(..., create_graph=True)`` and sparse gradients
        under ``torch.autograd.grad`` (both are returned before the
        reduction), a ``params`` tree with no floating-point leaf,
        and trees whose structure, shapes, dtypes or ``requires_grad``
        differ across ranks. Reentrant activation checkpointing
        (``use_reentrant=True``) works: the reduction finishes when the
        outermost backward does.

    Args:
        params: the parameter tree (tensors and ``None``).
        group: the process group (default: the world).
        bucket_cap_mb: bucket size in MiB.
        first_bucket_cap_mb: size of the first bucket in MiB.
        comm_hook: how a bucket is reduced (see :data:`CommHook`);
            :func:`fp16_compress_hook` and :func:`bf16_compress_hook` halve the
            bytes sent. Default: :func:`allreduce_hook`.
        broadcast_buffers: give every rank rank 0's buffers (see above);
            False leaves each rank's buffers as its own forward left them.
        init_sync: give every rank rank 0's parameters and buffers at
            construction (torch's ``init_sync``).
        check_replicas_every: after every that many reduced backwards
            (eager), check that every rank holds the same parameters (a
            fingerprint per leaf, one all-reduce) and raise on every rank,
            naming the first leaf that differs: a loss that reads ``params``
            instead of ``ddp(params)`` trains each rank on its own
            gradients. ``0``: never (not inside ``join``, nor under a
            ``torch.func`` transform or ``torch.compile``, which reduce
            without the backward hooks).
        compiled_overlap: inside ``torch.compile``, whether each bucket's
            all-reduce may be issued as soon as its own gradients exist
            (what :func:`overlap_options` has inductor do). ``False``:
            every all-reduce after the last gradient (where inductor issues
            them anyway without :func:`overlap_options`). Either way a
            restarted job reuses the compiled backward from inductor's
            on-disk cache (docs/compile.md). Eager DDP is unaffected.

    Example::

        ddp = fdp.DistributedDataParallel(params)
        for x, y in loader:
            loss = loss_fn(model(ddp(params), x), y)
            loss.backward()  # .grad is averaged over ranks
            optimizer.step()
            optimizer.zero_grad()
    """

    def __init__(
        self,
        params: Any,
        *,
        group: ProcessGroup | None = None,
        bucket_cap_mb: float = _bucket.BUCKET_CAP_MB,
        first_bucket_cap_mb: float = _bucket.FIRST_BUCKET_CAP_MB,
        comm_hook: CommHook | None = None,
        broadcast_buffers: bool = True,
        init_sync: bool = True,
        check_replicas_every: int = 100,
        compiled_overlap: bool = True,
    ) -> None:
        call = "fdp.DistributedDataParallel"
        with _agreement.local_checks(call, "params", group):  # an error on one rank: on every
            cap = _agreement.check_cap(bucket_cap_mb, "bucket_cap_mb", call=call)
            first_cap = _agreement.check_cap(first_bucket_cap_mb, "first_bucket_cap_mb", call=call)
            if comm_hook is not None:
                _comm_hooks.check_hook(comm_hook, call=call, arg="comm_hook")
            if not isinstance(compiled_overlap, bool):
                raise TypeError(
                    f"{call}: `compiled_overlap` expected a bool; got {compiled_overlap!r}"
                )
            leaves, spec, tensors, order, described = _local_params(call, params, group)
        _agreement.check(described, group=group, call=call, arg="params")
        self._spec = spec
        self._planned = _tree.Planned(params, owner="this DistributedDataParallel")
        every = [t if isinstance(t, torch.Tensor) else None for t in leaves]
        self._meta = [None if t is None else (t.shape, t.dtype, t.device) for t in every]
        self._buffers = _buffers.Buffers(every, group) if broadcast_buffers else None
        final = _buffers.Buffers(every, group, with_params=True)  # every tensor leaf
        if init_sync:  # as torch's DDP: every rank starts from rank 0's parameters and buffers
            final.sync(leaves, src=0)
        elif self._buffers is not None:  # no_sync calls use them
            self._buffers.sync(leaves, src=0)
        self._refs = _join.weak(leaves)  # the tensors join synchronises if none come later
        self._layout = _bucket.Layout(
            tensors, cap_bytes=cap, first_cap_bytes=first_cap, order=order
        )
        paths = _tree.paths(params, "params")
        # Without a hook the division by the world size is folded into
        # packing the bucket (one pass over the gradients instead of two).
        # Parameters as the ranks agreed at construction: frozen since on some ranks
        # only, they must still be compared, and the list be the same everywhere.
        parameters = [i for i in self._layout.where if not _buffers.is_buffer(leaves[i])]
        replicas = Replicas(check_replicas_every, group, paths, parameters)
        self._reducer = Reducer(
            Reduction(self._layout, comm_hook, group, group, paths, replicas=replicas)
        )
        self.buckets: list[tuple[str, ...]] = [
            tuple(paths[i] for i in b.indices) for b in self._layout.buckets
        ]
        """The leaf paths of each bucket, in reduction order."""
        self._traced_spec = _tree.traced_spec(params)
        self._plan = _traced.Plan(
            self._layout,
            ties=_tree.ties(leaves, sorted(self._layout.where)),
            group=group,
            overlap=compiled_overlap,
            hook=_traced.traced_hook(comm_hook, group, group),
        )
        self._sync = True
        self._due = True  # the first training call broadcasts, as torch's first forward
        self._called = False
        self._kept: _reuse.Armed | None = None  # Note [reused aliases]
        self._reduces = False  # a ddp(params) call has reduced (armed a backward, or traced one)
        self._joiner: Joiner | None = None
        self._join_plan = self._plan_join(leaves, group, final)
        self._watch = _forgotten.Watch(self, leaves, paths)

    def _plan_join(
        self, leaves: list[Any], group: ProcessGroup | None, final: _buffers.Buffers
    ) -> _join.JoinPlan:
        """What ranks that left ``join`` mirror: buckets, buffers, where counts ride."""
        return _join.JoinPlan(
            group=group,
            buckets=tuple(self._layout.buckets),
            buffers=self._buffers,
            final=final,  # join's final synchronisation
            meta=tuple(self._meta),
            order=tuple(self._layout.order),  # the usage counts' slots
            paths=tuple(self._reducer.reduction.paths),
        )

    def __repr__(self) -> str:
        buckets = self._layout.buckets
        sizes = ", ".join(f"{b.numel * b.dtype.itemsize / _bucket.MB:.2f}" for b in buckets)
        return f"fdp.DistributedDataParallel({len(buckets)} buckets, MiB: [{sizes}])"

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Reduces every bucket with ``hook(state, bucket)``, torch's DDP protocol.

        torch's hooks run unmodified: ``default_hooks.allreduce_hook`` and
        its fp16/bf16 relatives and wrappers, ``powerSGD_hook`` with a
        ``PowerSGDState``. Register once, before the first ``ddp(params)``;
        ``comm_hook=`` at construction is the same with the group as state.
        Inside ``torch.compile`` only fdp's and torch's default, fp16 and
        bf16 hooks (with a process group or None as state) are traced.

        Example::

            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD

            state = powerSGD.PowerSGDState(process_group=None, start_powerSGD_iter=10)
            ddp.register_comm_hook(state, powerSGD.powerSGD_hook)
        """
        call = "fdp.DistributedDataParallel.register_comm_hook"
        _comm_hooks.check_hook(hook, call=call)
        if self._reducer.reduction.hook is not None or self._called:
            raise RuntimeError(
                f"{call}: a comm hook can be registered only once, before the first "
                "ddp(params); got a second registration (as torch's DDP refuses)"
            )
        reduction = dataclasses.replace(self._reducer.reduction, hook=hook, state=state)
        self._reducer = Reducer(reduction)
        self._kept = None
        self._plan.hook = _traced.traced_hook(hook, state, reduction.group)

    @contextmanager
    def join(self, *, divide_by_initial_world_size: bool = True) -> Iterator[None]:
        """Lets ranks with different numbers of batches train together (torch's ``Join``).

        Each rank runs its own loop of ``ddp(params)`` and backward inside the
        block. A rank that runs out of data leaves its loop; on leaving the
        block it mirrors the collectives of the ranks still training
        (contributing zeros) until every rank has left. Gradients are divided
        by the initial world size, or with
        ``divide_by_initial_world_size=False`` by the number of ranks still
        training. Buffers come from the highest rank still training, as in torch. An
        exception inside the block propagates without mirroring; the other
        ranks then fail at the process group's timeout instead of hanging.
        On leaving the block every rank takes the parameters and buffers of
        the last rank to leave (torch's final model sync: the others skipped
        its last optimizer steps); these are the tensors of each rank's
        latest ``ddp(params)``, so parameters updated in place (``torch.optim``)
        agree. An optimizer's own state (Adam's moments) is not synchronised,
        as in torch. ``fdp.sync_batch_norm`` inside the block takes its
        statistics over the ranks still training. A comm hook runs on zeros on the
        ranks that left, with their own state, as in torch; the hook divides the
        sum, so ``divide_by_initial_world_size=False`` is refused with one. Eager
        only (``fdp/_ddp/_join.py``).

        Example::

            with ddp.join():
                for x, y in my_uneven_shard:
                    loss_fn(model(ddp(params), x), y).backward()
                    opt.step()
                    opt.zero_grad()
        """
        reduction = self._reducer.reduction
        if reduction.hook is not None and not divide_by_initial_world_size:
            raise ValueError(
                "fdp.DistributedDataParallel.join: `divide_by_initial_world_size` expected "
                "True with a comm hook, which divides the sum itself (torch's hooks by the "
                "group's size); got False"
            )
        if self._joiner is not None:
            raise RuntimeError("fdp.DistributedDataParallel.join: already inside join")
        hooks = _join_hooks.HookPlan(reduction.hook, reduction.state, reduction.serial)
        self._joiner = Joiner(
            self._join_plan,
            self._refs,
            divide_by_initial_world_size=divide_by_initial_world_size,
            usage_tail=reduction.usage_tail,
            hooks=hooks,
        )
        try:
            with self._joiner.active():
                yield
                self._joiner.mirror()
        finally:
            self._joiner = None

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skips the reduction: gradients accumulate locally in ``.grad``.

        The next synchronised backward folds what accumulated into its
        reduction, so every rank then holds the average of the total.
        """
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def __call__(self, params: T) -> T:
        """``params`` as aliases; each backward through them averages the gradients across ranks."""
        return self._call(params)

    def _call_traced(self, params: T) -> T:
        """No hooks in a compiled graph: the reduction becomes part of it."""
        self._called = True
        leaves = self._checked_leaves(params)
        if self._joiner is not None:
            return cast(T, _IN_JOIN(self, params))
        if _traced.eager_only(
            leaves, buffers=self._buffers is not None and len(self._buffers.buckets) > 0
        ):
            return cast(T, _UNDER_TRANSFORM(self, params))
        synchronised = self._sync and torch.is_grad_enabled()
        if self._buffers_due() and self._buffers is not None:
            self._buffers.sync(leaves, src=0)
        if not synchronised:
            return params
        self._reduces = True
        synced = _traced.average(leaves, self._plan)
        return cast(T, _tree.unflatten(self._traced_spec or (), synced))

    @_mode.traced_as(_call_traced)
    def _call(self, params: T) -> T:
        """Hooks on the leaves reduce as backward runs (or the psum rule, under a transform)."""
        self._called = True
        leaves = self._checked_leaves(params)
        synchronised = self._sync and torch.is_grad_enabled()
        broadcast, src, prescale = self._buffers_due(), 0, None
        if self._joiner is not None:
            refused = synchronised and self._under_transform(leaves)
            src, prescale, broadcast = self._joiner.step(
                leaves, synchronised=synchronised, refused=refused, broadcast=broadcast
            )
        if self._buffers is not None and broadcast:
            self._buffers.sync(leaves, src=src)
        if not synchronised:
            return params
        self._reduces = True
        if self._under_transform(leaves):
            return cast(T, _tree.unflatten(self._spec, self._transformed(leaves)))
        return self._hooked(params, leaves, prescale=prescale)

    def _buffers_due(self) -> bool:
        """Whether this call broadcasts the buffers: torch's ``require_forward_param_sync``.

        A training call (grad enabled) broadcasts when the previous training
        call was synchronised (not under ``no_sync``), so under gradient
        accumulation the first micro-batch's forward does, as in torch's
        DDP. A call under ``no_grad`` never does and leaves the rule as it
        was (torch broadcasts there too, which hangs a rank evaluating
        alone; the next training call broadcasts what torch's eval did).
        """
        if not torch.is_grad_enabled() or self._buffers is None or not self._buffers.buckets:
            return False  # no flag to read: nothing for torch.compile to guard on
        due, self._due = self._due, self._sync
        return due

    def _under_transform(self, leaves: list[Any]) -> bool:
        """Whether a leaf is a ``torch.func`` wrapper or a forward-mode dual tensor.

        Leaf hooks cannot serve these: their gradients may be batched
        (``jacrev`` vmaps the backward of a ``vjp`` that looked like a plain
        ``grad`` when ``ddp(params)`` ran) or differentiated again. Plain
        leaves keep the hooks, which overlap the reduction with backward,
        even while a transform runs: ``ddp(params)`` inside a function that
        ``jvp`` or ``vmap`` transforms over its inputs, then ``.backward()``
        outside, is an ordinary backward.
        """
        mine = self._layout.bucketed(leaves)
        return _compat.any_transformed(mine) or _mode.dual(mine)

    def _transformed(self, leaves: list[Any]) -> list[Any]:
        """Leaves that carry the psum rule: identity forward, bucketed average backward."""
        if self._plan.hook.refusal is not None:
            raise NotImplementedError(
                "fdp.DistributedDataParallel: ddp(params) under a torch.func transform (or on "
                "forward-mode dual tensors) reduces with the exact average, or in fp16/bf16 with "
                "fdp's or torch's compression hooks; got another comm hook, whose futures "
                "cannot be differentiated. Call ddp(params) outside the transform, or "
                "reduce the transform's gradients with fdp.all_reduce_grads"
            )
        group = self._reducer.reduction.group
        return _transforms.replicated(
            leaves,
            self._layout.buckets,
            scale=1.0 / dist.get_world_size(group),
            group=group,
            dtype=self._plan.hook.dtype,
        )

    def _checked_leaves(self, params: Any) -> list[Any]:
        """``params``' leaves, checked against the tree the buckets were planned for."""
        call = "fdp.DistributedDataParallel.__call__"
        leaves = self._planned.leaves(call, "params", params)
        if not _mode.transform_running():
            for i in self._layout.where:
                t = leaves[i]
                if not t.is_leaf and not _mode.dual([t]):  # requires grad, made by a node
                    raise ValueError(
                        f"{call}: `params` leaf {_tree.path(params, i, 'params')} expected a "
                        f"leaf of the autograd graph; got a tensor computed by "
                        f"{type(leaves[i].grad_fn).__name__} (pass the tensors you update)"
                    )
        return leaves

    def _hooked(self, params: T, leaves: list[Any], *, prescale: float | None) -> T:
        """The eager path: the backward through the returned aliases reduces as it runs."""
        joining, last = self._joiner is not None, self._kept  # kept here: see Reducer.arm
        armed, kept = self._reducer.arm(leaves, prescale=prescale, always_count=joining, last=last)
        self._kept = kept if _reuse.safe(self._reducer.reduction) else None
        return cast(T, _tree.unflatten(self._spec, armed))


def _local_params(
    call: str, params: Any, group: ProcessGroup | None
) -> tuple[list[Any], Any, list[torch.Tensor | None], list[int], list[tuple[str, str]]]:
    """``params``' leaves, spec, float tensors and their order of use (buckets follow it
    backwards: :func:`fdp._tree.insertion_order`), and what every rank must agree on."""
    _agreement.require_member(call, group)
    leaves, spec, tensors = _tree.tensor_leaves(params, call=call, arg="params", float_only=True)
    if all(t is None for t in tensors):
        raise ValueError(
            f"{call}: `params` expected at least one floating-point tensor leaf; got none "
            f"among {len(leaves)} leaves (nothing to reduce: without trainable parameters "
            "DistributedDataParallel is not needed)"
        )
    described = _agreement.signature(params, leaves, "params", requires_grad=True)
    order = _tree.insertion_order(params)
    if order != sorted(order):  # its dicts' key order, not optree's: the buckets follow it
        described.append(("the order of its dicts' keys", repr(order)))
    return leaves, spec, tensors, order, described
