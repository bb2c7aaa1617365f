"""Resharding after forward: a gathered unit's memory is freed until its backward needs it.

After ``FullyShardedDataParallel.apply`` has run a unit's function, what
autograd saved for backward still views the unit's gathered flat buffers.
As FSDP2 does, the buffers' storage is resized to nothing; when backward
first reaches the unit's outputs (a hook on all of them, ``mode="any"``),
the storage is resized back and the shards are all-gathered into it again,
so every saved view sees the parameters again; once backward has passed
the unit (the gradient of the flat buffer exists), the storage is freed
again, even before that: once every leaf's gradient exists, so that the
parameters and the flat gradient assembled from the leaves' are never held
at once. The refill writes through a second tensor over the same storage,
so the saved views' version counters do not move (autograd would refuse
them otherwise). With prefetching, backward reaching a unit's outputs also
starts the asynchronous refill of the unit applied before it, which
backward reaches next, so that its all-gather overlaps this unit's
backward. As with torch's ``fully_shard``, a rank then holds two units'
parameters during a unit's backward and one (the next) during its
reduce-scatter.

Every rank runs the same backward, so the re-gathers pair up across ranks
in the same order. This needs eager autograd: under a ``torch.func``
transform or while compiling, units stay gathered until backward (the
caller checks :func:`eligible`).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

from fdp import _compat, _mode, _tree
from fdp._sharding import _fsdp_gather


def _eligible_traced(outputs: Sequence[torch.Tensor]) -> bool:
    """Never while dynamo traces: resharding frees storage behind autograd's back."""
    return False


@_mode.traced_as(_eligible_traced)
def eligible(outputs: Sequence[torch.Tensor]) -> bool:
    """Whether resharding can run: autograd outside any transform, and a backward to come."""
    return torch.is_grad_enabled() and not _mode.transform_running() and len(outputs) > 0


# One gathered flat buffer: the buffer, its shard, how it travels, the leaves viewing it.
Gathered = tuple[torch.Tensor, torch.Tensor, _fsdp_gather.Policy, Sequence[torch.Tensor]]


class Resharded:
    """One gathered flat buffer: freed now, refilled for backward, freed after it."""

    def __init__(
        self,
        flat: torch.Tensor,
        shard: torch.Tensor,
        how: _fsdp_gather.Policy,
        leaves: Sequence[torch.Tensor] = (),
    ) -> None:
        self.storage = flat.untyped_storage()
        self.nbytes = self.storage.nbytes()
        self.numel, self.dtype, self.device = flat.numel(), flat.dtype, flat.device
        self.shard, self.how = shard.detach(), how
        self.work: Any = None  # a refill under way
        flat.register_hook(self._after_backward)  # type: ignore[no-untyped-call]
        # Note [freed after the gradients]: freed once every leaf's gradient exists, before autograd
        # assembles the flat buffer's gradient from them, so the parameters
        # and that gradient are never held at once (torch's fully_shard too
        # reshards before it copies its reduce-scatter's input). Every op
        # that saved a leaf has run its backward by then: the leaves' views
        # were made before the unit's function, and the engine runs nodes
        # from the last made. The hook on ``flat`` frees where no leaf's
        # gradient is computed (an unused unit's zeros).
        needed = tuple(t for t in leaves if t.requires_grad)
        if needed:
            torch.autograd.graph.register_multi_grad_hook(needed, self._after_leaves, mode="all")
        self.free()

    def free(self) -> None:
        self.storage.resize_(0)

    def start(self) -> None:
        """Starts refilling, asynchronously (a no-op if gathered or under way)."""
        if self.work is not None or self.storage.nbytes() == self.nbytes:
            return
        self.storage.resize_(self.nbytes)
        alias = torch.empty(0, dtype=self.dtype, device=self.device)
        alias.set_(self.storage, 0, (self.numel,), (1,))
        _, self.work = _fsdp_gather.start(self.shard, self.how, out=alias)

    def refill(self) -> None:
        self.start()
        self.wait()

    def wait(self) -> None:
        if self.work is not None:
            work, self.work = self.work, None
            with _fsdp_gather.in_step("the all-gather of a unit for backward"):
                work.wait()

    def settle(self) -> None:
        """At the end of a backward: nothing under way, nothing held."""
        self.wait()
        self.free()

    def _after_backward(self, grad: torch.Tensor) -> None:
        self.free()

    def _after_leaves(self, grads: Sequence[torch.Tensor | None]) -> None:
        self.free()


class Held:
    """A unit's buffers resharded by one ``apply``, and the unit applied before it.

    ``previous`` is weak: a unit whose graph is gone is not refilled.
    """

    def __init__(self, buffers: Sequence[Resharded], previous: Held | None) -> None:
        self.buffers = list(buffers)
        self.previous = None if previous is None else weakref.ref(previous)
        self.refilled = False
        self.ahead: list[Resharded] = []  # the unit before, prefetched in this backward

    def refill(self, *, ahead: bool = True) -> None:
        """Refills this unit once per backward, and with ``ahead`` starts the unit's before.

        The chain refills the unit before its own reduce-scatter on every
        rank (``ahead=False``); the outputs' hook, when backward reaches the
        unit's function, also prefetches the one before (its all-gather
        overlaps this unit's backward). Prefetching from the chain would
        hold a third unit during the reduce-scatter.
        """
        if not self.refilled:
            self.refilled = True
            with _compat.label("fdp::fsdp.refill"):  # a profiler trace shows it
                for buffer in self.buffers:
                    buffer.refill()
            _compat.queue_backward_callback(self._settled)
        before = None if self.previous is None else self.previous()
        if ahead and not self.ahead and before is not None:
            self.ahead = before.buffers
            for buffer in self.ahead:
                buffer.start()  # prefetched: backward reaches that unit next

    def _settled(self) -> None:
        """At the end of a backward. A unit whose flat gradient it never computes (grads
        w.r.t. inputs only), or a prefetched one it never reaches, would otherwise stay
        gathered until its graph dies."""
        for buffer in [*self.buffers, *self.ahead]:
            buffer.settle()
        self.refilled, self.ahead = False, []  # a later backward (retain_graph) refills again


def check_not_returned(
    call: str,
    unit: str,
    out: Any,
    flat_out: Sequence[Any],
    gathered: Sequence[Gathered],
) -> None:
    """Refuses an ``apply`` whose function returned gathered memory, which is about to be freed.

    Used later, such a tensor would fail in some torch op with "data is not
    allocated yet", far from the cause.
    """
    held = {flat.untyped_storage().data_ptr() for flat, *_ in gathered}
    for i, t in enumerate(flat_out):
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in held:
            raise ValueError(
                f"{call}: `fn` returned unit {unit!r}'s gathered parameters (output "
                f"{_tree.path(out, i, 'output')}, {_tree.describe(t)}); their memory is "
                "released when apply returns (reshard_after_forward=True). Return what is "
                "computed from them, or use fsdp.gather(shards, unit), or construct with "
                "reshard_after_forward=False, for parameters needed after apply"
            )


def reshard(held: Held, outputs: Sequence[torch.Tensor]) -> None:
    """Refills ``held`` when backward first reaches any of ``outputs``."""

    def refill(grads: Any) -> None:
        held.refill()

    torch.autograd.graph.register_multi_grad_hook(tuple(outputs), refill, mode="any")
