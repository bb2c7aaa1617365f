"""Every gathered unit's reduce-scatter on every rank, also where this rank leaves it unused.

A unit's gradient is reduce-scattered by the backward of its gather, which
the engine runs only if this rank's loss reaches the unit. A rank whose loss
ignores a unit (a branch it skips, an ``apply`` whose output it discards)
would skip that reduce-scatter while the others wait in it: a hang, or
collectives paired with the wrong partners and a wrong gradient.

Note [the chain of units]: why a chain. Each gathered unit passes through :class:`_Link`, which
also takes the token of the unit gathered before it in this pass and gives
a token of its own to the next. The backward of a unit's link therefore
reaches the link (and the gather) of the unit before it, whatever the loss
uses: a rank whose loss reaches the last unit gathered reaches them all, and
a unit it did not use gets a zero cotangent, so it reduce-scatters zeros as
torch's ``fully_shard`` does. The chain also fixes the order of the
reduce-scatters to the reverse of the gathers on every rank. A pass ends
when a unit is gathered again (the next step or micro-batch) or at
``fsdp(shards)``. Eager autograd and every ``torch.func`` transform; not
while compiling, where a rank must use every unit it gathers.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch

from fdp import _mode


class Entry:
    """One gathered flat buffer of this pass; ``held`` is set once its unit is resharded."""

    __slots__ = ("held",)

    def __init__(self) -> None:
        self.held: Any = None  # an _fsdp_reshard.Held


class _Link(torch.autograd.Function):
    """Identity on a unit's flat buffer; ties its backward to the next unit's (see above)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(
        flat: torch.Tensor, token: torch.Tensor, before: Entry | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return flat.view_as(flat), flat.new_zeros(0)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.before = inputs[2]

    @staticmethod
    def backward(
        ctx: Any, grad: torch.Tensor, _token: torch.Tensor
    ) -> tuple[torch.Tensor, None, None]:
        # Note [refilling the unit before]:
        # the unit gathered before this one is refilled here, at the
        # same point of every rank's backward, also on a rank whose loss
        # never reaches that unit's outputs: its all-gathers then pair with
        # those of the ranks that use it (see fdp/_sharding/_fsdp_reshard.py).
        before: Entry | None = ctx.before
        if before is not None and before.held is not None:
            before.held.refill(ahead=False)
        # An unused unit's cotangent comes materialised as zeros. The token's
        # stays undefined: the node before still runs (the edge is there),
        # and under vmap no batched empty tensor has to be made up.
        return grad, None, None

    @staticmethod
    def jvp(
        ctx: Any, tangent: torch.Tensor, _token: Any, _before: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return tangent.view_as(tangent), tangent.new_zeros(0)


class Chain:
    """The units gathered in this pass, and the token of the last one."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.seen: set[Hashable] = set()  # the gathered buffers of this pass
        self.token: torch.Tensor | None = None
        self.entries: list[Entry] = []

    def _link_traced(self, buffer: Hashable, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` as it is: a compiled graph holds no resharding to order."""
        return flat

    @_mode.traced_as(_link_traced)
    def link(self, buffer: Hashable, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` (``buffer``) tied into this pass's chain (as it is where nothing follows)."""
        if not (flat.requires_grad and torch.is_grad_enabled()):
            return flat
        if buffer in self.seen:  # gathered again: a new pass (step, micro-batch)
            self.reset()
        token = self.token if self.token is not None else flat.new_zeros(0)
        before = self.entries[-1] if self.entries else None
        self.entries.append(Entry())
        out, self.token = _Link.apply(flat, token, before)  # type: ignore[no-untyped-call]
        self.seen.add(buffer)
        linked: torch.Tensor = out
        return linked

    def mark(self) -> int:
        return len(self.entries)

    def attach(self, since: int, held: Any, *, until: int | None = None) -> None:
        """The entries linked since ``mark()`` (up to ``until``) belong to the unit ``held``
        reshards."""
        for entry in self.entries[since:until]:
            entry.held = held
