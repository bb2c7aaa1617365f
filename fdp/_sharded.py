"""Trees of shards (each rank's pieces of several leaves) and of each rank's own gradients.

Such a tree looks like any other, yet each rank holds other elements, so a
call that reads a tree whole, or takes it to be the same on every rank,
would be wrong without a word. Every holder of such trees
(``FullyShardedDataParallel``) registers itself here, weakly (nothing is
kept alive), and those calls ask :func:`owner`: ``param_groups``' labels
and whole-leaf optimizers refuse shards, ``GradScaler.unscale`` takes every
rank's answer for their gradients and ``clip_by_global_norm`` their norm
over every rank's, and ``broadcast_params`` and ``all_reduce_grads`` over
the shards' own group refuse them.

A step that takes each rank's local gradients (``ZeroRedundancy``)
registers the structure of its parameters (:func:`register_local`):
``GradScaler.unscale`` takes every rank's answer for such a tree, since
one rank may overflow alone and the step is collective.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, TypeVar

import torch
import torch.distributed as dist

from fdp import _mode, _tree

T = TypeVar("T")


class Sharded(Protocol):
    """What holds trees whose leaves are pieces of several parameters."""

    group: Any  # the process group the shards are split over (None: the world)

    def holds_shards(self, tree: Any, *, none_ok: bool = False) -> bool: ...

    def clip_grad_norm(
        self, grads: Any, max_norm: float | torch.Tensor, *, norm_type: float = 2.0
    ) -> tuple[Any, torch.Tensor]: ...


_OWNERS: weakref.WeakSet[Sharded] = weakref.WeakSet()
# A holder made in one thread while another asks: weak containers are not
# safe to change while another thread iterates them. (Dynamo cannot enter a
# lock, and a trace is read on one thread: there the containers are read as
# they are.)
_LOCK = threading.Lock()


def _snapshot_traced(items: Callable[[], list[T]]) -> list[T]:
    return items()


@_mode.traced_as(_snapshot_traced)
def _snapshot(items: Callable[[], list[T]]) -> list[T]:
    with _LOCK:
        return items()


def register(holder: Sharded) -> None:
    """Makes :func:`owner` recognise ``holder``'s shards (and their gradients)."""
    with _LOCK:
        _OWNERS.add(holder)


def owner(tree: Any, *, none_ok: bool = False) -> Sharded | None:
    """The registered holder whose shards' format ``tree`` has, if any (``none_ok``: gradients)."""
    for holder in _snapshot(lambda: list(_OWNERS)):
        if holder.holds_shards(tree, none_ok=none_ok):
            return holder
    return None


def refuse_over_own_group(
    call: str, arg: str, tree: Any, group: Any, *, what: str = "shards", why: str
) -> None:
    """Raises if ``tree`` is a holder's shards and ``group`` spans two ranks of theirs.

    Across ranks of the shards' group each holds other elements; over a
    group that meets it in one rank at most (the replicas of a hybrid
    layout) each rank holds the same ones, and the call means what it says.
    """
    holder = owner(tree, none_ok=True)
    if holder is None or not dist.is_initialized():
        return
    if len(_ranks(group) & _ranks(holder.group)) > 1:
        raise ValueError(
            f"{call}: `{arg}` are the {what} of {holder!r}: each rank holds other elements "
            f"of the parameters, {why}"
        )


def _ranks(group: Any) -> set[int]:
    return set(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


class LocalSteps(Protocol):
    """A step that takes each rank's local gradients and runs collectives every call."""

    def _in_lockstep(self) -> bool:
        """Whether every rank calls the step now (not inside a join, where some left)."""
        ...


class _Local(NamedTuple):
    planned: _tree.Planned  # the parameters the step was planned for
    group: Any


_LOCAL: weakref.WeakKeyDictionary[LocalSteps, _Local] = weakref.WeakKeyDictionary()


def register_local(holder: LocalSteps, planned: _tree.Planned, group: Any) -> None:
    """Makes :func:`local_group` know gradients of ``planned``'s tree while ``holder`` lives."""
    with _LOCK:
        _LOCAL[holder] = _Local(planned, group)


def local_group(tree: Any) -> tuple[bool, Any]:
    """Whether ``tree`` has the structure of a registered step's local gradients, and its group.

    Eagerly only (while dynamo traces, ``(False, None)``): a leaf may be
    ``None`` where the parameter is a tensor. Not inside the step's join: a
    rank that left would not join the sync.
    """
    flat = _tree.flatten_optree(tree) if _LOCAL else None
    if flat is None:
        return False, None
    leaves, spec = flat
    for holder, local in _snapshot(lambda: list(_LOCAL.items())):
        if (
            spec == local.planned.spec
            and holder._in_lockstep()
            and all(  # a parameter's kind: ("tensor", shape, dtype, device)
                g is None or (isinstance(g, torch.Tensor) and kind[:2] == ("tensor", g.shape))
                for g, kind in zip(leaves, local.planned.kinds, strict=True)
            )
        ):
            return True, local.group
    return False, None
