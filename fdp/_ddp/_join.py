"""``DistributedDataParallel.join``: training on ranks with different numbers of batches.

A rank that runs out of data leaves its loop while the others still call
``ddp(params)`` and backward, whose collectives would then wait for it until
the timeout. Inside ``join`` every call of ``ddp(params)`` first all-reduces
a small vector: one flag per rank (1 while it trains) and whether the step
reduces gradients (not under ``no_sync``, grad enabled). A rank that leaves
the block keeps answering that all-reduce with zeros and mirrors each step
of the others (torch's ``Join`` semantics): the buffers' broadcast (from the
highest rank still training, as torch's), one all-reduce of zeros per bucket,
and the all-reduce of usage counts. When every flag is 0, all ranks have left
and the block ends everywhere.

A comm hook is mirrored by running it on zeros (``fdp/_ddp/_join_hooks.py``).
The usage counts have a slot per bucketed leaf, whichever leaves the
training ranks' calls reduce. fdp's other collective calls inside the
block take part in the flags exchange first (:meth:`Joiner.announce`).
``fdp.sync_batch_norm`` is not mirrored: its collectives (one per layer in
forward, one in backward, interleaved with the buckets' all-reduces) are
known only to the model. Instead, while some rank has
left, it runs among the ranks still training, in a group made for them
when the flags change (``dist.new_group``, which every process calls, so
this needs ``ddp``'s group to hold every process; with one rank left it
communicates nothing). Statistics over the ranks still training are what
zeros from the others would give.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from fdp import _bucket, _compat
from fdp._comm import _groups
from fdp._comm._training import ALONE, TRAINING, Group, Training, joining, unmirrored
from fdp._ddp import _join_hooks
from fdp._ddp._buffers import Buffers
from fdp._ddp._join_hooks import HookPlan
from fdp._ddp._sparse import empty_sparse, reduce_sparse

UNDER_TRANSFORM = (
    "fdp.DistributedDataParallel.join: ddp(params) under a torch.func transform (or on "
    "forward-mode dual tensors) inside a join block, on some rank; a rank that has left "
    "cannot mirror the transform's reduction, so every rank raises. Inside join, call "
    "ddp(params) on plain tensors and use loss.backward() or torch.autograd.grad"
)


def weak(leaves: Sequence[Any]) -> list[weakref.ref[torch.Tensor] | None]:
    """Weak references to the tensors among ``leaves`` (under functorch's wrappers)."""
    return [
        weakref.ref(_compat.unwrap_functorch(t)) if isinstance(t, torch.Tensor) else None
        for t in leaves
    ]


@dataclasses.dataclass(frozen=True)
class JoinPlan:
    """What a DDP fixes at construction for its ``join`` blocks.

    ``buffers``: the buffer broadcast to mirror (None without
    ``broadcast_buffers``); ``final``: every tensor leaf, for the final
    synchronisation; ``meta``: each leaf's (shape, dtype, device), None for
    non-tensors; ``order``: the bucketed leaves in the order of their usage
    slots (Note [usage rides the last bucket]); ``paths``: each leaf's path.
    """

    group: ProcessGroup | None
    buckets: tuple[_bucket.Bucket, ...]
    buffers: Buffers | None
    final: Buffers
    meta: tuple[tuple[torch.Size, torch.dtype, torch.device] | None, ...]
    order: tuple[int, ...]
    paths: tuple[str, ...]


class Joiner:
    """One ``join`` block's state: this rank's flag vector and how to mirror a step."""

    def __init__(
        self,
        plan: JoinPlan,
        refs: list[weakref.ref[torch.Tensor] | None],
        *,
        divide_by_initial_world_size: bool,
        usage_tail: int = 0,
        hooks: HookPlan | None = None,
    ) -> None:
        group = plan.group
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.buckets, self.plan = list(plan.buckets), plan
        self.usage_tail, self.hooks = usage_tail, hooks or HookPlan()
        self.buffers = plan.buffers
        self.by_initial = divide_by_initial_world_size
        self.training = Training(group, tuple(range(self.world)), group)
        self.made: list[ProcessGroup] = []
        self.final, self.meta, self.refs = plan.final, list(plan.meta), refs
        self.last = self.training.ranks  # the last ranks seen training

    def remember(self, leaves: Sequence[Any]) -> None:
        """The tensors of this rank's latest ``ddp(params)``, for the final synchronisation."""
        self.refs = weak(leaves)

    @contextmanager
    def active(self) -> Iterator[None]:
        """The block: ``fdp.sync_batch_norm`` inside it runs among the ranks still training."""
        token = TRAINING.set(self.training)
        try:
            with joining(self.group, self.announce):
                yield
        finally:
            TRAINING.reset(token)
            for pg in self.made:
                dist.destroy_process_group(pg)

    def _regroup(self, ranks: tuple[int, ...]) -> None:
        """Every process's call when the ranks still training change (new_group is collective)."""
        sub: Group = None
        if len(ranks) == self.world:
            sub = self.group
        elif len(ranks) == 1:
            sub = ALONE
        elif self.world == dist.get_world_size():
            members = [_groups.global_rank(self.group, r) for r in ranks]
            made = dist.new_group(members, timeout=_compat.group_timeout(self.group))
            if self.rank in ranks:
                self.made.append(made)
                sub = made
        self.training.ranks, self.training.sub = ranks, sub

    def _exchange(
        self,
        *,
        training: bool,
        synchronised: bool,
        refused: bool = False,
        broadcast: bool = False,
        call: str | None = None,
    ) -> tuple[int, int, tuple[bool, bool]]:
        """(ranks still training, the last of them, (whether it reduces, broadcasts buffers)).

        The refusal flag says a training rank refuses its step: then every
        rank raises the same error, the ranks that have left too, instead of
        waiting for collectives that will not come. ``call``: a collective a
        training rank is about to make (:meth:`announce`).
        """
        flags = torch.zeros(self.world + 4)
        if training:
            flags[self.rank] = 1.0
            flags[self.world] = 1.0 if synchronised else 0.0
            flags[self.world + 1] = 1.0 if refused else 0.0
            flags[self.world + 2] = 1.0 if broadcast else 0.0
            flags[self.world + 3] = 0.0 if call is None else 1.0
        with _compat.functorch_disabled():  # plain flags, also under a torch.func transform
            dist.all_reduce(flags, group=self.group)
        if flags[self.world + 1] > 0:
            raise NotImplementedError(UNDER_TRANSFORM)
        announced = int(flags[self.world + 3])
        if announced not in (0, self.world):
            what = call or "fdp.DistributedDataParallel.join"
            raise RuntimeError(unmirrored(what, "DistributedDataParallel", announced, self.world))
        active = tuple(int(r) for r in flags[: self.world].nonzero())
        if active and active != self.training.ranks:
            self._regroup(active)
        if active:
            self.last = active
        last = active[-1] if active else 0
        return len(active), last, (bool(flags[self.world] > 0), bool(flags[self.world + 2] > 0))

    def announce(self, call: str) -> None:
        """A training rank's collective ``call`` (not ddp's): every rank makes it, or all raise."""
        self._exchange(training=True, synchronised=False, call=call)

    def step(
        self, leaves: Sequence[Any], *, synchronised: bool, refused: bool, broadcast: bool
    ) -> tuple[int, float | None, bool]:
        """A training rank's call: (the buffers' source, the gradient scale or None, broadcast?).

        The source is the highest rank still training, as torch's DDP picks
        it inside ``Join`` (``_find_common_rank``).
        """
        self.remember(leaves)
        active, last, flags = self._exchange(
            training=True, synchronised=synchronised, refused=refused, broadcast=broadcast
        )
        return last, None if self.by_initial else 1.0 / active, flags[1]

    def mirror(self) -> None:
        """Mirrors the steps of the ranks still training until every rank has left."""
        with torch.no_grad():
            while True:
                active, last, (reduces, broadcast) = self._exchange(
                    training=False, synchronised=False
                )
                if active == 0:
                    self._sync_final()
                    return
                if self.buffers is not None and broadcast:
                    self.buffers.mirror(src=last)
                if reduces:
                    *counts, late = self._mirror_reduction()
                    if late > 0:  # the training ranks reduce them, bucket by bucket
                        for bucket in self.buckets:
                            dist.all_reduce(torch.zeros_like(bucket.empty()), group=self.group)
                    self._mirror_sparse(counts)

    def _mirror_reduction(self) -> list[float]:
        """Zeros for each bucket and the usage counts: the summed counts (a slot per
        bucketed leaf, in ``plan.order``), then whether any rank has late gradients."""
        if self.hooks.hook is not None:
            return _join_hooks.mirror(self.hooks, self.buckets, self._usage, self._params)
        last = len(self.buckets) - 1
        for k, bucket in enumerate(self.buckets):
            tail = self.usage_tail if k == last else 0
            flat = bucket.empty(tail).zero_()
            dist.all_reduce(flat, group=self.group)
        if self.usage_tail:  # Note [usage rides the last bucket] (fdp/_ddp/_reduction.py)
            return list(flat[self.buckets[-1].numel :].tolist())
        usage = self._usage()
        usage.work.wait()
        return list(usage.summed.tolist())

    def _usage(self) -> _join_hooks.Usage:
        """The usage all-reduce of counts of their own (zeros, a slot per leaf), started."""
        usage = torch.zeros(len(self.plan.order) + 1, device=self.buckets[0].device)
        return _join_hooks.Usage(usage, dist.all_reduce(usage, group=self.group, async_op=True))

    def _params(self, bucket: _bucket.Bucket) -> list[torch.Tensor]:
        """A bucket's leaves for a comm hook's ``bucket.parameters()``: this rank's latest."""
        out = []
        for i in bucket.indices:
            ref, meta = self.refs[i], self.meta[i]
            t = None if ref is None else ref()
            if t is None and meta is not None:
                t = torch.zeros(meta[0], dtype=meta[1], device=meta[2])
            if t is not None:
                out.append(t)
        return out

    def _mirror_sparse(self, counts: list[float]) -> None:
        """Takes part, with nothing, in the reduction of each sparse gradient (in order)."""
        sparse = [i for i, c in zip(self.plan.order, counts, strict=True) if c >= self.world + 1]
        for n, i in enumerate(sparse):  # a sparse user counts world + 1
            meta = self.meta[i]
            if meta is None:
                raise RuntimeError("fdp internal error: a sparse gradient for a non-tensor leaf")
            shape, dtype, device = meta
            if self.hooks.hook is None:
                dist.all_reduce(empty_sparse(shape, dtype, device), group=self.group)
                continue
            # As the training ranks: the hook's bucket of its own, after the dense ones.
            k, last = len(self.buckets) + n, i == sparse[-1]
            bucket = (self.hooks.state, k, last, self.plan.paths[i])
            placeholder = torch.zeros(shape, dtype=dtype, device=device)
            reduce_sparse(placeholder, None, 1.0, self.group, hook=self.hooks.hook, bucket=bucket)

    def _sync_final(self) -> None:
        """Every rank takes the tensors of the last rank to leave (torch's final model sync).

        A rank that left early skipped the optimizer steps of the others, so
        its parameters are stale; torch's DDP join ends the same way. The
        tensors are those of each rank's latest ``ddp(params)`` (or of the
        tree given at construction), held weakly: if the last rank's are
        gone (new tensors every step), nothing is synchronised.
        """
        src = max(self.last)
        targets: list[Any] = [None if ref is None else ref() for ref in self.refs]
        held = torch.tensor([float(all(targets[i] is not None for i in self.final.indices))])
        global_src = _groups.global_rank(self.group, src)
        dist.broadcast(held, src=global_src, group=self.group)
        if not held.item():
            return
        for i in self.final.indices:
            meta = self.meta[i]
            if targets[i] is None and meta is not None:  # received, then dropped
                targets[i] = torch.empty(meta[0], dtype=meta[1], device=meta[2])
        self.final.sync(targets, src=src)
