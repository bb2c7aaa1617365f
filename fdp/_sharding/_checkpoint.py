"""``save_checkpoint`` / ``load_checkpoint``: training states in DCP's format.

A state is any pytree (optree's rules, ``None`` a leaf) of tensors,
:class:`fdp.ZeroState` shards and plain Python values. Each leaf is one DCP
entry named by its path (``['params']['w']``), so the checkpoint is DCP's
own format, written by every rank in parallel: a tensor is held by every
rank and written once, by rank 0 (its values where ranks differ); a
``ZeroState`` slot becomes, per parameter leaf, a
1-D sharded entry of the leaf's elements (in the layout's element order)
that each rank writes its pieces of, under the key the same slot of an
unsharded ``fdp.optim`` state would have (``['opt']['exp_avg']['w']``);
Python values are DCP's bytes entries. Loading reads every entry into new
tensors laid out like ``like``, so a ``ZeroState`` of another world size
takes the pieces its own slices need (resharding).

Each rank's RNG states (CPU, and the current CUDA device's once CUDA is
initialised) are saved under ``_fdp/rng/<rank>`` and restored on load when
the world size is the one that saved them.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import optree
import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from fdp import _tree
from fdp._comm import _agreement, _training
from fdp._sharding import (
    _checkpoint_files,
    _checkpoint_leaves,
    _checkpoint_match,
    _checkpoint_optim,
    _checkpoint_verify,
    _per_rank,
)
from fdp._sharding._checkpoint_leaves import ZeroLeaf
from fdp._sharding._shards import ZeroState

if TYPE_CHECKING:
    from torch.distributed.checkpoint.api import CheckpointException

T = TypeVar("T")
_RNG = _checkpoint_match.RNG


def save_checkpoint(
    path: str | os.PathLike[str],
    state: Any,
    *,
    group: ProcessGroup | None = None,
    rng: bool = True,
) -> None:
    """Saves a training state with ``torch.distributed.checkpoint``; every rank calls it.

    Tensor leaves and Python values are replicated (parameters, an
    unsharded optimizer state, the step): they are written once, by the
    group's rank 0, after one all-reduce has checked that every rank holds
    the same bits, so an entry that differs (fully sharded shards saved
    directly, ranks that trained apart, a per-rank value) raises on every
    rank, naming the leaf and its probable cause. A module's buffers
    (``make_functional``'s state) are rank 0's, as torch's DDP users save
    rank 0's ``state_dict``. A ``ZeroState`` is written in pieces by the
    ranks that hold them.

    The checkpoint is written beside ``path`` (``.<name>.saving``) and
    switched in whole when every rank has written: at any instant ``path``
    holds the previous checkpoint or this one, complete, so a job killed
    while saving over ``ckpt/last`` resumes from its last save. Every rank
    returns once the switch is done (a barrier of ``group``).

    Args:
        path: a directory (created if needed).
        state: a pytree of tensors, ``ZeroState``s and Python values.
        group: the process group that saves (default: the world; without
            ``torch.distributed``, this process alone).
        rng: also save this rank's random number generator states.

    Example::

        fdp.save_checkpoint(f"ckpt/{step}", {"params": params, "opt": state, "step": step})
    """
    call = "fdp.save_checkpoint"
    if _distributed():  # inside DDP's join: every rank saves here, or all raise
        _training.before_collective(call, group)
    try:  # local work: where it fails on some ranks only, every rank raises (not a hang)
        expanded = _per_rank.expand(call, "state", state, rank=_rank(group), world=_world(group))
        state = _checkpoint_optim.for_save(expanded.tree)
        with _quietly():
            _, leaves = _checkpoint_leaves.leaves_of(call, "state", state, fresh=False)
    except (ValueError, TypeError) as e:
        _together(call, e, group)
        raise
    _together(call, None, group)
    entries = {k: v for leaf in leaves for k, v in leaf.entries.items()}
    if _distributed():
        _checkpoint_files.require_one_path(call, path, group)
        once = {k: v for leaf in leaves for k, v in leaf.once().items() if not expanded.ranked(k)}
        _checkpoint_verify.check(call, once, group)
    if rng:
        entries[_RNG + str(_rank(group))] = _rng_state()
    try:
        stage = _checkpoint_files.prepare(path, coordinator=_rank(group) == 0)
    except OSError as e:  # rank 0's staging directory (a read-only or full file system)
        _together(call, e, group)
        raise
    # The staging directory is clean before anyone writes: a round trip, as a barrier.
    _together(call, None, group)
    # An entry every rank holds is written by the group's rank 0, not by the
    # rank DCP's load balancing picks (verified equal above, buffers aside:
    # rank 0's, what torch's DDP users save from rank 0's state_dict).
    # torch.distributed.checkpoint is imported here, not with fdp: it takes
    # seconds (DTensor, sympy) that a run which never saves should not pay.
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    planner = DefaultSavePlanner(dedup_save_to_lowest_rank=True)
    try:
        with _quietly():
            dcp_save(
                entries,
                checkpoint_id=stage,
                process_group=group,
                planner=planner,
                no_dist=not _distributed(),
            )
    except _dcp().CheckpointException as e:  # a BaseException, raised on every rank alike
        raise RuntimeError(
            f"{call}: could not write `path` {os.fspath(path)!r}: {_cause(e)}"
        ) from e
    # DCP's coordinator returns once every rank's files and .metadata are
    # written: then the new checkpoint replaces the old one whole.
    try:
        if _rank(group) == 0:
            _checkpoint_files.switch(path)
    except OSError as e:
        _together(call, e, group)
        raise
    _together(call, None, group)
    if _distributed():
        # Every rank returns after the switch, so a load that follows finds
        # the new checkpoint. Note [a barrier after saving]: DCP's last
        # collectives are gloo broadcasts of tensors that a gloo worker
        # thread may still be releasing when the call returns, and DCP keeps
        # the process group alive past destroy_process_group (torch 2.13). A
        # script that saves, then exits, could have that thread take the GIL
        # during interpreter finalization: SIGABRT ("terminate called without
        # an active exception", 2 in 20 runs of train_lm_fsdp.py under load).
        # The barrier gives the worker its round trip to let them go.
        dist.barrier(group=group)


def load_checkpoint(
    path: str | os.PathLike[str],
    like: T,
    *,
    group: ProcessGroup | None = None,
    rng: bool = True,
    strict: bool = True,
) -> T:
    """Loads a state saved by :func:`save_checkpoint`, structured and laid out like ``like``.

    ``like`` gives the structure, shapes, dtypes, devices and sharding:
    for a ``ZeroState`` leaf pass ``zero.init(params)`` of this run's
    ``ZeroRedundancy``, which may have another world size than the run that
    saved. A module's own tensors in ``like`` (``nn.Parameter``s, and the
    buffers of ``make_functional``'s state) are loaded into in place and come
    back as themselves, as DCP does, so the module and a torch optimizer over
    its parameters see the loaded values; every other tensor leaf comes back
    as a new tensor, and ``like``'s are not changed.

    Args:
        path: a directory written by :func:`save_checkpoint`.
        like: a state of the expected structure (its values are ignored).
        group: the process group that loads (default: the world).
        rng: restore this rank's random number generator states, when the
            checkpoint was saved by as many ranks as load it.
        strict: refuse a checkpoint holding entries that ``like`` has no
            leaf for (naming them); ``False`` loads ``like``'s and leaves
            the rest.

    A torch ``Optimizer`` in ``like`` is loaded into in place
    (``load_state_dict``) and comes back as itself; an optimizer's
    ``state_dict()`` in ``like``, even a fresh optimizer's with no state yet,
    comes back with every per-parameter state the checkpoint holds.

    Returns:
        The saved state, structured like ``like``.

    Example::

        like = {"params": params, "opt": zero.init(params), "step": 0}
        state = fdp.load_checkpoint(latest, like)
    """
    call = "fdp.load_checkpoint"
    if _distributed():
        _training.before_collective(call, group)
    try:  # local work: where it fails on some ranks only, every rank raises (not a hang)
        plan = _Load(call, path, like, strict=strict, rank=_rank(group), world=_world(group))
    except (ValueError, TypeError, OSError) as e:
        _together(call, e, group)
        raise
    _together(call, None, group)
    spec, leaves, entries, zeros = plan.spec, plan.leaves, plan.entries, plan.zeros
    key = _RNG + str(_rank(group))
    saved_world = sum(k.startswith(_RNG) for k in plan.metadata)
    restore = rng and saved_world == _world(group) and key in plan.metadata
    if restore:
        entries[key] = None
    try:
        with _quietly():
            _dcp().load(
                entries, checkpoint_id=path, process_group=group, no_dist=not _distributed()
            )
    except _dcp().CheckpointException as e:  # a BaseException: `except Exception` would miss it
        raise ValueError(f"{call}: could not read `path` {os.fspath(path)!r}: {_cause(e)}") from e
    for zero in zeros:
        if zero.orders_key in entries:
            zero.check_orders(call, entries[zero.orders_key])
    for fill in plan.after:
        fill()
    if restore:
        _set_rng_state(entries[key])
    results = [leaf.result(entries) for leaf in leaves]
    for later, first in _ties(plan.like).items():
        results[later] = results[first]
    out: Any = plan.expanded.restore(plan.finish(optree.tree_unflatten(spec, results)))
    return out  # type: ignore[no-any-return]


class _Load:
    """A load's local work before DCP's: the entries to read, checked against the metadata."""

    def __init__(
        self,
        call: str,
        path: str | os.PathLike[str],
        like: Any,
        *,
        strict: bool,
        rank: int,
        world: int,
    ) -> None:
        self.metadata = metadata = _metadata(call, path)
        self.expanded = _per_rank.expand(call, "like", like, rank=rank, world=world)
        others = self.expanded.others(call, metadata)
        self.like, self.finish = _checkpoint_optim.for_load(self.expanded.tree, metadata)
        with _quietly():
            self.spec, leaves = _checkpoint_leaves.leaves_of(call, "like", self.like, fresh=True)
        self.leaves = leaves
        self.entries = entries = {k: v for leaf in leaves for k, v in leaf.entries.items()}
        if strict:
            covered = set(entries).union(
                others, *(z.covers for z in leaves if isinstance(z, ZeroLeaf))
            )
            _checkpoint_match.check_unread(call, os.fspath(path), covered, metadata)
        self.zeros = [leaf for leaf in leaves if isinstance(leaf, ZeroLeaf)]
        for zero in self.zeros:
            if zero.orders_key not in metadata:  # unsharded, or saved before fdp kept them
                del entries[zero.orders_key]
        with _quietly():
            owners = {key: leaf for leaf in leaves for key in leaf.entries}
            self.after = _checkpoint_match.match(call, entries, metadata, owners)


def _together(call: str, error: Exception | None, group: ProcessGroup | None) -> None:
    """Every rank raises if any rank's local work failed (:func:`_agreement.raise_together`)."""
    if _distributed():
        _agreement.raise_together(call, error, group)


def _metadata(call: str, path: str | os.PathLike[str]) -> dict[str, Any]:
    """The checkpoint's entries: key -> DCP's metadata of the entry."""
    try:
        from torch.distributed.checkpoint.filesystem import FileSystemReader

        found: dict[str, Any] = FileSystemReader(path).read_metadata().state_dict_metadata
    except FileNotFoundError as e:
        raise ValueError(
            f"{call}: `path` {os.fspath(path)!r} holds no checkpoint (no .metadata: missing, or "
            "a save that did not finish)"
        ) from e
    return found


def _ties(like: Any) -> dict[int, int]:
    """Leaf index -> the first leaf holding the same tensor (``load_state_dict`` keeps ties)."""
    flat = optree.tree_leaves(like, is_leaf=lambda x: isinstance(x, ZeroState), none_is_leaf=True)
    return _tree.ties(flat)


def _cause(e: CheckpointException) -> str:
    """The first rank's failure, in a line (DCP raises the same on every rank)."""
    for rank, failure in sorted(e.failures.items()):
        inner = failure[0] if isinstance(failure, tuple) else failure
        text = str(inner).splitlines()
        return f"rank {rank}: {type(inner).__name__}: {text[0] if text else ''}"
    return str(e).splitlines()[0]


@contextlib.contextmanager
def _quietly() -> Iterator[None]:
    """Silences DCP warnings that say nothing to fdp's users.

    DCP warns that it assumes one process whenever torch.distributed is off
    (fdp means it), every ShardedTensor access warns that the type is
    deprecated (fdp's use is confined to ``_compat.sharded_tensor``), and
    torch 2.10's file writer calls the deprecated ``Tensor.storage()``.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        warnings.filterwarnings(
            "ignore", message="TypedStorage is deprecated", category=UserWarning
        )
        warnings.filterwarnings(
            "ignore", message=".*deprecating ShardedTensor", category=FutureWarning
        )
        yield


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank(group: ProcessGroup | None) -> int:
    return dist.get_rank(group) if _distributed() else 0


def _world(group: ProcessGroup | None) -> int:
    return dist.get_world_size(group) if _distributed() else 1


def _rng_state() -> tuple[torch.Tensor, torch.Tensor | None]:
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None  # type: ignore[no-untyped-call]
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda)


def _dcp() -> Any:
    """``torch.distributed.checkpoint``, imported on first use (seconds: DTensor, sympy)."""
    import torch.distributed.checkpoint as dcp

    return dcp
