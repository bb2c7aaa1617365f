"""DDP's check, now and then, that every rank still holds the same parameters.

The loss must read ``ddp(params)``; torch's habit (the module is wrapped, so
the wrapper cannot be forgotten) does not carry over, and a rank that steps
on its own gradients trains another model with no error. After every
``every``-th reduced backward, each rank fingerprints its parameters (the
leaves that were parameters at construction, where the ranks agreed, frozen
since or not: which require grad now may differ between ranks; not the
buffers, which each rank's forward updates) and one all-reduce compares the
fingerprints
(:func:`fdp._comm._agreement.check_values`): every rank raises the same
error, naming the first leaf that differs. The check rides on the reduction
protocol, whose backwards every rank runs alike, so it never waits for a
rank that skipped it; inside ``join`` (ranks that left mirror only the
reduction) it is skipped.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from torch.distributed import ProcessGroup

from fdp import _compat
from fdp._comm import _agreement

DIVERGED = (
    "Some rank stepped on gradients that were not averaged: compute the loss from "
    "ddp(params) (not params), and step every rank's optimizer alike. "
    "check_replicas_every=0 turns this check off (ranks that hold different "
    "parameters on purpose)"
)


class Replicas:
    """Counts reduced backwards and checks the parameters after every ``every``-th."""

    def __init__(
        self,
        every: int,
        group: ProcessGroup | None,
        paths: Sequence[str],
        parameters: Collection[int],
    ) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ValueError(
                "fdp.DistributedDataParallel: `check_replicas_every` expected an int >= 0 "
                f"(0: never); got {every!r}"
            )
        self.every, self.group, self.paths = every, group, list(paths)
        self.parameters = frozenset(parameters)  # the leaves fingerprinted (see above)
        self.count = 0

    def after_reduction(self, leaves: Sequence[Any]) -> None:
        """One reduced backward ended (on every rank): check if it is the ``every``-th."""
        if self.every <= 0:
            return
        self.count += 1
        if self.count % self.every:
            return
        tensors = [
            _compat.unwrap_functorch(t) if i in self.parameters else None
            for i, t in enumerate(leaves)
        ]
        _agreement.check_values(
            tensors,
            self.paths,
            group=self.group,
            call="fdp.DistributedDataParallel",
            arg="params",
            fix=DIVERGED,
            when=f"after {self.count} reduced backwards",
        )
