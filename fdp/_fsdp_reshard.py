"""Resharding after forward: a gathered unit's memory is freed until its backward needs it.

After ``FullyShardedDataParallel.apply`` has run a unit's function, what
autograd saved for backward still views the unit's gathered flat buffers.
As FSDP2 does, the buffers' storage is resized to nothing; when backward
first reaches the unit's outputs (a hook on all of them, ``mode="any"``),
the storage is resized back and the shards are all-gathered into it again,
so every saved view sees the parameters again; once backward has passed
the unit (the gradient of the flat buffer exists), the storage is freed
again. The refill writes through a second tensor over the same storage,
so the saved views' version counters do not move (autograd would refuse
them otherwise).

Every rank runs the same backward, so the re-gathers pair up across ranks
in the same order. This needs eager autograd: under a ``torch.func``
transform or while compiling, units stay gathered until backward (the
caller checks :func:`eligible`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fdp import _compat, _fsdp_gather, _groups


def eligible(outputs: Sequence[torch.Tensor]) -> bool:
    """Whether resharding can run: eager autograd, and a backward to come."""
    return (
        torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
        and not _compat.functorch_active()
        and len(outputs) > 0
    )


class Resharded:
    """One gathered flat buffer: freed now, refilled for backward, freed after it."""

    def __init__(self, flat: torch.Tensor, shard: torch.Tensor, how: _fsdp_gather.How) -> None:
        self.storage = flat.untyped_storage()
        self.nbytes = self.storage.nbytes()
        self.numel, self.dtype, self.device = flat.numel(), flat.dtype, flat.device
        self.shard, self.how = shard.detach(), how
        flat.register_hook(self._after_backward)  # type: ignore[no-untyped-call]
        self.free()

    def free(self) -> None:
        self.storage.resize_(0)

    def refill(self) -> None:
        if self.storage.nbytes() == self.nbytes:
            return  # already gathered (a second hook of the same backward)
        self.storage.resize_(self.nbytes)
        alias = torch.empty(0, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            alias.set_(self.storage, 0, (self.numel,), (1,))
            alias.copy_(
                _groups.all_gather(self.shard.to(self.how.param_dtype), group=self.how.group)
            )

    def _after_backward(self, grad: torch.Tensor) -> None:
        self.free()


def reshard(held: Sequence[Resharded], outputs: Sequence[torch.Tensor]) -> None:
    """Refills ``held`` when backward first reaches any of ``outputs``."""

    def refill(grads: Any) -> None:
        for buffer in held:
            buffer.refill()

    torch.autograd.graph.register_multi_grad_hook(tuple(outputs), refill, mode="any")
