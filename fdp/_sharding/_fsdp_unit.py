"""One fully sharded unit's runtime state, in one object (FSDP2's ``FSDPParamGroup`` idea).

A :class:`UnitState` holds what one ``FullyShardedDataParallel`` knows of
one unit while it runs, where the modules that act on it find it:

- its plan (:attr:`UnitState.unit`: buckets and shard sizes) and its dtype
  policy (``unit_dtypes`` applied), resolved per bucket by
  :meth:`UnitState.policy_for` (``fdp/_sharding/_fsdp_gather.py``);
- its gathered or resharded memory: the buffers its last ``apply`` freed
  (:attr:`UnitState.resharded`, weak: gone with their graph), from whose
  storage :attr:`UnitState.phase` reads whether the unit is held whole now
  (``fdp/_sharding/_fsdp_reshard.py``);
- the gradients ``no_sync`` kept for its gathered buffers
  (:attr:`UnitState.kept`, ``fdp/_sharding/_fsdp_accumulate.py``).

A gathered flat buffer is named by a :class:`Buffer` (the bucket, and the
unit it was gathered for when a tied tensor borrows it), never by a string:
the chain of units (``fdp/_sharding/_fsdp_chain.py``) and ``no_sync`` key
their records by it. The prefetcher (``fdp/_sharding/_fsdp_prefetch.py``)
takes states, not names and policies side by side.
"""

from __future__ import annotations

import enum
import weakref
from typing import Any, NamedTuple

import torch

from fdp._sharding import _fsdp_gather, _fsdp_plan


class Phase(enum.Enum):
    """Where a unit's gathered memory is."""

    SHARDED = "sharded"  # never resharded, or its buffers are gone: the shards only
    RESHARDED = "resharded"  # gathered for an apply, freed: a backward may gather it again
    REFILLED = "refilled"  # gathered again (or being gathered) for backward


class Buffer(NamedTuple):
    """One gathered flat buffer of a unit: bucket ``bucket``, gathered for ``borrower``.

    ``borrower``: the unit whose ``apply`` or ``gather`` needed this unit's
    tensors (tied weights), ``None`` when gathered for itself.
    """

    unit: str
    bucket: int
    borrower: str | None = None


class UnitState:
    """One unit's plan, policy, resharded memory and ``no_sync`` gradients (see the module doc).

    Example::

        state = fsdp._states["blocks.0"]
        state.phase  # Phase.SHARDED before the first apply
    """

    def __init__(self, unit: _fsdp_plan.Unit, policy: _fsdp_gather.Policy) -> None:
        self.unit, self.policy = unit, policy
        self.kept: dict[Buffer, torch.Tensor] = {}  # no_sync: the full gradient, reduce dtype
        self._resharded: weakref.ref[Any] | None = None  # an _fsdp_reshard.Held

    @property
    def name(self) -> str:
        return self.unit.name

    def policy_for(
        self, k: int, shard: torch.Tensor, *, exact: bool = False
    ) -> _fsdp_gather.Policy:
        """How bucket ``k``'s ``shard`` travels: every dtype set; ``exact``: the bucket's own."""
        return _fsdp_gather.for_bucket(self.policy, self.unit.buckets[k], shard, exact=exact)

    @property
    def resharded(self) -> Any:
        """The buffers the last ``apply`` resharded (an ``_fsdp_reshard.Held``), if alive."""
        return None if self._resharded is None else self._resharded()

    @resharded.setter
    def resharded(self, held: Any) -> None:
        self._resharded = weakref.ref(held)

    @property
    def phase(self) -> Phase:
        """Read from the resharded buffers' storage, so it cannot drift from them."""
        held = self.resharded
        if held is None:
            return Phase.SHARDED
        whole = any(b.work is not None or b.storage.nbytes() == b.nbytes for b in held.buffers)
        return Phase.REFILLED if whole else Phase.RESHARDED

    def kept_nbytes(self) -> int:
        """The bytes of the gradients ``no_sync`` keeps for this unit."""
        return sum(t.numel() * t.element_size() for t in self.kept.values())

    def __repr__(self) -> str:
        return f"UnitState({self.name!r}, {self.phase.value}, {len(self.kept)} kept)"
