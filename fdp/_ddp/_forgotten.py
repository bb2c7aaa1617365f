"""A forgotten ``ddp(params)``: a backward into DDP's leaves before any call reduces one.

A loop that builds ``DistributedDataParallel(params)`` and then computes
its loss from ``params`` instead of ``ddp(params)`` runs no fdp code: each
rank trains on its own gradients, and the replicas check (which runs at the
end of a reduced backward) never runs. Until the first ``ddp(params)`` call
that reduces, a post-accumulate hook on each leaf that requires grad raises
when a backward accumulates into its ``.grad`` outside ``ddp.no_sync()``,
on every rank that does. Once a call reduces, the hooks remove themselves
at the next accumulation: a step after that pays nothing, and a local
backward between or after DDP steps stays what it was (docs/distributed.md).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch

from fdp import _mode


class Watch:
    """Post-accumulate hooks on ``leaves`` (by path) until a ``ddp(params)`` call reduces.

    ``owner`` is the ``DistributedDataParallel`` (held weakly): its
    ``_reduces`` says a call has reduced, its ``_sync`` is False inside
    ``no_sync`` (accumulating locally is what the caller asked for).
    """

    def __init__(self, owner: Any, leaves: list[Any], paths: list[str]) -> None:
        self._owner = weakref.ref(owner)
        self._handles: list[Any] = []
        seen: set[int] = set()
        for t, path in zip(leaves, paths, strict=True):
            if not (isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf):
                continue
            if id(t) in seen or _mode.wrapped([t]):
                continue
            seen.add(id(t))
            hook = functools.partial(self._accumulated, path)
            self._handles.append(t.register_post_accumulate_grad_hook(hook))  # type: ignore[no-untyped-call]

    def _accumulated(self, path: str, leaf: torch.Tensor) -> None:
        owner = self._owner()
        if owner is None or owner._reduces:
            self.remove()
            return
        if not owner._sync:
            return
        raise ValueError(
            f"fdp.DistributedDataParallel: a backward accumulated into `params` leaf {path}"
            ".grad before any ddp(params) call reduced one: the loss was computed from params, "
            "not ddp(params), so each rank trains on its own gradients. Compute it from "
            "ddp(params); to accumulate locally on purpose, run the backward inside "
            "`with ddp.no_sync():`"
        )

    def remove(self) -> None:
        """Removes every hook (the first reduced call made them unneeded)."""
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()
