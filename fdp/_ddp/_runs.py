"""A run of leaves packed into its bucket at once: the common case of an alias node.

Under ``loss.backward()`` and ``fdp.grad`` an ``_Aliases`` node packs its
run's gradients (``Step.on_run``). In the common case, every gradient a
plain dense tensor, the first of its leaf in this step, and no ``.grad`` to
fold in, the run is packed without a Python step per leaf: C-level checks
over the whole run, one multi-tensor copy, and the hand-outs made by
``map``. Per leaf that is about a tenth of the loop it replaces, which
costs two to three times its own weight inside backward, between the
model's kernels. Anything else takes the loop, leaf by leaf.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fdp import _compat
from fdp._bucket import Layout
from fdp._ddp._reduction import InFlight

__all__ = ["RunSlots", "pack_run"]

_LAYOUT = operator.attrgetter("layout")
_GRAD = operator.attrgetter("grad")
_PLAIN = frozenset((torch.Tensor,))
_STRIDED = frozenset((torch.strided,))
_NONE = frozenset((None,))


@dataclass(frozen=True)
class RunSlots:
    """Where a run of several leaves sits: its bucket, and getters of its views and leaves.

    Made once per run by :meth:`of` (the reducer keeps them): the getters
    are ``operator.itemgetter``, which picks a run's items in one C call.
    """

    indices: tuple[int, ...]
    bucket: int
    views: Callable[[Sequence[torch.Tensor]], tuple[torch.Tensor, ...]]
    leaves: Callable[[Sequence[Any]], tuple[Any, ...]]

    @staticmethod
    def of(layout: Layout, indices: tuple[int, ...]) -> RunSlots | None:
        """The run's slots; None for a single leaf (the loop costs it nothing more)."""
        if len(indices) < 2:
            return None
        where = [layout.where[i] for i in indices]
        buckets = {k for k, _ in where}
        if len(buckets) != 1:  # alias_runs never makes one; the loop handles it
            return None
        return RunSlots(
            indices,
            bucket=where[0][0],
            views=operator.itemgetter(*(j for _, j in where)),
            leaves=operator.itemgetter(*indices),
        )

    def plain(
        self,
        state: InFlight,
        grads: tuple[torch.Tensor | None, ...],
        leaves: list[Any],
        *,
        returned: bool,
    ) -> bool:
        """Whether every gradient is dense, plain and first, with no ``.grad`` to fold."""
        return (
            set(map(type, grads)) == _PLAIN  # no None, no subclass
            and set(map(_LAYOUT, grads)) == _STRIDED
            and state.filled.isdisjoint(self.indices)
            and (returned or set(map(_GRAD, self.leaves(leaves))) == _NONE)
        )


def pack_run(views: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], scale: float) -> None:
    """``views[i] = grads[i] * scale``, in as few calls as memory traffic allows.

    A run of several leaves is at most 1 MiB (Note [one node a run]): a
    multi-tensor copy, then a multi-tensor scale while it is in cache. A
    larger leaf is a run of its own: one multiply, one pass over memory
    (``_foreach_mul``'s ``out=`` form computes into a temporary: two). At
    one rank (or under a comm hook) the scale is 1: a copy, which costs a
    third of the multiply's call (the multiply wraps the scale in a tensor).
    """
    if len(views) == 1:
        if scale == 1.0:
            views[0].copy_(grads[0])
        else:
            torch.mul(grads[0], scale, out=views[0])
        return
    _compat.foreach_copy_(views, grads)
    if scale != 1.0:
        _compat.foreach_mul_(views, scale)
