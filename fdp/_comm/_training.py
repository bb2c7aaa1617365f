"""The ranks still training inside ``DistributedDataParallel.join``, for collectives that ask.

``join`` (``fdp/_ddp/_join.py``) sets the context variable while some rank has
left; ``fdp.sync_batch_norm`` reads it to run among the ranks still
training. A module of its own so that the batch-norm layer, which
``make_functional`` uses in a single process too, needs nothing of DDP.
"""

from __future__ import annotations

import contextvars
import dataclasses

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
