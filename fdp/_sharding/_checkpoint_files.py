"""Where a checkpoint is written: beside its path, then switched in whole.

``fdp.save_checkpoint(path, ...)`` has DCP write into a staging directory
next to ``path`` (``.<name>.saving``), and only once every rank's files and
the ``.metadata`` are written does the group's rank 0 put it at ``path``: a
rename where ``path`` is new, an exchange of the two directories where it
holds an older checkpoint (Linux's ``renameat2(RENAME_EXCHANGE)``, one
atomic step), then the old one is removed. So at any instant ``path`` holds
the old checkpoint or the new one, whole: a job that always saves to
``ckpt/last`` and is killed during a save resumes from its last complete
save. Where the file system cannot exchange (not Linux, NFS), the old
directory is renamed aside first, leaving ``path`` absent for the instant
between two renames, and the old one is found again at ``.<name>.old``.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
from typing import Any

import torch.distributed as dist

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def staging(path: str | os.PathLike[str]) -> str:
    """The directory a save of ``path`` writes first (the same on every rank)."""
    parent, name = os.path.split(os.path.normpath(os.fspath(path)))
    return os.path.join(parent, f".{name}.saving")


def prepare(path: str | os.PathLike[str], *, coordinator: bool) -> str:
    """Clears what a save that died left in the staging directory; returns it.

    Only the coordinator (rank 0) touches the disk; every rank must then wait
    for it (a barrier) before any writes there.
    """
    stage = staging(path)
    if coordinator:
        shutil.rmtree(stage, ignore_errors=True)
        os.makedirs(stage)
    return stage


def switch(path: str | os.PathLike[str]) -> None:
    """Puts the staged checkpoint at ``path`` (rank 0, once every rank has written)."""
    target = os.path.normpath(os.fspath(path))
    stage = staging(target)
    if not os.path.lexists(target):
        os.rename(stage, target)
        return
    if _exchange(stage, target):
        shutil.rmtree(stage)  # now the old checkpoint
        return
    old = os.path.join(os.path.dirname(target), f".{os.path.basename(target)}.old")
    shutil.rmtree(old, ignore_errors=True)
    os.rename(target, old)
    os.rename(stage, target)
    shutil.rmtree(old)


def _exchange(a: str, b: str) -> bool:
    """Swaps two directories atomically; False where the system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    done = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if done == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), b)


def require_one_path(call: str, path: str | os.PathLike[str], group: Any) -> None:
    """Raises on every rank unless every rank saves to the same directory.

    Rank 0 writes the entries every rank holds and switches the staging
    directory in: a path per rank (``ckpt/rank{rank}``, torch.save's habit)
    would leave the other ranks' files in a staging directory no one
    switches, and a checkpoint without them.
    """
    mine = os.path.abspath(os.fspath(path))
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    for rank, theirs in enumerate(gathered[1:], start=1):
        if theirs != gathered[0]:
            raise ValueError(
                f"{call}: `path` expected the same directory on every rank (rank 0 writes what "
                "every rank holds and switches the checkpoint in; each rank writes its own "
                f"pieces there); got {gathered[0]!r} on rank 0 and {theirs!r} on rank {rank}"
            )
