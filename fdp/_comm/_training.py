"""The ranks still training inside ``DistributedDataParallel.join``, for collectives that ask.

``join`` (``fdp/_ddp/_join.py``) sets the context variable for its block;
``fdp.sync_batch_norm`` reads it to run among the ranks still training.
fdp's other collective calls (the public collectives, the tree
collectives, checkpoints, making a DDP, ZeRO or FSDP) announce themselves
to every open join block, DDP's or ZeRO's (:func:`before_collective`): the
ranks that left mirror the block's own collectives only, so such a call
made after some rank left, or by some ranks while others take a step,
raises on every rank instead of pairing with a collective of another
kind. A module of its own so that the batch-norm layer, which
``make_functional`` uses in a single process too, needs nothing of DDP.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator

import torch.distributed as dist
from torch.distributed import ProcessGroup

from fdp import _mode
from fdp._comm import _groups


class Alone:
    """The group of this rank alone: a collective over it is the identity."""


ALONE = Alone()
Group = ProcessGroup | None | Alone


@dataclasses.dataclass
class Training:
    """The ranks of ``group`` still training, and a process group of them (None: none made)."""

    group: ProcessGroup | None
    ranks: tuple[int, ...]
    sub: Group


TRAINING: contextvars.ContextVar[Training | None] = contextvars.ContextVar(
    "fdp_join_training", default=None
)


def _training_group_traced(group: ProcessGroup | None) -> Group:
    return group  # join is eager; dynamo cannot read a ContextVar


@_mode.traced_as(_training_group_traced)
def training_group(group: ProcessGroup | None) -> Group:
    """The group ``fdp.sync_batch_norm`` over ``group`` runs in: the ranks still training."""
    training = TRAINING.get()
    if training is None:
        return group
    if len(training.ranks) == dist.get_world_size(training.group):
        return group
    if not _groups.same(group, training.group):
        raise NotImplementedError(
            "fdp.sync_batch_norm: inside DistributedDataParallel.join, after a rank has left, "
            "`group` must be ddp's group (the one the ranks still training are taken from); "
            f"got {group}, expected {training.group}"
        )
    if training.sub is None:
        raise NotImplementedError(
            "fdp.sync_batch_norm: inside DistributedDataParallel.join, after a rank has left, "
            "the ranks still training need a group of their own, which fdp makes only when "
            "ddp's group holds every process; got a smaller group"
        )
    return training.sub


@dataclasses.dataclass(frozen=True)
class Join:
    """An open ``join`` block over ``group``: how a training rank's collective call announces
    itself there (it returns where every rank makes the call, else raises on every rank)."""

    group: ProcessGroup | None
    announce: Callable[[str], None]


JOINS: contextvars.ContextVar[tuple[Join, ...]] = contextvars.ContextVar("fdp_joins", default=())


@contextlib.contextmanager
def joining(group: ProcessGroup | None, announce: Callable[[str], None]) -> Iterator[None]:
    """A join block (DDP's, ZeRO's): fdp's collective calls inside announce themselves."""
    token = JOINS.set((*JOINS.get(), Join(group, announce)))
    try:
        yield
    finally:
        JOINS.reset(token)


def unmirrored(call: str, owner: str, announced: int, world: int) -> str:
    """The error of a collective call that ``announced`` of ``world`` ranks made in a join."""
    return (
        f"{call}: a collective inside {owner}.join that not every rank makes at the same "
        f"point ({announced} of the {world} ranks made it; the others had left or took a "
        "step; an fdp collective, checkpoint or construction announces itself): the ranks "
        "that left mirror the block's own collectives only, so every rank raises. Make it "
        "after the join block, or at a point every rank reaches before any runs out of data"
    )


def _before_collective_traced(call: str, group: ProcessGroup | None) -> None:
    return None  # join is eager; dynamo cannot read a ContextVar


@_mode.traced_as(_before_collective_traced)
def before_collective(call: str, group: ProcessGroup | None) -> None:
    """Inside a ``join`` block on a group that meets ``group``: every rank there agrees first.

    The call takes part in the join's exchange of flags, where every rank
    either announces the same call or raises (a rank left, or took a step).
    """
    for join in JOINS.get():
        if _meets(group, join.group):
            join.announce(call)


def _meets(a: ProcessGroup | None, b: ProcessGroup | None) -> bool:
    """Whether the groups share a rank besides this one."""
    if _groups.same(a, b):
        return dist.get_world_size(a) > 1
    ours = set(dist.get_process_group_ranks(_groups.resolve(a)))
    theirs = set(dist.get_process_group_ranks(_groups.resolve(b)))
    return bool((ours & theirs) - {dist.get_rank()})
