"""LocalSGD and DiLoCo over parameter trees: local inner steps, a rare averaged outer step.

Each worker (a rank, or a replica group under :class:`FaultTolerance`)
takes ``sync_every`` steps of its own inner optimizer on its own data. Then
the workers average their *pseudo-gradient*, the distance travelled since
the last synchronisation (``anchor - params``), and an outer optimizer
steps the shared anchor with it; every worker continues from the new
anchor. Communication is one all-reduce of the parameters' size every
``sync_every`` steps instead of every step (DiLoCo, Douillard et al. 2023;
LocalSGD is the outer step ``anchor - mean`` of plain averaging).

Streaming DiLoCo (Douillard et al. 2025) cuts the tree into fragments that
synchronise at staggered steps (:mod:`fdp._ft._fragments`), each with its
own outer optimizer state; with ``overlap`` a fragment's reduction runs
while inner steps go on and lands ``overlap`` steps later, mixed with the
local fragment by ``alpha``; its pseudo-gradient may travel block-quantized
(:mod:`fdp._ft._exchange`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import optree
import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from fdp import _mode, _tree
from fdp._comm import _agreement
from fdp._ft import _diloco_join, _exchange, _fragments
from fdp._ft._fault_tolerance import FaultTolerance
from fdp.optim._base import OptimizerProtocol
from fdp.optim._rules import sgd

__all__ = ["DiLoCo", "LocalSGD"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class DiLoCo:
    """DiLoCo: any fdp optimizer inside, an outer fdp optimizer every ``sync_every`` steps.

    ``init(params)`` and ``update(grads, state, params) -> (params, state)``
    have the shape of an ``fdp.optim`` optimizer, so a training loop swaps
    one for the other. ``update`` runs the inner optimizer on this worker's
    gradients (local: nothing is communicated) and, at every
    ``sync_every``-th call, the synchronisation: the pseudo-gradients
    ``anchor - params`` averaged over the workers, the outer optimizer's
    step of the anchor with them, and the new anchor as every worker's
    parameters. The inner optimizer's state stays each worker's own, as in
    the paper.

    Streaming DiLoCo: with ``fragments=P`` the tree is cut into ``P``
    fragments, fragment ``i`` synchronising after the inner steps ``c``
    (counted from 1) with ``c % sync_every == i * sync_every // P``, each
    with its own outer optimizer state: a step moves at most one fragment's
    bytes. With ``overlap=tau`` a fragment's reduction is started at its step
    and the inner steps go on; ``tau`` steps later the outer step is taken
    and the fragment becomes ``alpha * local + (1 - alpha) * anchor``.

    Every worker must call ``update`` the same number of times (equal
    shards), or run its loop inside :meth:`join`; a synchronisation checks
    that their counts agree and raises on every worker if not. A reduction
    in flight is held by this object; the state keeps the pseudo-gradient it
    sent, so a state saved mid-flight resumes (the reduction is run again,
    blocking, where it lands).

    Args:
        inner: the inner optimizer (any ``fdp.optim`` optimizer, e.g. AdamW).
        outer: the outer optimizer, stepping the anchor with the averaged
            pseudo-gradient; default Nesterov SGD (lr 0.7, momentum 0.9), the
            paper's.
        sync_every: inner steps between synchronisations (the paper's H).
        group: whom to average with: a ``torch.distributed`` process group
            (default: the world), or a :class:`FaultTolerance`, whose live
            replica groups are the workers; then each synchronising ``update``
            runs inside ``FaultTolerance.step`` (see :meth:`syncs`).
        sync_dtype: the pseudo-gradient on the wire: a floating dtype (e.g.
            ``torch.bfloat16``: half the bytes of float32), or ``torch.int8``
            or a float8 dtype, block-quantized (256 values per float32 scale)
            and summed in float32 (about 0.25x float32's bytes); default the
            parameters' own.
        fragments: the number of fragments, cut in the tree's order, each
            about an equal share of the elements, each FSDP unit (of
            ``fsdp.shard``'s shards) or default unit (a top-level entry, a
            transformer block) whole; or a tree of ints (each leaf's
            fragment) with the parameters' structure.
        overlap: inner steps between a fragment's reduction starting and its
            outer step (0: at once), below ``sync_every``.
        alpha: the local fragment's weight when an outer step lands (0: take
            the new anchor).

    Example::

        diloco = fdp.DiLoCo(fdp.optim.adamw(1e-3), sync_every=50)
        state = diloco.init(params)
        for x, y in loader:  # this rank's shard
            grads = torch.func.grad(loss)(params, x, y)
            params, state = diloco.update(grads, state, params)
    """

    def __init__(
        self,
        inner: OptimizerProtocol,
        *,
        outer: OptimizerProtocol | None = None,
        sync_every: int,
        group: ProcessGroup | FaultTolerance | None = None,
        sync_dtype: torch.dtype | None = None,
        fragments: int | Any = 1,
        overlap: int = 0,
        alpha: float = 0.0,
    ) -> None:
        call = f"fdp.{type(self).__name__}"
        _check_options(call, inner, outer, sync_every, group, sync_dtype, overlap, alpha)
        if isinstance(fragments, bool) or (
            isinstance(fragments, int) and not 1 <= fragments <= sync_every
        ):
            raise ValueError(
                f"{call}: `fragments` expected an int from 1 to sync_every ({sync_every}) "
                f"or a tree of labels; got {fragments!r}"
            )
        self.inner = inner
        self.outer = outer if outer is not None else sgd(0.7, momentum=0.9, nesterov=True)
        self.sync_every, self.group, self.sync_dtype = sync_every, group, sync_dtype
        self.fragments, self.overlap, self.alpha = fragments, overlap, float(alpha)
        self._flying: dict[int, tuple[int, _exchange.Exchange]] = {}
        self._joined: _diloco_join.Joined | None = None

    def __repr__(self) -> str:
        return f"fdp.{type(self).__name__}({self.inner!r}, sync_every={self.sync_every})"

    def init(self, params: Any) -> dict[str, Any]:
        """The inner and outer optimizers' states, the anchor (a copy of ``params``), the
        count, each leaf's fragment and the reductions in flight (none)."""
        call = f"fdp.{type(self).__name__}.init"
        labels = _fragments.fragment_of(params, self.fragments, call=call)
        _same_start(call, params, self.group)
        anchor = optree.tree_map(_copy, params, none_is_leaf=True)
        count = int(labels.max()) + 1 if bool((labels >= 0).any()) else 1
        if count > self.sync_every:
            raise ValueError(
                f"{call}: `fragments` expected at most sync_every ({self.sync_every}) "
                f"fragments; got {count}"
            )
        outer = [self.outer.init(_masked(anchor, labels, i)) for i in range(count)]
        self._flying.clear()
        sizes = [int((labels == i).sum()) for i in range(count)]
        return {
            "inner": self.inner.init(params),
            "outer": outer[0] if count == 1 else outer,
            "anchor": anchor,
            "count": torch.zeros((), dtype=torch.int64),
            "fragments": labels,
            # One slot per fragment, the same tree whether or not a reduction is in
            # flight (a replica group heals into a peer's state of its own form).
            "in_flight": [_idle(n) for n in sizes],
        }

    def syncs(self, state: dict[str, Any]) -> bool:
        """Whether the next :meth:`update` starts or lands a fragment's reduction (under
        :class:`FaultTolerance`, run it inside ``FaultTolerance.step``; the other updates
        run outside)."""
        count = int(state["count"]) + 1
        return bool(self._landing(state, count)) or bool(self._starting(state, count))

    @contextmanager
    def join(self, params: Any, state: dict[str, Any]) -> Iterator[_diloco_join.Joined]:
        """Lets workers with different numbers of batches train on (torch's ``Join``).

        Each rank runs its own loop of :meth:`update` inside the block,
        starting from ``params`` and ``state``. A rank that runs out of data
        leaves its loop; on leaving the block it mirrors the others'
        synchronisations, sending zeros, and each is averaged over the
        workers still training (what they sent, over their number); it takes
        every outer step too, so its anchor stays the others'. When a
        synchronisation finds no worker training, the block ends everywhere,
        after the reductions still in flight have landed. Read the latest
        parameters and state in ``joined.params`` and ``joined.state``. Over
        a process group only (a :class:`FaultTolerance` leaves a replica
        group out of the quorum instead).

        Example::

            with diloco.join(params, state) as joined:
                for x, y in my_uneven_shard:
                    grads = torch.func.grad(loss)(params, x, y)
                    params, state = diloco.update(grads, state, params)
            params, state = joined.params, joined.state
        """
        call = f"fdp.{type(self).__name__}.join"
        if self._joined is not None:
            raise RuntimeError(f"{call}: already inside join")
        if isinstance(self.group, FaultTolerance):
            raise ValueError(
                f"{call}: expected a process group as `group`; got a FaultTolerance, whose "
                "replica groups leave the quorum when they stop (no join needed)"
            )
        self._joined = joined = _diloco_join.Joined(params, state)
        try:
            yield joined
            _diloco_join.mirror(self, joined)
        finally:
            self._joined = None

    def update(self, grads: Any, state: dict[str, Any], params: Any) -> tuple[Any, dict[str, Any]]:
        """One inner step; then the fragments' reductions that land or start at it.

        Returns:
            ``(params, state)``: after a fragment's outer step, its leaves in
            ``params`` are the new anchor's (mixed with the local by ``alpha``).
        """
        if _mode.transform_running():
            raise RuntimeError(
                f"fdp.{type(self).__name__}.update: expected a call outside torch.func "
                "transforms; got one inside grad, vjp, jvp or vmap. Its synchronisations are "
                "collectives on concrete tensors: call it on the gradients the transform returned"
            )
        count = int(state["count"]) + 1
        if "in_flight" not in state:  # a state saved before Streaming DiLoCo: one fragment
            n = len(_indices(state, 0, len(_tree.flatten(state["anchor"])[0])))
            state = {**state, "in_flight": [_idle(n)]}
        params, inner = self.inner.update(grads, state["inner"], params)
        state = {**state, "inner": inner, "count": state["count"] + 1}
        params, state, _ = self._communicate(state, params, count, training=True)
        if self._joined is not None:
            self._joined.params, self._joined.state = params, state
        return params, state

    def _communicate(
        self, state: dict[str, Any], params: Any, count: int, *, training: bool
    ) -> tuple[Any, dict[str, Any], bool]:
        """After inner step ``count``: the reductions that land, advance or start at it.

        ``training=False``: a worker that has left :meth:`join` mirroring the
        others, sending zeros. Returns ``(params, state, ended)``, ``ended``
        when a reduction started here found no worker training (then it is
        dropped).
        """
        starting, ended = self._starting(state, count), False
        with torch.no_grad():
            for i in self._landing(state, count):
                params, state = self._land(i, state, params)
            for i, slot in enumerate(state["in_flight"]):
                held = self._flying.get(i)
                if slot["started"] >= 0 and held is not None and held[0] == slot["started"]:
                    held[1].advance()  # a quantized reduction's second phase
            for i in starting:
                state = self._start(i, state, params, count, training=training)
                if not training and self._flying[i][1].training() == 0.0:
                    self._flying.pop(i)[1].wait(count)  # every worker has left: nothing to land
                    state = _with_slot(state, i, _idle(len(state["in_flight"][i]["delta"])))
                    ended = True
                elif self.overlap == 0:
                    params, state = self._land(i, state, params)
        return params, state, ended

    def _landing(self, state: dict[str, Any], count: int) -> list[int]:
        slots = state.get("in_flight", [])
        return [
            i
            for i, s in enumerate(slots)
            if s["started"] >= 0 and s["started"] + self.overlap == count
        ]

    def _starting(self, state: dict[str, Any], count: int) -> list[int]:
        labels = state.get("fragments")
        total = 1 if labels is None else max(1, int(labels.max()) + 1)
        at = _fragments.offsets(total, self.sync_every)
        return [i for i in range(total) if count % self.sync_every == at[i]]

    def _start(
        self, i: int, state: dict[str, Any], params: Any, count: int, *, training: bool
    ) -> dict[str, Any]:
        """Fragment ``i``'s pseudo-gradient sent; kept in its slot (for a resume)."""
        anchor, _ = _tree.flatten(state["anchor"])
        leaves, _ = _tree.flatten(params)
        index = _indices(state, i, len(leaves))
        deltas = [
            anchor[k] - leaves[k].detach() if training else torch.zeros_like(anchor[k])
            for k in index
        ]
        # An abandoned state's reduction (a discarded step, an old state used again):
        # dropped; its collectives finish on their own.
        self._flying.pop(i, None)
        call = f"fdp.{type(self).__name__}.update"
        exchange = _exchange.start(
            deltas, count, wire=self.sync_dtype, group=self.group, call=call, training=training
        )
        self._flying[i] = (count, exchange)
        return _with_slot(state, i, {"started": count, "delta": deltas})

    def _land(self, i: int, state: dict[str, Any], params: Any) -> tuple[Any, dict[str, Any]]:
        """The fragment's averaged pseudo-gradient, its outer step, the mixed parameters."""
        slot = state["in_flight"][i]
        started = slot["started"]
        held = self._flying.pop(i, None)
        if held is not None and held[0] == started and held[1].current():
            exchange = held[1]
        else:  # a saved state resumed, a quorum changed: the same reduction again, on every worker
            call = f"fdp.{type(self).__name__}.update"
            training = self._joined is None or not self._joined.mirroring
            # A loaded state's deltas may have come back on the CPU (fdp.load_checkpoint
            # of a fresh state, whose slot held None): the anchor's devices.
            anchor, _ = _tree.flatten(state["anchor"])
            index = _indices(state, i, len(anchor))
            deltas = [d.to(anchor[k].device) for d, k in zip(slot["delta"], index, strict=True)]
            exchange = _exchange.start(
                deltas,
                started,
                wire=self.sync_dtype,
                group=self.group,
                call=call,
                training=training,
            )
        state = _with_slot(state, i, _idle(len(slot["delta"])))
        averaged = exchange.wait(started)
        anchor, spec = _tree.flatten(state["anchor"])
        leaves, _ = _tree.flatten(params)
        index = _indices(state, i, len(leaves))
        pseudo: list[Any] = [None] * len(leaves)
        for k, d in zip(index, averaged, strict=True):
            pseudo[k] = d.to(anchor[k].dtype)
        outers = state["outer"] if isinstance(state["outer"], list) else [state["outer"]]
        masked = _masked(state["anchor"], state["fragments"], i)
        stepped, outer = self.outer.update(_tree.unflatten(spec, pseudo), outers[i], masked)
        stepped_leaves, _ = _tree.flatten(stepped)
        for k in index:
            anchor[k] = stepped_leaves[k]
            leaves[k] = _mix(leaves[k], stepped_leaves[k], self.alpha)
        outers = [*outers[:i], outer, *outers[i + 1 :]]
        new_outer = outers[0] if len(outers) == 1 else outers
        new_state = {**state, "anchor": _tree.unflatten(spec, anchor), "outer": new_outer}
        return _tree.unflatten(spec, leaves), new_state


def _check_options(
    call: str,
    inner: Any,
    outer: Any,
    sync_every: Any,
    group: Any,
    sync_dtype: Any,
    overlap: Any,
    alpha: Any,
) -> None:
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise ValueError(f"{call}: `sync_every` expected a positive int; got {sync_every!r}")
    if sync_dtype is not None and sync_dtype not in (*_FLOATS, *_exchange.QUANTIZED):
        raise TypeError(
            f"{call}: `sync_dtype` expected a floating-point dtype, torch.int8, a float8 "
            f"dtype or None; got {sync_dtype!r}"
        )
    for name, opt in (("inner", inner), ("outer", outer)):
        if opt is not None and not (hasattr(opt, "init") and hasattr(opt, "update")):
            raise TypeError(
                f"{call}: `{name}` expected an fdp.optim optimizer (init and update); "
                f"got {type(opt).__name__}"
            )
    if isinstance(overlap, bool) or not isinstance(overlap, int) or not 0 <= overlap < sync_every:
        raise ValueError(
            f"{call}: `overlap` expected an int from 0 to sync_every - 1 ({sync_every - 1}); "
            f"got {overlap!r}"
        )
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 <= alpha <= 1:
        raise ValueError(f"{call}: `alpha` expected a float in [0, 1]; got {alpha!r}")
    if isinstance(group, FaultTolerance):
        _check_fault_tolerance(call, group, sync_dtype)


def _check_fault_tolerance(call: str, group: FaultTolerance, sync_dtype: Any) -> None:
    if group.init_sync:
        raise ValueError(
            f"{call}: `group` expected a FaultTolerance made with init_sync=False; got one "
            "that copies one replica group's state to all at the first synchronisation, "
            "which would discard the other workers' first local steps"
        )
    if sync_dtype in _exchange.QUANTIZED:
        raise ValueError(
            f"{call}: `sync_dtype` expected a floating-point dtype with a FaultTolerance "
            f"`group` (its all-reduce carries no quantized wire); got {sync_dtype}"
        )


def _idle(n: int) -> dict[str, Any]:
    """A fragment's slot with nothing in flight: ``n`` None where the deltas go."""
    return {"started": -1, "delta": [None] * n}


def _with_slot(state: dict[str, Any], i: int, slot: dict[str, Any]) -> dict[str, Any]:
    slots = list(state["in_flight"])
    slots[i] = slot
    return {**state, "in_flight": slots}


def _indices(state: dict[str, Any], i: int, n: int) -> list[int]:
    labels = state.get("fragments")
    if labels is None:  # a state from before fragments: one
        leaves, _ = _tree.flatten(state["anchor"])
        return [k for k in range(n) if isinstance(leaves[k], torch.Tensor)]
    return [k for k, v in enumerate(labels.tolist()) if v == i]


def _masked(tree: Any, labels: torch.Tensor | None, i: int) -> Any:
    """``tree`` with ``None`` in place of every leaf outside fragment ``i``."""
    leaves, spec = _tree.flatten(tree)
    if labels is None:
        return tree
    keep = labels.tolist()
    return _tree.unflatten(spec, [x if keep[k] == i else None for k, x in enumerate(leaves)])


def _mix(local: Any, anchor: Any, alpha: float) -> Any:
    if alpha == 0.0:
        return anchor.detach().clone()
    return (alpha * local.detach() + (1.0 - alpha) * anchor).to(anchor.dtype)


class LocalSGD(DiLoCo):
    """LocalSGD: ``sync_every`` local steps, then every worker takes the workers' mean.

    DiLoCo with the outer step ``anchor - mean(anchor - params)``, i.e. plain
    SGD with learning rate 1 and no momentum: the parameters are averaged.

    Example::

        local = fdp.LocalSGD(fdp.optim.sgd(0.1), sync_every=8)
        state = local.init(params)
        params, state = local.update(grads, state, params)
    """

    def __init__(
        self,
        inner: OptimizerProtocol,
        *,
        sync_every: int,
        group: ProcessGroup | FaultTolerance | None = None,
        sync_dtype: torch.dtype | None = None,
        fragments: int | Any = 1,
        overlap: int = 0,
        alpha: float = 0.0,
    ) -> None:
        super().__init__(
            inner,
            outer=sgd(1.0),
            sync_every=sync_every,
            group=group,
            sync_dtype=sync_dtype,
            fragments=fragments,
            overlap=overlap,
            alpha=alpha,
        )


def _copy(t: Any) -> Any:
    return t.detach().clone() if isinstance(t, torch.Tensor) else t


def _same_start(call: str, params: Any, group: ProcessGroup | FaultTolerance | None) -> None:
    """Refuses, on every worker, parameters that differ across the workers of ``group``.

    Each worker's outer step moves its own anchor by the mean pseudo-gradient:
    anchors that start apart stay apart, and the workers train different
    models without an error. One all-reduce of checksums, at init, over a
    process group (a ``FaultTolerance``'s replica groups heal from a peer).
    """
    if isinstance(group, FaultTolerance) or not (dist.is_available() and dist.is_initialized()):
        return
    if dist.get_world_size(group) == 1:
        return
    leaves = _tree.flatten(params)[0]
    described = _agreement.signature(params, leaves, "params", requires_grad=False)
    _agreement.check(described, group=group, call=call, arg="params")
    tensors = [t.detach() if isinstance(t, torch.Tensor) else None for t in leaves]
    _agreement.check_values(
        tensors,
        _tree.paths(params, "params"),
        group=group,
        call=call,
        arg="params",
        fix="Give every worker the same parameters before init: fdp.broadcast_params(params) "
        "(rank 0's), or the same seed on every rank",
        when="at init",
    )
