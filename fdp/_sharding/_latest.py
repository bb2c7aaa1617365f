"""``latest_checkpoint``: the newest complete checkpoint in a folder, the same on every rank.

``save_checkpoint`` writes a checkpoint beside its path (``.<name>.saving``,
whose name ends in no number) and renames it into place once complete, so a
numbered directory holding ``.metadata`` is complete; one a killed run of an
older fdp left half written has none. Checkpoints are
told apart by the number their name ends in (``step_1200``, ``ckpt-7``,
``300``). Ranks may see different files (a folder not shared between
hosts, a file system that shows writes late), so the group's rank 0
chooses and every rank takes its choice: all load the same step, or all
start afresh.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, cast

import torch.distributed as dist
from torch.distributed import ProcessGroup

from fdp._comm import _groups, _training

_NUMBER = re.compile(r"(\d+)$")


def latest_checkpoint(
    directory: str | os.PathLike[str], *, group: ProcessGroup | None = None
) -> str | None:
    """The newest complete checkpoint under ``directory``, or ``None``; every rank calls it.

    Looks at the subdirectories whose names end in a number (``step_1200``)
    and that hold ``.metadata`` (``fdp.save_checkpoint`` writes it last, so
    a save that died midway is skipped), and returns the path of the one
    with the largest number. With ``torch.distributed`` initialised it is
    collective over ``group`` (default: the world): rank 0's answer, on
    every rank.

    Args:
        directory: the folder the checkpoints were saved under (it may not
            exist yet: then ``None``).
        group: the process group whose rank 0 decides.

    Returns:
        The checkpoint's path as a string, or ``None`` when there is none.

    Example::

        found = fdp.latest_checkpoint("ckpt")
        if found is not None:
            state = fdp.load_checkpoint(found, like=state)
        ...
        fdp.save_checkpoint(f"ckpt/step_{step}", state)
    """
    if not isinstance(directory, str | os.PathLike):
        raise TypeError(
            "fdp.latest_checkpoint: `directory` expected a path (str or os.PathLike); "
            f"got {type(directory).__name__}"
        )
    if not (dist.is_available() and dist.is_initialized()):
        return _newest(Path(directory))
    _training.before_collective("fdp.latest_checkpoint", group)  # inside DDP's join
    found: list[Any] = [None]
    error: OSError | None = None
    if dist.get_rank(group) == 0:
        try:
            found = [_newest(Path(directory))]
        except OSError as e:  # an unreadable folder: every rank raises, none waits
            error, found = e, [("error", f"{type(e).__name__}: {e}")]
    dist.broadcast_object_list(found, src=_groups.global_rank(group, 0), group=group)
    if error is not None:
        raise error
    if isinstance(found[0], tuple):
        raise RuntimeError(f"fdp.latest_checkpoint: rank 0 raised {found[0][1]}")
    return cast(str | None, found[0])


def _newest(directory: Path) -> str | None:
    if not directory.is_dir():
        return None
    done = []
    for path in directory.iterdir():
        number = _NUMBER.search(path.name)
        if number is not None and path.is_dir() and (path / ".metadata").is_file():
            done.append((int(number.group(1)), path.name, path))
    return str(max(done)[2]) if done else None
