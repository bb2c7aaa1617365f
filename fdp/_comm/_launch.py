"""Joining the process group a launcher (torchrun, srun + torchrun) describes.

One call does what every distributed script repeats: read torchrun's
environment, pick this rank's device from ``LOCAL_RANK``, leave the user's
``OMP_NUM_THREADS`` alone (or share the CPUs when it is unset), and join the
default process group in a way that survives ``torchrun --max-restarts``.
"""

from __future__ import annotations

import atexit
import datetime
import math
import os
import threading
import time
import uuid
import warnings
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, Store, TCPStore  # type: ignore[attr-defined]

from fdp import _mode

_CALL = "fdp.init_distributed"
_NEEDED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_KEYS = "fdp/launch"
# Default groups this process joined through init_distributed (a fresh key
# space per restart attempt); read only to warn about the others, once.
_FRESH: weakref.WeakSet[object] = weakref.WeakSet()
_WARNED: list[bool] = []


def init_distributed(
    backend: str = "gloo", *, timeout: datetime.timedelta | None = None
) -> torch.device:
    """Initializes the default process group from torchrun's environment.

    Returns this rank's device: the CPU for gloo, ``cuda:<LOCAL_RANK>`` for
    nccl (made the current CUDA device). Where ``OMP_NUM_THREADS`` is unset,
    CPU ranks share the CPUs this process may use (its affinity and cgroup
    quota) evenly among the node's ``LOCAL_WORLD_SIZE`` ranks; where it is
    set, torch's thread count is left as the variable made it.

    Under ``torchrun --max-restarts``, a restarted group joins afresh: torch
    (2.4 and later) keeps the agent's TCPStore across restarts, so the dead
    attempt's addresses are still in it, and ``dist.init_process_group``
    alone makes gloo connect to them and time out (pytorch/pytorch#135712).
    Here each attempt's group gets a key space no earlier attempt wrote,
    agreed through the store by every rank of the new attempt.

    At exit the process waits 50 ms before the interpreter shuts down, so
    that gloo's threads release the last collectives' tensors first (a
    successful run could otherwise abort at exit: Note [gloo at exit]).

    Args:
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (CUDA), or any backend torch
            has; its device type is the one torch pairs it with.
        timeout: the process group's timeout (torch's default when None).

    Returns:
        The device this rank computes on.

    Raises:
        RuntimeError: not launched by torchrun (its variables are missing),
            or the default process group already exists.
        ValueError: ``backend`` is unknown to this torch build, or asks for a
            device this machine lacks (CUDA absent, ``LOCAL_RANK`` past the
            visible devices).

    Example:
        >>> import fdp
        >>> device = fdp.init_distributed("gloo")  # doctest: +SKIP
    """
    env = _launch_env()
    if dist.is_initialized():
        raise RuntimeError(f"{_CALL}: the default process group is already initialized")
    if not _DRAINING:
        _DRAINING.append(atexit.register(_let_gloo_finish))
    device = _device(backend, env["LOCAL_RANK"])
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, usable_cpus() // env["LOCAL_WORLD_SIZE"]))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, timeout=timeout)
        return device
    wait = timeout or datetime.timedelta(minutes=10)
    store = TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        env["WORLD_SIZE"],
        is_master=False,
        timeout=wait,
    )
    fresh = attempt_store(store, env["RANK"], env["WORLD_SIZE"], wait)
    dist.init_process_group(
        backend, store=fresh, rank=env["RANK"], world_size=env["WORLD_SIZE"], timeout=timeout
    )
    _FRESH.add(dist.group.WORLD)
    return device


# The exit hook below, registered once by init_distributed.
_DRAINING: list[object] = []


def _let_gloo_finish(*, at_most: float = 1.0) -> None:
    """At exit, lets gloo's worker threads release the last collectives' tensors.

    Note [gloo at exit]: a gloo worker thread drops a finished collective
    after ``wait()`` has returned; when that drop frees a tensor's Python
    object it takes the GIL. If the thread was descheduled until the
    interpreter finalizes, taking the GIL ends the thread and the process
    aborts ("terminate called without an active exception", SIGABRT after
    a successful run: 2 in 20 runs of train_lm_fsdp.py under load, and
    docs/porting.md's script). ``destroy_process_group`` does not prevent
    it: DCP and fdp's objects keep the group alive until finalization
    (torch 2.13; pytorch/pytorch#179291 is torch's abandoned fix). So this
    waits, before finalization and with the GIL released, until no other
    thread of the process is running or waiting to run, twice in a row (a
    thread waiting for the GIL sleeps; it runs in the pause between), for
    ``at_most`` seconds at most. A fixed 50 ms pause, as before, was not
    enough on a loaded machine (a restarted ``train_lm_fsdp.py`` aborted
    so, 2026-12-06). Where threads' states cannot be read (not Linux),
    it pauses 50 ms.
    """
    deadline = time.monotonic() + at_most
    idle = 0
    while idle < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
        running = _others_running()
        if running is None:
            time.sleep(0.05)
            return
        idle = 0 if running else idle + 1


def _others_running() -> bool | None:
    """Whether another thread of this process is running or runnable (None: unknown)."""
    me = str(threading.get_native_id())
    try:
        tasks = [t for t in os.listdir("/proc/self/task") if t != me]
        for task in tasks:
            with open(f"/proc/self/task/{task}/stat") as f:
                # The state follows the command name, which may hold spaces and ")".
                if f.read().rpartition(")")[2].split()[0] == "R":
                    return True
    except FileNotFoundError:  # a thread that ended since: check again next time
        return True
    except (OSError, IndexError):
        return None
    return False


def warn_if_restarts_fail(call: str) -> None:
    """Warns once if torchrun will restart this job into a group that cannot connect.

    Under ``torchrun --max-restarts`` torch keeps the agent's store across
    restarts (pytorch/pytorch#135712): a group that
    ``torch.distributed.init_process_group`` made reads the dead attempt's
    addresses after a restart, and gloo fails (``connectFullMesh ...
    Connection refused``) or waits out its timeout. fdp cannot repair such
    a group: the restarted ``init_process_group`` fails before fdp runs.

    Eager calls only: while dynamo traces, the graph would guard on the
    once-flag and compile again the first time it flips.
    """
    if _WARNED or _mode.traced():
        return
    _WARNED.append(True)
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if restarts <= 0 or not shared or dist.group.WORLD in _FRESH:
        return
    warnings.warn(
        f"{call}: this job runs under torchrun --max-restarts={restarts}, and its process "
        "group was made by torch.distributed.init_process_group: after a restart the new "
        "ranks read the old attempt's addresses from torchrun's store and fail to connect "
        "(pytorch/pytorch#135712), which fdp cannot repair from here. Call "
        "fdp.init_distributed() instead (docs/launch.md)",
        UserWarning,
        stacklevel=3,
    )


def _launch_env() -> dict[str, int]:
    missing = [name for name in _NEEDED if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"{_CALL}: the environment lacks {', '.join(missing)}; launch the script with "
            "torchrun (e.g. `torchrun --standalone --nproc_per_node=2 train.py`), which sets "
            f"{', '.join(_NEEDED)} (docs/launch.md)"
        )
    return {name: int(os.environ[name]) for name in _NEEDED if name != "MASTER_ADDR"}


def _device(backend: str, local_rank: int) -> torch.device:
    """The device type torch pairs ``backend`` with, indexed by LOCAL_RANK."""
    pairs = dist.Backend.default_device_backend_map
    kind = next((k for k, b in pairs.items() if b == backend), "cpu")  # gloo: cpu first
    module = getattr(torch, kind)
    if kind != "cpu" and not module.is_available():
        raise ValueError(
            f"{_CALL}: `backend` is {backend!r}, which runs on {kind} devices, but "
            f"torch.{kind}.is_available() is False (torch {torch.__version__}); "
            "use backend='gloo' to train on the CPU"
        )
    if not dist.is_backend_available(backend):
        raise ValueError(
            f"{_CALL}: `backend` is {backend!r}, which this torch build does not have; "
            "expected 'gloo' (CPU) or 'nccl' (CUDA)"
        )
    if kind == "cpu":
        return torch.device("cpu")
    if local_rank >= module.device_count():
        raise ValueError(
            f"{_CALL}: `backend` is {backend!r} and LOCAL_RANK is {local_rank}, but only "
            f"{module.device_count()} {kind} devices are visible; expected --nproc_per_node "
            "at most the number of devices"
        )
    module.set_device(local_rank)
    return torch.device(kind, local_rank)


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity, capped by a cgroup v2 quota."""
    count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    count = count or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return count
    if quota == "max":
        return count
    return max(1, min(count, math.floor(int(quota) / int(period))))


def attempt_store(store: Store, rank: int, world: int, timeout: datetime.timedelta) -> Store:
    """A prefix of ``store`` that no earlier attempt of this job has written.

    Note [a key space per attempt]: torchrun's agents keep one TCPStore for the whole job, and
    TORCHELASTIC_RESTART_COUNT is counted per agent (a node whose workers
    were restarted by another node's failure does not count it), so neither
    the store nor the count tells the ranks of a new attempt apart from the
    dead ones. Rank 0 draws a number no attempt has had (a counter in the
    store) and hands it to each rank that posts a nonce it made just now;
    a nonce left by a dead attempt may be answered too, harmlessly, so rank 0
    answers every posted nonce until every rank has confirmed this number.
    """
    if rank == 0:
        generation = store.add(f"{_KEYS}/generation", 1)
        _welcome(store, world, generation, timeout)
    else:
        nonce = uuid.uuid4().hex
        store.set(f"{_KEYS}/hello/{rank}", nonce)
        generation = int(store.get(f"{_KEYS}/welcome/{nonce}"))
        store.add(f"{_KEYS}/ready/{generation}", 1)
    return PrefixStore(f"{_KEYS}/attempt/{generation}", store)


def _welcome(store: Store, world: int, generation: int, timeout: datetime.timedelta) -> None:
    hellos = [f"{_KEYS}/hello/{r}" for r in range(1, world)]
    deadline = time.monotonic() + timeout.total_seconds()
    while store.add(f"{_KEYS}/ready/{generation}", 0) < world - 1:
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{_CALL}: not every rank joined attempt {generation} within {timeout}"
            )
        nonces = [n.decode() for n in store.multi_get(hellos)] if hellos else []
        welcomes = [f"{_KEYS}/welcome/{n}" for n in nonces]
        store.multi_set(welcomes, [str(generation)] * len(nonces))  # type: ignore[attr-defined]
        time.sleep(0.01)
