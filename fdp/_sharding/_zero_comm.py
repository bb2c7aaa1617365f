"""The collectives of a ``ZeroRedundancy`` step, eager and traced.

A step hands each bucket's packed gradients to :meth:`reduce`, takes this
rank's averaged slice from :meth:`reduced`, hands the updated slice to
:meth:`gather`, and finally reads the whole bucket from :meth:`gathered`.

Eagerly, which collectives depends on the backend. With NCCL (and any
backend but gloo): stage 2 reduce-scatters the packed buffer in place (this
rank's part of it receives the reduced slice), stage 1 all-reduces it in
place, and the new slices are all-gathered. gloo's reduce-scatter and
all-gather are slower on CPU tensors than its all-reduce and broadcasts
(docs/performance.md, "Measurements behind design choices"), so on gloo
both stages all-reduce in place (the same memory) and each rank's new slice
is broadcast by its owner. Flat buffers are reused from step to step once
nothing else views them: a fresh buffer costs page faults.

Traced (``torch.compile``), the functional reduce-scatter (stage 1:
all-reduce) and all-gather of :mod:`fdp._comm._raw`, whatever the backend.

With a :class:`Wire` (``reduce_dtype``, ``sum_dtype``), a bucket wider than
``reduce_dtype`` is reduce-scattered in it, at both stages and on every
backend, eagerly and traced; with ``sum_dtype``, each rank's chunk travels in
``reduce_dtype`` and is added in ``sum_dtype`` where it lands."""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from fdp import _compat
from fdp._comm import _differentiable, _groups, _raw


class Pool:
    """Flat buffers kept by a ``ZeroRedundancy``, lent out while nobody else holds them."""

    def __init__(self) -> None:
        self._kept: dict[tuple[Any, ...], list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def take(self, key: tuple[Any, ...], numel: int, like: torch.Tensor) -> torch.Tensor:
        """A buffer of ``numel`` elements of ``like``'s dtype and device, unused elsewhere."""
        with self._lock:
            kept = self._kept.setdefault(key, [])
            for buf in kept:
                if _compat.storage_users(buf) == 1:  # only this pool holds it
                    return buf.view(-1)
            buf = like.new_empty(numel)
            if len(kept) < 3:  # a step's buffer, the caller's last result, one spare
                kept.append(buf)
            return buf.view(-1)

    def clear(self) -> None:
        with self._lock:
            self._kept.clear()


class Wire(NamedTuple):
    """What a bucket's reduction carries (``reduce``) and adds in (``sum``; None: on the wire)."""

    reduce: torch.dtype
    sum: torch.dtype | None

    def applies(self, dtype: torch.dtype) -> bool:
        """Whether a bucket of ``dtype`` narrows to the wire (complex and narrow ones do not)."""
        return dtype.is_floating_point and dtype.itemsize > self.reduce.itemsize

    def reduce_scatter(self, flat: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        """This rank's part of the sum of ``flat`` over ``group``, in ``flat``'s dtype."""
        if self.sum is not None:
            shard = _raw.reduce_scatter_wide(flat.to(self.sum), wire=self.reduce, group=group)
        else:
            shard = _raw.reduce_scatter(flat.to(self.reduce), group=group)
        return shard.to(flat.dtype)


class Pending(NamedTuple):
    """A collective in flight: the flat buffer it writes and the works to wait for."""

    buffer: torch.Tensor
    works: list[Any]


class Eager:
    """``torch.distributed``'s asynchronous collectives; see the module docstring."""

    traced = False

    def __init__(
        self,
        group: ProcessGroup | None,
        stage: int,
        rank: int,
        world: int,
        pool: Pool,
        wire: Wire | None = None,
    ) -> None:
        self.group, self.stage, self.rank, self.world, self.pool = group, stage, rank, world, pool
        self.gloo = is_gloo(group)
        self.wire = wire

    def reduce(self, k: int, pieces: list[torch.Tensor]) -> Pending:
        total = sum(p.numel() for p in pieces)
        flat = torch.cat(pieces, out=self.pool.take(("grads", k), total, pieces[0]))
        if self.wire is not None and self.wire.applies(flat.dtype):
            size = total // self.world  # this rank's part of the buffer receives its slice
            flat[self.rank * size : (self.rank + 1) * size] = self.wire.reduce_scatter(
                flat, self.group
            )
            return Pending(flat, [])
        if self.stage == 1 or self.gloo:
            return Pending(flat, [dist.all_reduce(flat, group=self.group, async_op=True)])
        # In place: this rank's part of the packed buffer receives its reduced slice.
        size = total // self.world
        mine = flat[self.rank * size : (self.rank + 1) * size]
        return Pending(flat, [_compat.reduce_scatter_single(mine, flat, self.group)])

    def reduced(self, started: Pending) -> torch.Tensor:
        flat = started.buffer
        for work in started.works:
            work.wait()
        size = flat.numel() // self.world
        return flat[self.rank * size : (self.rank + 1) * size].div_(self.world)

    def gather(self, k: int, pieces: list[torch.Tensor]) -> Pending:
        size = sum(p.numel() for p in pieces)
        full = self.pool.take(("params", k), size * self.world, pieces[0])
        torch.cat(pieces, out=full[self.rank * size : (self.rank + 1) * size])
        if not self.gloo:
            mine = full[self.rank * size : (self.rank + 1) * size]
            return Pending(full, [_compat.all_gather_single(full, mine, self.group)])
        works = [
            dist.broadcast(
                full[q * size : (q + 1) * size],
                src=_groups.global_rank(self.group, q),
                group=self.group,
                async_op=True,
            )
            for q in range(self.world)
        ]
        return Pending(full, works)

    def gathered(self, started: Pending) -> torch.Tensor:
        for work in started.works:
            work.wait()
        return started.buffer

    def total(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of ``t`` over the group."""
        dist.all_reduce(t, group=self.group)
        return t


def is_gloo(group: ProcessGroup | None) -> bool:
    """Whether ``group`` runs on gloo (the tests patch this to run the NCCL path on gloo)."""
    return dist.get_backend(group) == "gloo"


class Traced:
    """Functional collectives (:mod:`fdp._comm._raw`), for ``torch.compile``."""

    traced = True

    def __init__(
        self,
        group: ProcessGroup | None,
        stage: int,
        rank: int,
        world: int,
        wire: Wire | None = None,
    ) -> None:
        self.group, self.stage, self.rank, self.world = group, stage, rank, world
        self.wire = wire

    def reduce(self, k: int, pieces: list[torch.Tensor]) -> Any:
        """The reduced bucket, and whether it is this rank's slice already."""
        flat = torch.cat(pieces)
        if self.wire is not None and self.wire.applies(flat.dtype):
            return self.wire.reduce_scatter(flat, self.group), True
        if self.stage == 1:
            return _raw.all_reduce(flat, group=self.group), False
        return _raw.reduce_scatter(flat, group=self.group), True

    def reduced(self, started: Any) -> torch.Tensor:
        flat: torch.Tensor
        flat, sliced = started
        if not sliced:
            size = flat.numel() // self.world
            flat = flat[self.rank * size : (self.rank + 1) * size]
        return flat / self.world

    def gather(self, k: int, pieces: list[torch.Tensor]) -> Any:
        return _raw.all_gather(torch.cat(pieces), group=self.group)

    def gathered(self, started: Any) -> torch.Tensor:
        full: torch.Tensor = started
        return full

    def total(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of ``t`` over the group."""
        return _raw.all_reduce(t, group=self.group)


class Differentiable:
    """Collectives that carry derivatives (:mod:`fdp._comm._differentiable`), for autograd.

    A reduce-scatter of each bucket and an all-gather of the new slices,
    the flat pair whose derivatives are each other: every derivative of the
    step is again a collective.
    """

    traced = False

    def __init__(
        self, group: ProcessGroup | None, rank: int, world: int, wire: Wire | None = None
    ) -> None:
        self.group, self.rank, self.world = group, rank, world
        self.policy = _differentiable.Policy(group, world)  # in the tensors' own dtypes
        self.wire = wire

    def reduce(self, k: int, pieces: list[torch.Tensor]) -> Any:
        flat = torch.cat(pieces)
        policy = self.policy
        if self.wire is not None and self.wire.applies(flat.dtype):
            policy = policy._replace(
                reduce_dtype=self.wire.reduce, sum_dtype=self.wire.sum, grad_dtype=flat.dtype
            )
        return _differentiable.reduce_scatter_flat(flat, policy)

    def reduced(self, started: Any) -> torch.Tensor:
        mine: torch.Tensor = started
        return mine / self.world

    def gather(self, k: int, pieces: list[torch.Tensor]) -> Any:
        mine = torch.cat(pieces)
        return _differentiable.all_gather_flat(mine, self.policy)

    def gathered(self, started: Any) -> torch.Tensor:
        full: torch.Tensor = started
        return full

    def total(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of ``t`` over the group, differentiably."""
        return _differentiable.psum(t, group=self.group)
