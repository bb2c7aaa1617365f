"""Process groups as fdp's calls take them: ``None`` means the default (world) group.

One place for what every distributed module needs of a group: its type,
the group ``None`` stands for, a group rank as a global rank (what
``src=``/``dst=`` and device-mesh placements take), and whether two
arguments name the same group.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

ProcessGroup = dist.ProcessGroup


def resolve(group: ProcessGroup | None) -> Any:
    """The group itself; ``None``: the default group (``dist.group.WORLD``)."""
    return dist.group.WORLD if group is None else group


def global_rank(group: ProcessGroup | None, rank: int) -> int:
    """Rank ``rank`` of ``group`` as a rank of the default group."""
    return rank if group is None else dist.get_global_rank(group, rank)


def same(a: ProcessGroup | None, b: ProcessGroup | None) -> bool:
    """Whether ``a`` and ``b`` are the same group (``None`` and the world are)."""
    return resolve(a) is resolve(b)
