"""Per-step fault tolerance across replica groups, on a torchft ``Manager``.

torchft (PyTorch's fault-tolerance engine, an optional extra: ``fdp[ft]``)
forms a quorum of the live replica groups at every step through its
lighthouse, all-reduces across them, decides together whether the step
counts (``should_commit``) and heals a replica that (re)joins from a live
peer. fdp adds what its functional design makes simple: a step is a pure
function of the training-state tree, so discarding a step is keeping the old
tree, and healing is replacing the tree with a peer's.

This module never imports torchft: :class:`FaultTolerance` drives any object
with the Manager's methods, and :func:`connect` (``FaultTolerance.connect``)
imports it only when called.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol, TypeVar

import torch

from fdp import _bucket, _compat, _mode, _tree
from fdp._comm._comm_hooks import GradBucket
from fdp._ft import _healing, _torchft

__all__ = ["FaultTolerance", "ManagerLike", "PendingMean"]

T = TypeVar("T")


class ManagerLike(Protocol):
    """What fdp uses of a ``torchft.Manager``."""

    def start_quorum(self) -> None: ...
    def allreduce(self, tensor: torch.Tensor) -> Any: ...
    def should_commit(self) -> bool: ...
    def report_error(self, e: Exception) -> None: ...
    def errored(self) -> Any: ...
    def num_participants(self) -> int: ...
    def current_step(self) -> int: ...
    def register_state_dict_fn(
        self, key: str, load_state_dict: Callable[[Any], None], state_dict: Callable[[], Any]
    ) -> None: ...
    def shutdown(self, wait: bool = ...) -> None: ...


class FaultTolerance:
    """Data parallelism across replica groups that survives losing some of them.

    Wraps a ``torchft.Manager`` (one per process; its ``pg`` connects the
    processes of the same group rank across replica groups). Each
    :meth:`step` of a training loop:

    1. joins the quorum of live replica groups; a replica group that is
       behind (restarted, or joining late) first takes the training state of
       a live peer, bitwise, through torchft's checkpoint transport;
    2. runs ``fn(state) -> new_state``, whose :meth:`all_reduce_grads` (or a
       ``DistributedDataParallel`` with :meth:`comm_hook`) averages gradients
       over the live replica groups;
    3. agrees on the outcome: if any live replica group reported an error in
       the step, every one of them discards it (the old tree is kept);
       otherwise every one commits ``new_state``.

    A replica group that dies mid-step makes the survivors' collectives fail,
    so they discard that step and continue from the next quorum without it:
    no restart, no committed step lost. The state tree should hold all that a
    peer needs to continue (parameters, optimizer state with its step count,
    the data position); leaves are tensors, numbers or strings.

    Args:
        manager: a ``torchft.Manager`` with ``use_async_quorum=False`` (healing
            happens before the step runs). :meth:`connect` makes one.
        bucket_cap_mb: the size of :meth:`all_reduce_grads`' buckets in MiB.

    Example::

        ft = fdp.FaultTolerance.connect("http://lighthouse:29510", replica_id="r0")

        def train_step(state):
            grads = torch.func.grad(loss)(state["params"], batch_at(state["data"]))
            grads = ft.all_reduce_grads(grads)
            params, opt = optimizer.update(grads, state["opt"], state["params"])
            return {"params": params, "opt": opt, "data": state["data"] + 1}

        while ft.current_step() < steps:
            state = ft.step(train_step, state)
    """

    def __init__(self, manager: ManagerLike, *, bucket_cap_mb: float = _bucket.BUCKET_CAP_MB):
        call = "fdp.FaultTolerance"
        if getattr(manager, "_use_async_quorum", False):
            raise ValueError(
                f"{call}: `manager` expected a torchft.Manager made with "
                "use_async_quorum=False; got an asynchronous quorum, which heals a replica "
                "only after its step ran on the old state"
            )
        if not (isinstance(bucket_cap_mb, (int, float)) and bucket_cap_mb > 0):
            raise ValueError(
                f"{call}: `bucket_cap_mb` expected a positive number; got {bucket_cap_mb!r}"
            )
        self.manager = manager
        self.init_sync = _torchft.init_sync(manager)
        self._cap = max(1, int(bucket_cap_mb * _bucket.MB))
        self._heal = _healing.Healing()
        self._in_step = False
        self._store: Any = None  # the TCP store connect() started, kept alive with the manager
        self._closed = False
        manager.register_state_dict_fn("fdp", self._heal.load, self._heal.save)

    @classmethod
    def connect(
        cls,
        lighthouse: str,
        *,
        replica_id: str,
        min_replicas: int = 1,
        group_rank: int = 0,
        group_world_size: int = 1,
        timeout: timedelta = timedelta(seconds=60),
        pg: Any = None,
        init_sync: bool = True,
        bucket_cap_mb: float = _bucket.BUCKET_CAP_MB,
    ) -> FaultTolerance:
        """Joins the job of the torchft lighthouse at ``lighthouse`` (imports torchft).

        Args:
            lighthouse: the lighthouse's address, ``"http://host:port"``.
            replica_id: this replica group's name, the same on its processes.
            min_replicas: the fewest replica groups a step may commit with.
            group_rank: this process's rank inside its replica group.
            group_world_size: the processes in the replica group (above one,
                torchrun's MASTER_ADDR/MASTER_PORT name the group's store).
            timeout: for connecting, the quorum and every collective.
            pg: the process group across replica groups (default: a
                ``torchft.ProcessGroupGloo``).
            init_sync: every replica group starts from one peer's state at the
                first step, as DDP broadcasts at construction. ``False`` for
                :class:`DiLoCo`, whose first step comes after local steps.
            bucket_cap_mb: as in the constructor.

        Raises:
            ImportError: torchft is not installed.
            ConnectionError: the lighthouse cannot be reached.
        """
        manager, store = _torchft.make_manager(
            lighthouse,
            replica_id=replica_id,
            min_replicas=min_replicas,
            group_rank=group_rank,
            group_world_size=group_world_size,
            timeout=timeout,
            pg=pg,
            init_sync=init_sync,
            call="fdp.FaultTolerance.connect",
        )
        ft = cls(manager, bucket_cap_mb=bucket_cap_mb)
        ft._store = store
        return ft

    def shutdown(self) -> None:
        """This replica group leaves the job: stops the manager's servers and threads and
        shuts its process group down, waiting for collectives and callbacks in flight.

        Call it (or use the object in a ``with`` block) before the process
        exits: a gradient callback still running on a gloo thread at exit
        aborts the process. A second call does nothing.
        """
        if self._closed:
            return
        self._closed = True
        _torchft.shutdown(self.manager)
        self._store = None

    def __enter__(self) -> FaultTolerance:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def current_step(self) -> int:
        """How many steps the live replica groups have committed (a healed one included)."""
        return self.manager.current_step()

    def participants(self) -> int:
        """How many replica groups take part in the current step."""
        return self.manager.num_participants()

    def step(self, fn: Callable[[T], T], state: T) -> T:
        """One fault-tolerant step: quorum (and healing), ``fn(state)``, commit or discard.

        Args:
            fn: the step, a function of the state tree returning the next one;
                its gradients go through :meth:`all_reduce_grads` or a DDP
                with :meth:`comm_hook`.
            state: the committed training state.

        Returns:
            ``fn``'s new state if every live replica group commits the step;
            else the state the step started from (after healing, a peer's).
        """
        if self._in_step:
            raise RuntimeError("fdp.FaultTolerance.step: called inside another step's `fn`")
        self._heal.offer(state)  # what a peer that heals during this quorum receives
        self.manager.start_quorum()
        state = self._heal.take(state, call="fdp.FaultTolerance.step")
        self._in_step = True
        try:
            new = fn(state)
        finally:
            self._in_step = False
        return new if self._agree() else state

    def _agree(self) -> bool:
        """Every live replica group's same answer: commit only if none reported an error."""
        flag = torch.zeros(1, dtype=torch.float64)
        if self.manager.errored() is not None:
            flag += 1
        # A replica that died during the exchange makes it fail: discard here too.
        _torchft.wait(self.manager, _torchft.sum_async(self.manager, flag))
        if flag.item() > 0 and self.manager.errored() is None:
            self.manager.report_error(
                RuntimeError("another replica group reported an error in this step")
            )
        return self.manager.should_commit()

    def all_reduce_grads(self, grads: T) -> T:
        """Averages a gradient tree over the live replica groups (inside :meth:`step`'s ``fn``).

        Tensor leaves are packed into flat buffers by device and dtype, in
        reverse leaf order, and each buffer is averaged through the manager
        (divided by the number of participants). ``None`` leaves stay ``None``
        and must be ``None`` on every replica group. Runs eagerly: in a
        compiled function it is a graph break, the reduction outside the
        graph.

        Args:
            grads: a pytree of floating-point tensors and ``None``.

        Returns:
            A tree of ``grads``' structure with the averaged tensors.
        """
        call = "fdp.FaultTolerance.all_reduce_grads"
        if not self._in_step:
            raise RuntimeError(
                f"{call}: called outside FaultTolerance.step; the average is over the replica "
                "groups of one step's quorum, so call it inside the step's `fn`"
            )
        reduced: T = _all_reduce(self.manager, grads, self._cap, call)
        return reduced

    def mean_start(self, tensors: list[torch.Tensor]) -> PendingMean:
        """Starts averaging ``tensors`` in place over the live replica groups (inside a step).

        For a reduction that lands in a later step (Streaming DiLoCo's
        ``overlap``): wait for it inside that step. If the quorum changed in
        between (a replica group lost or healed), :meth:`PendingMean.current`
        is False on every replica group of the new quorum and the caller
        starts again; a failure is the waiting step's error (discarded
        everywhere at its commit).
        """
        if not self._in_step:
            raise RuntimeError(
                "fdp.FaultTolerance.mean_start: called outside FaultTolerance.step; the average "
                "is over the replica groups of a step's quorum"
            )
        return PendingMean(self.manager, tensors)

    @staticmethod
    def comm_hook(state: FaultTolerance, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        """A DDP comm hook averaging each bucket over the live replica groups.

        For ``fdp.DistributedDataParallel`` (or torch's) inside a replica group
        of one process: ``ddp.register_comm_hook(ft, fdp.FaultTolerance.comm_hook)``.
        Each bucket's sum starts when the bucket is full and is waited for at
        the end of backward, as DDP's own; a failure is the step's error (it
        is discarded everywhere), not an exception. Every leaf must get a
        gradient on every replica group (a leaf one replica group leaves
        unused would be ``None`` there only); use :meth:`all_reduce_grads`
        when that cannot be promised.
        """
        return _torchft.mean_future(state.manager, bucket.buffer())


class PendingMean:
    """An average over a step's quorum under way (:meth:`FaultTolerance.mean_start`)."""

    def __init__(self, manager: ManagerLike, tensors: list[torch.Tensor]) -> None:
        self.manager, self.tensors = manager, tensors
        self.quorum = _torchft.quorum_id(manager)
        scale = 1.0 / manager.num_participants()
        with torch.no_grad():
            for t in tensors:
                t.mul_(scale)
            self._works = [_torchft.sum_async(manager, t) for t in tensors]

    def current(self) -> bool:
        """Whether the quorum it was started in is still the live one."""
        return _torchft.quorum_id(self.manager) == self.quorum

    def wait(self) -> list[torch.Tensor]:
        """The averaged tensors; a failure is reported to the manager (the step discards)."""
        for work in self._works:
            _torchft.wait(self.manager, work)
        self._works = []
        return self.tensors

    def trusted(self) -> bool:
        """Whether nothing failed in this step: the values mean something."""
        return self.manager.errored() is None


# It issues its one sum when called: DDP may have several buckets in flight.
FaultTolerance.comm_hook.fdp_one_collective = True  # type: ignore[attr-defined]


def _all_reduce_eager(manager: ManagerLike, grads: T, cap: int, call: str) -> T:
    """The bucketed average over the quorum, with one check that the trees agree.

    The sums run on the manager's process group directly: a replica group
    whose manager has an error still joins every collective (the manager
    would skip them, and the others would wait for it until their timeout);
    the error discards the step everywhere at the commit.
    """
    leaves, spec, tensors = _tree.tensor_leaves(grads, call=call, arg="grads", float_only=False)
    if _mode.transformed(tensors):
        raise TypeError(
            f"{call}: `grads` expected gradients (plain tensors); got tensors a torch.func "
            "transform is tracing. torchft's collectives have no derivative rules: call it "
            "on the gradients the transform returns, e.g. "
            "ft.all_reduce_grads(torch.func.grad(loss)(params, batch))"
        )
    for i, t in enumerate(tensors):
        if t is not None and not (t.is_floating_point() or t.is_complex()):
            raise TypeError(
                f"{call}: `grads` leaf {_tree.path(grads, i, 'grads')} expected a floating-point "
                f"tensor; got {_tree.describe(t)}"
            )
    signature = _signature(grads, tensors)
    scale = 1.0 / manager.num_participants()
    out = list(leaves)
    with torch.no_grad():
        check = torch.tensor([1.0, signature, signature**2], dtype=torch.float64) * scale
        works = [_torchft.sum_async(manager, check)]
        for bucket in _bucket.plan(tensors, cap_bytes=cap):
            flat = bucket.pack([tensors[i] for i in bucket.indices], scale=scale)
            works.append(_torchft.sum_async(manager, flat))
            for i, view in zip(bucket.indices, bucket.views(flat), strict=True):
                out[i] = view
        for work in works:
            _torchft.wait(manager, work)
    _check_agreement(check, manager, call)
    reduced: T = _tree.unflatten(spec, out)
    return reduced


# torchft's collectives cannot be traced: in a compiled function, a graph break.
_all_reduce = _compat.compiler_disable(
    _all_reduce_eager, reason="fdp.FaultTolerance reduces through torchft, outside the graph"
)


def _signature(grads: Any, tensors: list[torch.Tensor | None]) -> float:
    """A small integer naming the tree's paths, shapes and dtypes (exact in float64)."""
    described = [
        (p, None if t is None else (tuple(t.shape), str(t.dtype)))
        for p, t in zip(_tree.paths(grads, "grads"), tensors, strict=True)
    ]
    return float(zlib.crc32(repr(described).encode()) % (1 << 20))


def _check_agreement(check: torch.Tensor, manager: ManagerLike, call: str) -> None:
    """Averaged ``[1, s, s^2]``: the trees agree iff mean(s)^2 == mean(s^2)."""
    if manager.errored() is not None:
        return  # the step is discarded anyway; its values mean nothing
    _, mean, mean_square = check.tolist()
    if not math.isclose(mean * mean, mean_square, rel_tol=1e-9, abs_tol=1e-6):
        raise ValueError(
            f"{call}: `grads` expected the same tree (paths, shapes, dtypes, None leaves) on "
            "every replica group; got different trees"
        )
