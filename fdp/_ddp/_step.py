"""The per-step gradient reduction behind ``DistributedDataParallel``.

One :class:`Step` lives from the first hook of a backward that passes
through a ``ddp(params)`` output to the end of that backward
(``fdp/_ddp/_reducer.py`` says what arms it). Each gradient is copied into
its bucket's flat buffer, by its hook or, under ``loss.backward()`` and
``fdp.grad``, with its run of leaves by their alias node
(:meth:`Step.on_run`), and scaled by the ``prescale`` as it is copied; a
full bucket is launched once every earlier bucket has been, so every rank
issues the same collectives in the same order. A
callback queued on the engine runs when backward ends: it launches what is
left (leaves nobody used count as zero; which leaves any rank used:
``fdp/_ddp/_usage.py``), waits, and hands the reduced gradients out:

- ``loss.backward()``: each leaf's ``.grad`` is a view of its bucket from the
  moment it is packed (the engine keeps the alias the hook returns, and the
  local gradient is freed), reduced in place by the end. A ``.grad`` already
  there (accumulated under ``no_sync`` or by a local backward) is folded into
  the reduction, DDP's semantics.
- ``torch.autograd.grad`` (with the leaves or the call's outputs as inputs):
  the hook hands the engine the bucket view itself, and the callback reduces
  the bucket in place before the engine returns it, so the returned
  gradients are the reduced ones.

Collectives run under ``torch.no_grad()`` and with functorch's dispatch
disabled: the c10d ops are differentiable and would otherwise be recorded
(torch 2.13 raises under ``torch.func.grad``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fdp import _compat, _grad
from fdp._comm import _comm_hooks
from fdp._comm._comm_hooks import GradBucket
from fdp._ddp import _delivery, _graphed, _late, _usage
from fdp._ddp._delivery import Delivery
from fdp._ddp._hooked import Hooked
from fdp._ddp._reduction import InFlight, Reduction
from fdp._ddp._runs import RunSlots, pack_run
from fdp._ddp._sparse import empty_sparse, reduce_sparse

_DETACH = torch.Tensor.detach


class Step:
    """The reduction state of one synchronised forward/backward."""

    def __init__(
        self,
        reduction: Reduction,
        leaves: list[Any],
        hooked: Hooked,
        *,
        prescale: float | None = None,
        always_count: bool = False,
        done: Callable[[Step], None] | None = None,
        sparse_ok: bool = True,
        probes: dict[torch.device, torch.Tensor] | None = None,
    ) -> None:
        self.reduction, self.sparse_ok = reduction, sparse_ok
        # Per device, a leaf that the aliases' nodes take and never give a
        # gradient: whether the engine runs it says whether this backward
        # selects leaves (see decide). None where each leaf has a node of its own.
        self.probes = probes
        self.selective = False  # backward(inputs=...), autograd.grad: decide sets it
        self.done = done  # told when this backward's reduction has finished
        # ``join`` may divide by the ranks still training, and needs the
        # usage all-reduce on every step, which mirroring ranks answer.
        self.prescale = reduction.prescale if prescale is None else prescale
        self.always_count, self.leaves = always_count, leaves
        self.buckets = [InFlight(expected=n) for n in hooked.expected]
        self.plan, self.hooked = hooked, hooked.indices
        self.used: set[int] = set()  # leaves that got a gradient on this rank
        self.sparse: dict[int, torch.Tensor | None] = {}  # sparse here: this backward's
        self.late: dict[int, torch.Tensor] = {}  # past their launch: fdp/_ddp/_late.py
        self.next_launch, self.delivery, self.queued = 0, Delivery.UNDECIDED, False
        self.batched = False  # alias nodes pack their runs: see on_run
        self.rides = False  # the usage counts ride the last bucket: _start decides
        self.lock = threading.Lock()

    @property
    def returned(self) -> bool:
        """Whether gradients are returned (not accumulated in ``.grad``)."""
        return self.delivery is Delivery.RETURNED

    @property
    def counting(self) -> bool:
        """Whether the step counts, over ranks, which leaves had a gradient.

        ``.grad`` stays None where no rank had one; ``join``'s mirroring
        ranks answer the count on every step.
        """
        return not self.returned or self.always_count

    def _flat(self, k: int) -> torch.Tensor:
        state = self.buckets[k]
        if state.flat is None:
            tail = self.reduction.usage_tail if self.rides and k == len(self.buckets) - 1 else 0
            # The views are made once per buffer (Layout.buffer_views): this step's own
            # to write through; what leaves the step is a detach() of one.
            state.flat, state.views = self.reduction.layout.buffer_views(k, tail=tail)
        return state.flat

    def view(self, i: int) -> torch.Tensor:
        k, j = self.reduction.layout.where[i]
        self._flat(k)
        return self.buckets[k].views[j]

    def _refuse(self, i: int, grad: torch.Tensor | None) -> None:
        """Raises, inside backward, for what the reduction cannot give the reference for."""
        if grad is not None and grad.layout not in (torch.strided, torch.sparse_coo):
            raise RuntimeError(
                f"fdp.DistributedDataParallel: params leaf {self.reduction.paths[i]} got a "
                f"gradient with layout {grad.layout}; fdp reduces dense (strided) and sparse "
                "COO gradients: convert it in a hook on the parameter"
            )

    def on_grad(
        self, i: int, grad: torch.Tensor | None, *, node: bool = False
    ) -> torch.Tensor | None:
        """Leaf ``i``'s gradient: graphed, sparse, a second one, or the first (dense or None).

        ``node``: whether the alias's node (``_Aliases``) runs :meth:`on_run`
        after this hook, which then packs the run of leaves at once.
        """
        if torch.is_grad_enabled():  # backward(create_graph=True)
            self._refuse(i, grad)
            return _graphed.on_grad(self, i, grad)
        if node and self.batched:
            # Set once, under the lock, when the delivery is decided: read
            # without it, this hook costs a third (52 hooks of a GPT-2: 0.3 ms).
            return grad  # its node packs it with its run: on_run
        # Grad mode is off here already (the engine runs hooks without it).
        with self.lock, _compat.functorch_disabled():
            if self.delivery is Delivery.UNDECIDED:
                self._start(i)
            if node and self.batched:
                return grad  # its node packs it with its run: on_run
            return self._one(i, grad)

    def _start(self, i: int) -> None:
        """At the backward's first hook: how it delivers, and the callback at its end."""
        self.delivery = Delivery.RETURNED if self.decide(i) else Delivery.ACCUMULATED
        # loss.backward() and fdp.grad's autograd.grad (of fresh leaves) run every
        # alias node their gradients reach; a backward that selects (inputs=...) or
        # returns may take an alias's gradient without running its node.
        if self.delivery is Delivery.ACCUMULATED:
            self.batched = not self.selective
        else:
            self.batched = _grad.differentiating()
        # Note [usage rides the last bucket] (fdp/_ddp/_reduction.py)
        self.rides = self.reduction.usage_tail > 0 and self.counting
        if not self.queued:
            _compat.queue_backward_callback(self.finish)
            self.queued = True

    def _one(self, i: int, grad: torch.Tensor | None) -> torch.Tensor | None:
        """Packs one leaf's gradient (under the lock): what the engine gets in its place."""
        self._refuse(i, grad)
        if grad is None or self.dropped(i):
            # Undefined, not reached (its bucket's node ran for the
            # others), or not asked for: packed from .grad at the launch.
            return grad
        k = self.reduction.layout.where[i][0]
        if grad.is_sparse:
            return self._sparse(i, k, grad)
        if i in self.buckets[k].filled:
            return _late.again(self, i, k, grad)
        return self._first(i, k, grad)

    def on_run(
        self,
        indices: tuple[int, ...],
        grads: tuple[torch.Tensor | None, ...],
        slots: RunSlots | None = None,
    ) -> tuple[torch.Tensor | None, ...]:
        """A run's node: packs its leaves' gradients in one copy, where the hooks left them.

        Under ``loss.backward()`` and ``fdp.grad`` (:meth:`_start`'s
        ``batched``) the hooks pass the gradients on and the node packs them
        here: one multi-tensor copy for the run instead of a Python call and
        a copy per leaf. The plain case (a first, dense gradient, no
        ``.grad`` to fold) is batched, for a whole run at once where every
        leaf is plain (``slots``: ``fdp/_ddp/_runs.py``); else each leaf
        takes :meth:`_single`. Otherwise the hooks packed already, and the
        gradients pass on as they are.
        """
        if not self.batched or torch.is_grad_enabled():
            return grads
        with self.lock, _compat.functorch_disabled():
            if slots is not None:
                state = self.buckets[slots.bucket]
                if slots.plain(state, grads, self.leaves, returned=self.returned):
                    return self._run_at_once(slots, state, grads)  # type: ignore[arg-type]
            # Leaf by leaf, each packed before its bucket can launch: a leaf that
            # takes _one may complete the bucket, which launches at once.
            return tuple(map(self._single, indices, grads))

    def _single(self, i: int, grad: torch.Tensor | None) -> torch.Tensor | None:
        """One leaf of a run: a plain gradient (``RunSlots.plain``'s test) packed, else ``_one``."""
        k, j = self.reduction.layout.where[i]
        state = self.buckets[k]
        if (
            grad is None
            or grad.layout is not torch.strided
            or i in state.filled
            or (not self.returned and self.leaves[i].grad is not None)
        ):
            return self._one(i, grad)
        if state.flat is None:
            self._flat(k)
        view = state.views[j]
        state.filled.add(i)
        self.used.add(i)
        pack_run((view,), (grad,), self.prescale)
        self._launch_complete()
        return view.detach()

    def _run_at_once(
        self, slots: RunSlots, state: InFlight, grads: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, ...]:
        """:meth:`on_run`'s loop for a run of plain leaves (``slots.plain``), in C calls."""
        if state.flat is None:
            self._flat(slots.bucket)
        views = slots.views(state.views)
        state.filled.update(slots.indices)
        self.used.update(slots.indices)
        pack_run(views, grads, self.prescale)
        self._launch_complete()
        # into_bucket's aliases (.grad is None already), or the gradients returned
        return tuple(map(_DETACH, views))

    def decide(self, i: int) -> bool:
        """At the backward's first hook: whether it returns the gradients (else accumulates)."""
        k = self.reduction.layout.where[i][0]
        bucket = self.reduction.layout.buckets[k]
        probe = None if self.probes is None else self.probes[bucket.device]
        returned, self.selective = _delivery.decide(self.leaves, i, bucket.indices, probe)
        return returned

    def dropped(self, i: int) -> bool:
        """Whether ``backward(inputs=...)`` leaves leaf ``i`` out (its node ran for others)."""
        return (
            self.selective
            and self.delivery is not Delivery.RETURNED
            and _delivery.left_out(self.leaves[i])
        )

    def _first(self, i: int, k: int, grad: torch.Tensor) -> torch.Tensor:
        """Leaf ``i``'s first gradient, packed into bucket ``k``."""
        leaf, view = self.leaves[i], self.view(i)
        old = None if self.returned else leaf.grad
        self.used.add(i)
        if old is None:
            pack_run((view,), (_compat.unwrap_functorch(grad),), self.prescale)
        else:  # fold what earlier backwards (under no_sync) accumulated
            torch.add(_compat.unwrap_functorch(grad), old, out=view).mul_(self.prescale)
        self._filled(i, k)
        return view.detach() if self.returned else self.into_bucket(leaf, view)

    def _filled(self, i: int, k: int) -> None:
        """Leaf ``i``'s slot of bucket ``k`` is final: launches the buckets now complete."""
        self.buckets[k].filled.add(i)
        self._launch_complete()

    def _launch_complete(self) -> None:
        """Launches, in order, the buckets that hold every gradient this rank gives them."""
        # Riding, the last bucket waits for the counts: the finish launches it.
        end = len(self.buckets) - 1 if self.rides else len(self.buckets)
        while self.next_launch < end and self._complete(self.next_launch):
            with _compat.label(f"fdp::ddp.bucket {self.next_launch}"):
                self._launch(self.next_launch)

    @staticmethod
    def into_bucket(leaf: Any, view: torch.Tensor) -> torch.Tensor:
        """What the engine stores in ``.grad``: a fresh alias of the leaf's bucket view.

        The engine keeps a tensor that nothing else references instead of
        copying it, so ``.grad`` lives in the bucket from here on and the
        local gradient is freed at once, not held (a model's worth of
        memory) until backward ends; ``.grad`` is cleared first, or the
        engine would add into it what is already folded in.
        """
        leaf.grad = None
        return view.detach()

    def _sparse(self, i: int, k: int, grad: torch.Tensor) -> torch.Tensor:
        """A sparse gradient (``nn.Embedding(sparse=True)``): kept aside, reduced at the end.

        Its slot in the dense bucket stays zero. The hand-out all-reduces
        ``.grad`` (what ``no_sync`` left) plus what this backward kept, as
        a sparse tensor, on every rank, for each leaf any rank flagged, as
        torch's DDP reduces sparse gradients; the engine gets an empty one.
        """
        where = f"params leaf {self.reduction.paths[i]}"
        if self.returned:
            raise RuntimeError(
                f"fdp.DistributedDataParallel: {where} got a sparse gradient under "
                "torch.autograd.grad, which returns it before it can be reduced; use "
                "loss.backward() (the reduced sparse gradient lands in .grad)"
            )
        leaf = self.leaves[i]
        if not self.sparse_ok:
            raise RuntimeError(
                f"fdp.DistributedDataParallel: {where} got a sparse gradient with "
                "ddp(params) called inside a torch.func transform; call ddp(params) "
                "outside the transform, or use dense gradients (sparse=False)"
            )
        self.used.add(i)
        kept = self.sparse.get(i)
        self.sparse[i] = grad if kept is None else kept + grad
        if i not in self.buckets[k].filled:
            self.view(i).zero_()
            self._filled(i, k)
        return empty_sparse(leaf.shape, leaf.dtype, leaf.device)

    def _complete(self, k: int) -> bool:
        """Whether bucket ``k`` holds every gradient this rank will give it."""
        return len(self.buckets[k].filled) == self.buckets[k].expected

    def _launch(self, k: int) -> None:
        if self.reduction.serial and k > 0:
            previous = self.buckets[k - 1].future
            if previous is not None:
                previous.wait()
        flat = self._flat(k)
        bucket = self.reduction.layout.buckets[k]
        bucket.zero_pads(flat)
        filled = self.buckets[k].filled  # of bucket.indices: all of them, as a rule
        for j, i in enumerate(bucket.indices if len(filled) < len(bucket.indices) else ()):
            if i in filled:
                continue
            leaf = self.leaves[i]
            old = None if self.returned or not leaf.requires_grad else leaf.grad
            if old is not None and old.is_sparse:  # from no_sync: reduced on its own
                self.sparse.setdefault(i, None)
                old = None
            _pack_old(self.buckets[k].views[j], old, self.prescale)
        if self.rides and k == len(self.buckets) - 1:
            _usage.write(self, flat[bucket.numel :])
        if self.reduction.hook is None:
            future: Any = _comm_hooks.sum_hook(flat, self.reduction.group)
        else:
            grad_bucket = GradBucket(
                flat,
                index=k,
                is_last=k == len(self.buckets) - 1,
                gradients=[view.detach() for view in self.buckets[k].views],
                parameters=[self.leaves[i] for i in bucket.indices],
            )
            future = _comm_hooks.direct(self.reduction.hook)(self.reduction.state, grad_bucket)
        _comm_hooks.check_future(future)
        self.buckets[k].future = future
        self.next_launch = k + 1

    def finish(self) -> None:
        with self.lock, _compat.label("fdp::ddp.finish"):
            if self._defer_to_outer_backward():
                return
            self._finish()

    def _finish(self) -> None:
        with torch.no_grad(), _compat.functorch_disabled():
            try:
                if self.delivery is Delivery.GRAPHED:
                    _graphed.finish(self)
                    return
                while self.next_launch < len(self.buckets):
                    with _compat.label(f"fdp::ddp.bucket {self.next_launch}"):
                        self._launch(self.next_launch)
                alone = self.counting and not self.rides
                usage = self.launch_usage() if alone and not self.reduction.serial else None
                for state in self.buckets:
                    fut, flat = state.future, state.flat
                    if fut is None or flat is None:
                        raise RuntimeError("fdp internal error: a bucket was never launched")
                    result = _comm_hooks.resolved(fut)
                    if result is not flat:
                        _comm_hooks.check_result(result, flat)
                        flat.copy_(result)
                if usage is None and self.reduction.serial and alone:
                    usage = self.launch_usage()  # after every hook's last collective
                if self.returned and _grad.asked():  # fdp.grad: see returning_unused
                    for i in self.hooked:
                        if i not in self.used:
                            _grad.hand_unused(self.leaves[i], self.view(i).detach())
                counts = _usage.summed(self, usage)
                if counts is not None and not self.returned:  # else for join's mirrors only
                    self._hand_out(*counts)
                if self.reduction.replicas is not None and not self.always_count:  # not in join
                    self.reduction.replicas.after_reduction(self.leaves)
            finally:
                for state in self.buckets:  # the buffers may be reused now
                    state.flat, state.views = None, []
                if self.done is not None:
                    self.done(self)

    def _defer_to_outer_backward(self) -> bool:
        """Whether this is a nested backward's end, with gradients still to come.

        Reentrant activation checkpointing runs a nested backward inside a
        node of the outer one; a callback queued from a hook during it runs
        when the nested backward ends, before the outer backward has produced
        the other leaves' gradients. Then the finish moves to the outer
        backward: a post-hook on the node that ran the nested backward queues
        it again there.
        """
        if all(map(self._complete, range(len(self.buckets)))):
            return False
        outer = _compat.current_autograd_node()
        if outer is None:
            return False

        def requeue(*_: Any) -> None:
            _compat.queue_backward_callback(self.finish)

        outer.register_hook(requeue)
        return True

    def launch_usage(self) -> tuple[torch.Tensor, Any]:
        """Counts, over ranks, which hooked leaves had a gradient (one small all-reduce)."""
        return _usage.launch(self)

    def _hand_out(self, used: Sequence[float], late: float, sparse: list[int]) -> None:
        """``.grad`` becomes the reduced view; it stays ``None`` where no rank had one.

        ``sparse``: the leaves any rank flagged sparse, reduced on every rank
        in that order (:func:`_usage.summed`), a leaf this rank does not
        hook (frozen here only) too, whose result it drops: the replicas'
        check then names the leaf, as for a dense one.
        """
        if late > 0:
            _late.reduce(self)
        if sparse:
            self._reduce_sparse(sparse)
        if used and min(used) > 0 and not sparse:  # every leaf dense, used
            self.plan.hand_out_all(self.leaves, self.buckets)
            return
        strided, flagged = torch.strided, set(sparse)
        for i, count in zip(self.hooked, used, strict=True):
            if count > 0 and i not in flagged:
                leaf, view = self.leaves[i], self.view(i)
                grad = leaf.grad
                # Most already hold the alias into_bucket gave the engine: kept.
                if grad is None or grad.layout is not strided or grad.data_ptr() != view.data_ptr():
                    leaf.grad = view.detach()

    def _reduce_sparse(self, sparse: list[int]) -> None:
        """Each flagged leaf's sparse reduction; with a hook, a bucket of its own after the
        dense ones, as in torch."""
        r, mine = self.reduction, set(self.hooked)
        for n, i in enumerate(sparse):
            leaf = self.leaves[i]
            bucket = (r.state, len(self.buckets) + n, n == len(sparse) - 1, r.paths[i])
            if i in mine:
                leaf.grad = reduce_sparse(
                    leaf, self.sparse.get(i), self.prescale, r.group, hook=r.hook, bucket=bucket
                )
            else:
                reduce_sparse(
                    leaf, None, self.prescale, r.group, hook=r.hook, bucket=bucket, own=False
                )


def _pack_old(view: torch.Tensor, old: torch.Tensor | None, scale: float) -> None:
    if old is None:
        view.zero_()  # unused this step (or frozen): counts as zero
    else:
        pack_run((view,), (old,), scale)
