"""``ZeroRedundancy.join``: stepping on ranks with different numbers of batches.

A ZeRO step is collective: every rank reduce-scatters its gradients, updates
its own slice of the parameters (and of the optimizer state, which no other
rank holds) and all-gathers the new parameters. A rank that runs out of data
cannot simply stop: the others' parameters need its slice. Inside ``join``
every step first all-reduces one flag per rank (1 while it trains). A rank
that leaves the block keeps answering with 0 and mirrors each step of the
others with zero gradients, so it updates its slice with their average and
takes part in the all-gather (torch's ``ZeroRedundancyOptimizer`` join hook
does the same for its broadcasts). Gradients are averaged over the initial
world size: what a rank that has left contributes is zero, as DDP's join
gives by default. When every flag is 0 the block ends everywhere, and every
rank holds the same parameters, in :attr:`Joined.params`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from fdp import _compat, _tree
from fdp._comm import _training

Step = Callable[[Any, Any, Any], tuple[Any, Any]]


class Joined:
    """One ``join`` block: the latest parameters and state, and the flag exchange.

    ``params`` and ``state`` are this rank's latest: those the block started
    with, then each step's result, the mirrored steps' included. Read them
    after the block: a rank that left early holds there what the others hold.
    """

    def __init__(self, params: Any, state: Any, group: ProcessGroup | None) -> None:
        self.params, self.state = params, state
        self.group = group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.grads: Any = None  # the structure of the latest gradients, for zeros
        self.mirroring = False

    def exchange(self, *, training: bool, call: str | None = None) -> int:
        """The number of ranks still training (one all-reduce of one flag per rank).

        ``call``: a collective this training rank is about to make instead of
        a step (:meth:`announce`); unless every rank makes it, every rank raises.
        """
        flags = torch.zeros(self.world + 1)
        if training:
            flags[self.rank] = 1.0
            flags[self.world] = 0.0 if call is None else 1.0
        with _compat.functorch_disabled():
            dist.all_reduce(flags, group=self.group)
        announced = int(flags[self.world])
        if announced not in (0, self.world):
            what = call or "fdp.ZeroRedundancy.join"
            raise RuntimeError(_training.unmirrored(what, "ZeroRedundancy", announced, self.world))
        return int(flags[: self.world].sum().item())

    def announce(self, call: str) -> None:
        """A training rank's collective ``call`` (not a step): every rank makes it, or all raise."""
        if not self.mirroring:
            self.exchange(training=True, call=call)

    def before(self, grads: Any) -> None:
        """A training rank's step begins: announce it, remember the gradients' structure."""
        if not self.mirroring:
            self.exchange(training=True)
            self.grads = grads

    def after(self, params: Any, state: Any) -> None:
        self.params, self.state = params, state

    def mirror(self, step: Step) -> None:
        """Steps with zero gradients until every rank has left the block."""
        self.mirroring = True
        try:
            while self.exchange(training=False) > 0:
                self.after(*step(_zeros(self.grads, self.params), self.state, self.params))
        finally:
            self.mirroring = False


def _zeros(grads: Any, params: Any) -> Any:
    """Zero gradients shaped like ``grads`` (None where it had None), or like ``params``."""
    leaves, spec = _tree.flatten(params if grads is None else grads)
    zeros = [
        torch.zeros_like(t, memory_format=torch.preserve_format)
        if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())
        else None
        for t in leaves
    ]
    return _tree.unflatten(spec, zeros)
