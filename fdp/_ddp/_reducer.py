"""What arms ``DistributedDataParallel``'s reduction: the aliases ``ddp(params)`` returns.

``ddp(params)`` returns, for each leaf that requires grad, a fresh alias on
the leaf's memory (not an autograd view) and registers a gradient hook on it
(:class:`Reducer`). Every backward that passes through a call's output runs
those hooks, and so is reduced, once per backward: the first hook of a
backward opens a :class:`fdp._ddp._step.Step`, which ends with that
backward. A backward that does not pass through one (a local backward on
``params`` itself, torch's backward through ``ddp.module``) runs no hook and
issues no collective. A call's output reused for several backwards
(``retain_graph``, ``p = ddp(params)`` kept across steps, several forwards
then several backwards) is reduced in each of them, as torch's DDP does.

Note [alias priority]: why the aliases' nodes are given the top priority. The engine
runs the ready node created last first; an alias made before the model's
forward would run only when backward ends, and every bucket would launch
then. Given a sequence number just below the leaves' own
(``_compat.run_early``), a bucket's node runs, and its outputs' hooks pack
the gradients, as soon as the bucket's gradients are complete, which is what
lets a bucket's all-reduce start while the rest of backward is still running.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Any

import torch

from fdp import _bucket, _compat, _mode
from fdp._bucket import Layout
from fdp._ddp import _reuse
from fdp._ddp._hooked import Hooked
from fdp._ddp._reduction import Reduction
from fdp._ddp._runs import RunSlots
from fdp._ddp._step import Step


def hooked_leaves(layout: Layout, leaves: list[Any]) -> list[int]:
    """The leaves a step reduces: in buckets, requiring grad, each tensor once (tied weights).

    A tensor at several leaves gets one alias and one hook; its other leaves
    reduce zeros and get the same ``.grad``.
    """
    out = [i for i in layout.order if leaves[i].requires_grad]
    if len({id(leaves[i]) for i in out}) == len(out):
        return out
    first: dict[int, int] = {}  # a tied tensor's first leaf
    for i in out:
        first.setdefault(id(leaves[i]), i)
    return [i for i in out if first[id(leaves[i])] == i]


def alias_runs(layout: Layout) -> dict[int, int]:
    """Each bucketed leaf's run: consecutive leaves of a bucket, up to 1 MiB together.

    A leaf larger than that is a run of its own. See Note [one node a run].
    """
    runs: dict[int, int] = {}
    run = -1
    for bucket in layout.buckets:
        size: int | None = None  # a bucket starts a run
        for j, i in enumerate(bucket.indices):
            nbytes = bucket.width(j) * bucket.dtype.itemsize
            if size is None or size + nbytes > _bucket.ALIAS_RUN_CAP_BYTES:
                run, size = run + 1, 0
            runs[i] = run
            size += nbytes
    return runs


class Reducer:
    """Arms ``ddp(params)`` calls; each backward through an armed output is reduced once.

    ``open`` is the step of the backward running now (None between
    backwards). A step belongs to the outermost backward: hooks that run in a
    nested backward (reentrant activation checkpointing) join it.
    """

    def __init__(self, reduction: Reduction) -> None:
        self.reduction = reduction
        self.open: Step | None = None
        self.lock = threading.Lock()
        self.runs = alias_runs(reduction.layout)
        self.slots: dict[tuple[int, ...], RunSlots | None] = {}  # made at a run's first arm
        self.hooked: Hooked | None = None  # the last call's: fdp/_ddp/_hooked.py
        # Per device, a leaf that every alias node takes: see fdp/_ddp/_delivery.py.
        self.probes = {
            b.device: torch.empty(0, device=b.device, requires_grad=True)
            for b in reduction.layout.buckets
        }

    def arm(
        self,
        leaves: list[Any],
        *,
        prescale: float | None,
        always_count: bool,
        last: _reuse.Armed | None = None,
    ) -> tuple[list[Any], _reuse.Armed | None]:
        """``leaves`` with an armed alias in place of each leaf a backward reduces.

        Also what a later call may reuse (Note [reused aliases]), given
        ``last``, this reducer's previous call's: the caller keeps it. Not
        the reducer: its aliases' nodes refer to the reducer through C++,
        a cycle Python's collector cannot see.
        """
        if self.open is not None and not _compat.in_backward():
            self.open = None  # an earlier backward failed before its end: start afresh
        layout = self.reduction.layout
        hooked = hooked_leaves(layout, leaves)
        # A custom Function cannot run with functorch's keys disabled: inside
        # a transform of the inputs, the reshape alias (no sparse gradients).
        sparse_ok = not _mode.transform_running()
        options = (prescale, always_count)
        if sparse_ok:
            again = _reuse.reused(last, leaves, options, hooked)
            if again is not None:
                return again, last
        plan = self.hooked
        if plan is None or plan.indices != hooked:
            plan = self.hooked = Hooked.of(self.reduction, hooked)
        call = _Call(self, leaves, plan, prescale, always_count, sparse_ok)
        # Plain leaves, also inside a transform of the inputs (jvp, vmap):
        # their aliases belong to ordinary autograd, as the leaves do.
        with _compat.functorch_disabled():
            if sparse_ok:
                aliases = self._run_aliases(call, leaves, hooked)
            else:
                aliases = [_compat.early_alias(leaves[i]) for i in hooked]
        # The hook holds the call (the leaves), never the alias: a reference
        # from the node's hook back to its own output would be a cycle
        # through C++ that Python's collector cannot free. A tensor hook, not
        # the node's backward: it also runs when autograd.grad takes the
        # aliases as its inputs (the node never runs).
        on_grad = call.on_grad
        _compat.add_grad_hooks(aliases, [functools.partial(on_grad, i) for i in hooked])
        out = list(leaves)
        for i, alias in zip(hooked, aliases, strict=True):
            out[i] = alias
        if len(hooked) < len(layout.where):  # tied leaves share one alias
            by_id = {id(leaves[i]): out[i] for i in hooked}
            for i in layout.where:
                shared = by_id.get(id(leaves[i]))
                if shared is not None:
                    out[i] = shared
        kept = _reuse.keep(leaves, options, hooked, aliases, out) if sparse_ok else None
        return out, kept

    def _run_aliases(self, call: _Call, leaves: list[Any], hooked: list[int]) -> list[torch.Tensor]:
        """An alias of each hooked leaf, one node per run (see Note [one node a run])."""
        layout, runs = self.reduction.layout, self.runs
        aliases: list[torch.Tensor] = []
        start = 0
        while start < len(hooked):
            run, end = runs[hooked[start]], start + 1
            while end < len(hooked) and runs[hooked[end]] == run:
                end += 1
            device = layout.buckets[layout.where[hooked[start]][0]].device
            indices = tuple(hooked[start:end])
            if indices not in self.slots:
                self.slots[indices] = RunSlots.of(layout, indices)
            part = _Run(call, indices, self.slots[indices])
            made = _APPLY_ALIASES(part, self.probes[device], *[leaves[i] for i in part.indices])
            _compat.run_early(made[0])
            aliases.extend(made)
            start = end
        return aliases

    def step(self, call: _Call) -> Step:
        with self.lock:
            if self.open is None:
                self.open = Step(
                    self.reduction,
                    call.leaves,
                    call.hooked,
                    sparse_ok=call.sparse_ok,
                    probes=self.probes if call.sparse_ok else None,
                    prescale=call.prescale,
                    always_count=call.always_count,
                    done=self._closed,
                )
            return self.open

    def _closed(self, step: Step) -> None:
        if self.open is step:
            self.open = None


@dataclass(frozen=True)
class _Call:
    """One ``ddp(params)`` call's leaves and options, held by its aliases' hooks."""

    reducer: Reducer
    leaves: list[Any]
    hooked: Hooked
    prescale: float | None
    always_count: bool
    sparse_ok: bool  # the aliases pass sparse gradients on

    def on_grad(self, i: int, grad: torch.Tensor | None) -> torch.Tensor | None:
        # sparse_ok: the aliases are _Aliases outputs, whose node runs on_run
        step = self.reducer.open  # the lock only to open one: once a backward
        if step is None:
            step = self.reducer.step(self)
        elif step.batched and self.sparse_ok and not torch.is_grad_enabled():
            # Step.on_grad's common case without its call (a hook per leaf, in
            # backward): the node packs the gradient with its run (Step.on_run).
            return grad
        return step.on_grad(i, grad, node=self.sparse_ok)


@dataclass(frozen=True)
class _Run:
    """The leaves one ``_Aliases`` node aliases, and their call: what its backward packs."""

    call: _Call
    indices: tuple[int, ...]
    slots: RunSlots | None  # where the run sits, for a run packed at once

    def on_run(self, grads: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor | None, ...]:
        step = self.call.reducer.open  # the lock only to open one, as _Call.on_grad
        if step is None:
            step = self.call.reducer.step(self.call)
        return step.on_run(self.indices, grads, self.slots)


class _Aliases(torch.autograd.Function):
    """Aliases of a run of leaves (their memory, not views), whose node passes any gradient on.

    Not views: a view's node is made anew (without its hooks) once its base
    is changed in place, as an optimizer step does, so hooks on a view would
    reduce the first backward only. A sparse gradient passes too, which
    ``_compat.early_alias``'s node (a reshape) refuses. The old ``ctx``-in-
    ``forward`` style costs a third of the ``setup_context`` one per call
    (6.6 against 17 us a leaf); it cannot run under ``torch.func``, where
    :meth:`Reducer.arm` takes ``early_alias`` instead.

    Note [one node a run]: one node for a run of a bucket's leaves up to 1 MiB
    together (:func:`alias_runs`), not one per leaf: a node costs about 4 us
    a leaf more than an output does, 0.8 ms of a 200-leaf ``ddp(params)``
    (docs/performance.md). The node runs, and its outputs' hooks (or under
    ``loss.backward()`` the node itself, in one copy: ``Step.on_run``) pack
    the gradients, once every gradient of the run is complete; until then the
    engine holds the run's local gradients, and the bucket cannot launch
    anyway. The cap keeps that to a megabyte held and a megabyte's copy
    before a launch; a large leaf keeps a node of its own. Outputs that a
    backward does not reach give their hooks ``None``: the step packs those
    at the launch (``fdp/_ddp/_delivery.py`` tells the leaves that
    ``backward(inputs=...)`` leaves out).
    """

    @staticmethod
    def forward(
        ctx: Any, run: _Run, probe: torch.Tensor, *leaves: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)  # an undefined gradient stays undefined
        ctx.run = run
        return tuple(map(torch.Tensor.detach, leaves))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        # None for the run and the probe (fdp/_ddp/_delivery.py)
        return (None, None, *ctx.run.on_run(grads))


_APPLY_ALIASES = _compat.plain_apply(_Aliases)
