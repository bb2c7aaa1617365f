"""Process groups as fdp's calls take them.

One place for what every distributed module needs of a group: the group
``None`` stands for (the default, world group), a group rank as a global
rank (what ``torch.distributed``'s ``src=``/``dst=`` take), and whether two
arguments name the same group. Modules that only annotate a group import
``torch.distributed.ProcessGroup`` itself; the collectives are
:mod:`fdp._comm._raw`'s (no derivatives) and
:mod:`fdp._comm._differentiable`'s (with every transform's rules).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.distributed import ProcessGroup


def resolve(group: ProcessGroup | None) -> Any:
    """The group itself; ``None``: the default group (``dist.group.WORLD``)."""
    return dist.group.WORLD if group is None else group


def global_rank(group: ProcessGroup | None, rank: int) -> int:
    """Rank ``rank`` of ``group`` as a rank of the default group."""
    return rank if group is None else dist.get_global_rank(group, rank)


def group_rank(group: ProcessGroup | None, rank: int) -> int:
    """Global rank ``rank`` as a rank of ``group`` (fdp's public ``src`` is global, as torch's)."""
    return rank if group is None else dist.get_group_rank(group, rank)


def same(a: ProcessGroup | None, b: ProcessGroup | None) -> bool:
    """Whether ``a`` and ``b`` are the same group (``None`` and the world are)."""
    return resolve(a) is resolve(b)
