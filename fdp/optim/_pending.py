"""A whole-leaf step half done: what ``begin`` hands a sharded strategy (``fdp.optim._whole``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


class Pending:
    """A whole-leaf step between :meth:`~WholeLeafOptimizer.begin` and ``finish``.

    ``directions[i]`` is flat leaf ``i``'s direction (``None`` where the leaf
    is not stepped); ``params`` and ``state`` are the tree and the new state
    after the first part.
    """

    __slots__ = ("directions", "finisher", "params", "state")

    def __init__(
        self,
        directions: list[torch.Tensor | None],
        params: Any,
        state: dict[str, Any],
        finisher: Any,
    ) -> None:
        self.directions, self.params, self.state = directions, params, state
        self.finisher = finisher

    def finish(
        self,
        updates: list[torch.Tensor | None],
        *,
        params: Any = None,
        shapes: list[torch.Size | None] | None = None,
    ) -> tuple[Any, dict[str, Any]]:
        """The new parameters and state (see ``WholeLeafOptimizer.finish``)."""
        tree = self.params if params is None else params
        return self.finisher(updates, tree, shapes), self.state


class Chain:
    """Several groups' finishers in a row, each replacing its own stepped leaves."""

    def __init__(self, pendings: Sequence[Pending]) -> None:
        self.pendings = list(pendings)

    def __call__(
        self, updates: list[Any], params: Any, shapes: list[torch.Size | None] | None
    ) -> Any:
        for pending in self.pendings:
            params = pending.finisher(updates, params, shapes)
        return params
