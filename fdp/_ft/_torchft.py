"""The one module that imports torchft (an optional extra: ``pip install 'fdp[ft]'``)."""

from __future__ import annotations

import os
import re
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "init_sync",
    "make_manager",
    "mean_future",
    "quorum_id",
    "shutdown",
    "sum_async",
    "wait",
]

_INSTALL = "pip install 'fdp[ft]' (or pip install torchft)"


def make_manager(
    lighthouse: str,
    *,
    replica_id: str,
    min_replicas: int,
    group_rank: int,
    group_world_size: int,
    timeout: timedelta,
    pg: Any,
    init_sync: bool,
    call: str,
) -> tuple[Any, Any]:
    """A torchft Manager with a synchronous quorum, and the TCP store made for it (or None)."""
    try:
        import torchft
    except ImportError as e:
        raise ImportError(f"{call}: needs torchft; {_INSTALL}") from e
    if not re.fullmatch(r"https?://[^/\s]+:\d+", lighthouse):
        raise ValueError(
            f"{call}: `lighthouse` expected an address like 'http://host:29510'; got {lighthouse!r}"
        )
    store, addr, port = _store(group_world_size, call)
    try:
        manager = torchft.Manager(
            pg=pg if pg is not None else torchft.ProcessGroupGloo(timeout=timeout),
            load_state_dict=None,
            state_dict=None,
            min_replica_size=min_replicas,
            use_async_quorum=False,
            replica_id=replica_id,
            lighthouse_addr=lighthouse,
            store_addr=addr,
            store_port=port,
            rank=group_rank,
            world_size=group_world_size,
            timeout=timeout,
            quorum_timeout=timeout,
            connect_timeout=timeout,
            init_sync=init_sync,
        )
    except RuntimeError as e:
        if "failed to connect" in str(e):
            raise ConnectionError(
                f"{call}: cannot reach the lighthouse at `lighthouse` {lighthouse!r} within "
                f"{timeout.total_seconds():g} s; start one with `torchft_lighthouse "
                f"--min_replicas {min_replicas} --bind [::]:PORT` and pass its address"
            ) from e
        raise
    return manager, store


def _store(group_world_size: int, call: str) -> tuple[Any, str, int]:
    """The replica group's TCP store: torchrun's (MASTER_ADDR/PORT), or a new one (one process)."""
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        return None, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if group_world_size != 1:
        raise ValueError(
            f"{call}: `group_world_size` {group_world_size} expected MASTER_ADDR and "
            "MASTER_PORT (torchrun sets them per replica group); got neither"
        )
    tcp_store: Any = dist.TCPStore  # type: ignore[attr-defined]
    store = tcp_store("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    return store, "127.0.0.1", store.port


def shutdown(manager: Any) -> None:
    """Stops the manager's servers and threads, then shuts its process group down.

    ``wait=True``: torchft's ``wait=False`` leaves its quorum thread and HTTP
    server running. The process group goes too, because its destructor waits
    for the gloo worker threads: a Python callback still running on one of
    them when the interpreter finalizes (a :func:`mean_future` nobody waited
    for) ends the thread through C++ code that may not throw, and the process
    aborts ("terminate called without an active exception") after training.
    """
    manager.shutdown(wait=True)
    close = getattr(getattr(manager, "_pg", None), "shutdown", None)
    if callable(close):
        close()


def init_sync(manager: Any) -> bool:
    """Whether the manager heals every replica group from one peer at step 0."""
    return bool(getattr(manager, "_init_sync", True))


def quorum_id(manager: Any) -> int:
    """The quorum's id: it changes whenever the live replica groups (and the process group
    across them) are reconfigured; -1 for a manager that has none."""
    return int(getattr(manager, "_quorum_id", -1))


def sum_async(manager: Any, tensor: Any) -> Any:
    """Starts summing ``tensor`` in place over the quorum; None if it could not start.

    On the manager's process group (the processes of this group rank across
    replica groups), not through ``manager.allreduce``, which does nothing
    once the manager has an error: every replica group issues the same
    collectives whatever its local errors.
    """
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]
    try:
        return manager._pg.allreduce([tensor], opts)
    except Exception as e:  # a broken group: this step is discarded
        manager.report_error(e)
        return None


def mean_future(manager: Any, flat: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """``flat`` averaged over the quorum in place, as a future; a failure is reported."""
    participants = manager.num_participants()
    work = sum_async(manager, flat)

    def averaged(fut: torch.futures.Future[Any]) -> torch.Tensor:
        try:
            fut.wait()
        except Exception as e:  # the step is discarded everywhere at the commit
            manager.report_error(e)
        return flat.div_(participants)

    if work is None:
        done: torch.futures.Future[Any] = torch.futures.Future()
        done.set_result(None)
        return done.then(averaged)
    future: torch.futures.Future[Any] = work.get_future()
    return future.then(averaged)


def wait(manager: Any, work: Any) -> None:
    """Waits for :func:`sum_async`'s work; a failure is the manager's error, not an exception."""
    if work is None:
        return
    try:
        work.wait()
    except Exception as e:
        manager.report_error(e)
