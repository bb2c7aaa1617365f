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
import json
import os
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import optree
import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from fdp import _bucket, _compat, _functional, _tree
from fdp._sharding import (
    _checkpoint_files,
    _checkpoint_match,
    _checkpoint_optim,
    _checkpoint_verify,
)
from fdp._sharding._shards import Shards, ZeroState

if TYPE_CHECKING:
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

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
    state = _checkpoint_optim.for_save(state)
    with _quietly():
        _, leaves = _leaves(call, "state", state, fresh=False)
    entries = {k: v for leaf in leaves for k, v in leaf.entries.items()}
    if _distributed():
        once = {k: v for leaf in leaves for k, v in leaf.once().items()}
        _checkpoint_verify.check(call, once, group)
    if rng:
        entries[_RNG + str(_rank(group))] = _rng_state()
    stage = _checkpoint_files.prepare(path, coordinator=_rank(group) == 0)
    if _distributed():
        dist.barrier(group=group)  # the staging directory is clean before anyone writes
    # An entry every rank holds is written by the group's rank 0, not by the
    # rank DCP's load balancing picks (verified equal above, buffers aside:
    # rank 0's, what torch's DDP users save from rank 0's state_dict).
    # torch.distributed.checkpoint is imported here, not with fdp: it takes
    # seconds (DTensor, sympy) that a run which never saves should not pay.
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    planner = DefaultSavePlanner(dedup_save_to_lowest_rank=True)
    with _quietly():
        dcp_save(
            entries,
            checkpoint_id=stage,
            process_group=group,
            planner=planner,
            no_dist=not _distributed(),
        )
    # DCP's coordinator returns once every rank's files and .metadata are
    # written: then the new checkpoint replaces the old one whole.
    if _rank(group) == 0:
        _checkpoint_files.switch(path)
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
    metadata = _metadata(call, path)
    like, finish = _checkpoint_optim.for_load(like, metadata)
    with _quietly():
        spec, leaves = _leaves(call, "like", like, fresh=True)
    entries = {k: v for leaf in leaves for k, v in leaf.entries.items()}
    if strict:
        covered = set(entries).union(*(z.covers for z in leaves if isinstance(z, _Zero)))
        _checkpoint_match.check_unread(call, os.fspath(path), covered, metadata)
    zeros = [leaf for leaf in leaves if isinstance(leaf, _Zero)]
    for zero in zeros:
        if zero.orders_key not in metadata:  # an unsharded state, or saved before fdp kept them
            del entries[zero.orders_key]
    with _quietly():
        owners = {key: leaf for leaf in leaves for key in leaf.entries}
        after = _checkpoint_match.match(call, entries, metadata, owners)
    key = _RNG + str(_rank(group))
    saved_world = sum(k.startswith(_RNG) for k in metadata)
    restore = rng and saved_world == _world(group) and key in metadata
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
    for fill in after:
        fill()
    if restore:
        _set_rng_state(entries[key])
    results = [leaf.result(entries) for leaf in leaves]
    for later, first in _ties(like).items():
        results[later] = results[first]
    out: Any = finish(optree.tree_unflatten(spec, results))
    return out  # type: ignore[no-any-return]


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


class _Leaf:
    """One leaf of the state: its DCP entries, and the leaf rebuilt from loaded entries."""

    def __init__(self, key: str, value: Any) -> None:
        self.key = key
        self.entries: dict[str, Any] = {key: value}

    def result(self, entries: dict[str, Any]) -> Any:
        return entries.get(self.key)

    def once(self) -> dict[str, Any]:
        """The entries written once for every rank (verified equal before a save)."""
        return self.entries

    def reshaped(self, key: str, saved: TensorStorageMetadata) -> Reshaped | None:
        """What to load entry ``key`` through when the checkpoint holds another shape."""
        return None


# A tensor for DCP to load into, and what to do with it after the load.
Reshaped = tuple[torch.Tensor, Callable[[], None]]


class _Tensor(_Leaf):
    def __init__(self, key: str, t: torch.Tensor, *, fresh: bool) -> None:
        # A module's own parameter or buffer in `like` is loaded into in place,
        # as DCP does: new tensors would leave the module (and a torch
        # optimizer over its parameters) behind.
        self.own = t if fresh and _functional.module_tensor(t) and _holds_data(t) else None
        super().__init__(key, torch.empty_like(t) if fresh and self.own is None else t.detach())
        self.tensor, self.requires_grad = self.entries[key], t.requires_grad
        self.buffer = _functional.module_tensor(t) and not isinstance(t, torch.nn.Parameter)

    def result(self, entries: dict[str, Any]) -> Any:
        if self.own is not None:
            return self.own
        # Loaded in place; a leaf of `like` that requires grad gives one that does.
        out: torch.Tensor = self.tensor
        return out.requires_grad_() if self.requires_grad else out

    def once(self) -> dict[str, Any]:
        # A module's buffers drift between DDP's broadcasts: rank 0's are saved.
        return {} if self.buffer else self.entries

    def reshaped(self, key: str, saved: TensorStorageMetadata) -> Reshaped | None:
        """A ``ZeroState`` entry (the leaf's elements, 1-D) loaded into an unsharded leaf."""
        t = self.tensor
        if len(saved.size) != 1 or saved.size[0] != _bucket.real_numel(t):
            return None
        view = _bucket.memory_flat(t, _bucket.memory_order(t))
        if view.data_ptr() != t.data_ptr() or not view.is_contiguous():
            return None  # not a view: loading into it would not reach t
        return view, lambda: None


class _Zero(_Leaf):
    """A ``ZeroState``: per slot and parameter leaf, one sharded entry (or a scalar)."""

    def __init__(self, key: str, state: ZeroState, *, fresh: bool) -> None:
        self.key, self.entries = key, {}
        slots = {
            name: [[_fresh(t) if fresh else t for t in seg] for seg in per_bucket]
            for name, per_bucket in state.slots.items()
        }
        self.state = ZeroState(slots, state.shards)
        shards = state.shards
        # Pieces are saved in each leaf's memory order: saved with it, checked at load.
        self.orders_key = f"{key}.memory_orders"
        self.orders = {
            shards.paths[i]: part.bucket.order(j)
            for part in shards.parts
            for j, i in enumerate(part.bucket.indices)
        }
        # A string: DCP would flatten a dict into one entry per key.
        self.entries[self.orders_key] = json.dumps({k: list(v) for k, v in self.orders.items()})
        self.pieces: dict[str, tuple[Any, torch.Tensor, tuple[int, ...]]] = {}
        # Every rank's entries, not only the pieces this rank reads: what it stands for.
        self.covers = {
            f"{key}{f'[{name!r}]' if name else ''}{path}" for name in slots for path in shards.paths
        }
        for name, per_bucket in slots.items():
            for part, values in zip(shards.parts, per_bucket, strict=True):
                for seg, t in zip(part.segments, values, strict=True):
                    if isinstance(t, torch.Tensor):
                        # The slot "" is the parameters themselves (fully sharded).
                        slot = f"[{name!r}]" if name else ""
                        entry = f"{key}{slot}{shards.paths[seg.leaf]}"
                        self.entries[entry] = _piece(shards, seg, t)
                        self.pieces[entry] = (seg, t, part.bucket.order(seg.j))

    def result(self, entries: dict[str, Any]) -> Any:
        return self.state

    def once(self) -> dict[str, Any]:
        # Each rank writes its own pieces, and a 0-d step of the leaves it holds
        # pieces of (the ranks holding one step each, alike: one optimizer);
        # the layout record is every rank's.
        return {self.orders_key: self.entries[self.orders_key]}

    def check_orders(self, call: str, saved: Any) -> None:
        """Refuses a ZeroState saved with leaves laid out otherwise (channels_last vs not)."""
        saved = json.loads(saved) if isinstance(saved, str) else {}
        for path, order in self.orders.items():
            was = saved.get(path, order)
            if tuple(was) != tuple(order):
                raise ValueError(
                    f"{call}: `like` leaf like{self.key} (a ZeroState) holds parameter {path} "
                    f"in memory order {tuple(order)}; the checkpoint saved its pieces in memory "
                    f"order {tuple(was)} (e.g. channels_last vs contiguous): give the "
                    "parameters the saving run's memory format before zero.init"
                )

    def reshaped(self, key: str, saved: TensorStorageMetadata) -> Reshaped | None:
        """An unsharded entry (the whole leaf) read whole, then this rank's pieces copied."""
        found = self.pieces.get(key)
        if found is None or found[1].dim() != 1:
            return None
        seg, piece, order = found
        dtype = saved.properties.dtype
        width = 2 if dtype is not None and dtype.is_complex else 1
        if saved.size.numel() * width != self.state.shards.numel[seg.leaf]:
            return None
        whole = torch.empty(saved.size, dtype=dtype, device=piece.device)

        def fill() -> None:
            piece.copy_(_bucket.memory_flat(whole, order)[seg.lo : seg.hi])

        return whole, fill


def _holds_data(t: torch.Tensor) -> bool:
    """Whether ``t`` has its elements (not a parameter ``fsdp.wrap`` released)."""
    return t.numel() == 0 or t.untyped_storage().nbytes() > 0


def _fresh(t: Any) -> Any:
    return torch.empty_like(t) if isinstance(t, torch.Tensor) else t


def _piece(shards: Shards, seg: Any, t: torch.Tensor) -> torch.Tensor:
    """Segment ``seg``'s tensor ``t`` as DCP should see it.

    A tensor of the segment's length is this rank's piece of the leaf's
    elements; any other (a 0-d step) is the same on every rank holding the
    leaf, and is written once.
    """
    if t.dim() != 1 or t.numel() != seg.hi - seg.lo:
        return t.detach()
    return _compat.sharded_tensor(
        [(t.detach(), seg.lo)],
        list(shards.placements[seg.leaf]),
        shards.numel[seg.leaf],
        t.dtype,
        shards.group,
    )


def _leaves(call: str, arg: str, tree: Any, *, fresh: bool) -> tuple[Any, list[_Leaf]]:
    flat, spec = optree.tree_flatten(
        tree, is_leaf=lambda x: isinstance(x, ZeroState), none_is_leaf=True
    )
    paths = [
        a.codify("")
        for a in optree.tree_accessors(
            tree, is_leaf=lambda x: isinstance(x, ZeroState), none_is_leaf=True
        )
    ]
    out: list[_Leaf] = []
    for key, value in zip(paths, flat, strict=True):
        if key.startswith(_RNG):
            raise ValueError(f"{call}: `{arg}` leaf {arg}{key}: the prefix {_RNG} is fdp's")
        if isinstance(value, ZeroState):
            out.append(_Zero(key, value, fresh=fresh))
        elif isinstance(value, torch.Tensor):
            if value.layout != torch.strided:
                raise TypeError(
                    f"{call}: `{arg}` leaf {arg}{key} expected a dense tensor; got layout "
                    f"{value.layout}"
                )
            out.append(_Tensor(key, value, fresh=fresh))
        else:
            out.append(_Leaf(key, value))
    return spec, out


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
