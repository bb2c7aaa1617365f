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

Note [alias priority]: why the alias's node is given the top priority. The engine runs the
ready node created last first; an alias made before the model's forward
would run only when backward ends, and every bucket would launch then. Given
a sequence number just below the leaves' own (``_compat.run_early``), each
alias's node runs, and its hook packs the gradient, as soon as the gradient
is complete, which is what lets a bucket's all-reduce start while the rest
of backward is still running.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Any

import torch

from fdp import _compat, _mode
from fdp._bucket import Layout
from fdp._ddp._step import Reduction, Step


def hooked_leaves(layout: Layout, leaves: list[Any]) -> list[int]:
    """The leaves a step reduces: in buckets, requiring grad, each tensor once (tied weights).

    A tensor at several leaves gets one alias and one hook; its other leaves
    reduce zeros and get the same ``.grad``.
    """
    seen: set[int] = set()
    out = []
    for i in layout.order:
        leaf = leaves[i]
        if leaf.requires_grad and id(leaf) not in seen:
            seen.add(id(leaf))
            out.append(i)
    return out


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

    def arm(self, leaves: list[Any], *, prescale: float | None, always_count: bool) -> list[Any]:
        """``leaves`` with an armed alias in place of each leaf a backward reduces."""
        if self.open is not None and not _compat.in_backward():
            self.open = None  # an earlier backward failed before its end: start afresh
        hooked = hooked_leaves(self.reduction.layout, leaves)
        # A custom Function cannot run with functorch's keys disabled: inside
        # a transform of the inputs, the reshape alias (no sparse gradients).
        sparse_ok = not _mode.transform_running()
        call = _Call(self, leaves, hooked, prescale, always_count, sparse_ok)
        aliases: dict[int, torch.Tensor] = {}
        # Plain leaves, also inside a transform of the inputs (jvp, vmap):
        # their aliases belong to ordinary autograd, as the leaves do.
        with _compat.functorch_disabled():
            for i in hooked:
                leaf = leaves[i]
                alias: Any
                # The hook holds the call (the leaves), never the alias: a
                # reference from the node's hook back to its own output would
                # be a cycle through C++ that Python's collector cannot free.
                # A tensor hook, not the node's backward: it also runs when
                # autograd.grad takes the aliases as its inputs (the node never runs).
                if sparse_ok:
                    alias = _APPLY_ALIAS(leaf)
                    _compat.run_early(alias)
                else:
                    alias = _compat.early_alias(leaf)
                _compat.add_grad_hook(alias, functools.partial(call.on_grad, i))
                aliases[id(leaf)] = alias
        out = list(leaves)
        for i in self.reduction.layout.where:  # tied leaves share one alias
            shared = aliases.get(id(leaves[i]))
            if shared is not None:
                out[i] = shared
        return out

    def step(self, call: _Call) -> Step:
        with self.lock:
            if self.open is None:
                self.open = Step(
                    self.reduction,
                    call.leaves,
                    call.hooked,
                    sparse_ok=call.sparse_ok,
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
    hooked: list[int]
    prescale: float | None
    always_count: bool
    sparse_ok: bool  # the aliases pass sparse gradients on

    def on_grad(self, i: int, grad: torch.Tensor | None) -> torch.Tensor | None:
        return self.reducer.step(self).on_grad(i, grad)


class _Alias(torch.autograd.Function):
    """An alias of a leaf (its memory, not an autograd view) whose node passes any gradient on.

    Not a view: a view's node is made anew (without its hooks) once its base
    is changed in place, as an optimizer step does, so hooks on a view would
    reduce the first backward only. A sparse gradient passes too, which
    ``_compat.early_alias``'s node (a reshape) refuses. The old ``ctx``-in-
    ``forward`` style costs a third of the ``setup_context`` one per call
    (6.6 against 17 us a leaf); it cannot run under ``torch.func``, where
    :meth:`Reducer.arm` takes ``early_alias`` instead.
    """

    @staticmethod
    def forward(ctx: Any, leaf: torch.Tensor) -> torch.Tensor:
        ctx.set_materialize_grads(False)  # an undefined gradient stays undefined
        return leaf.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> torch.Tensor | None:
        return grad


_APPLY_ALIAS = _compat.plain_apply(_Alias)
