"""``fdp.ZeroRedundancy``: ZeRO stages 1 and 2 for a functional optimizer.

The layout (buckets cut into one slice per rank, segments of leaves) is
``fdp/_sharding/_shards.py``. A step packs each bucket's local gradients, starts
every bucket's reduce-scatter (stage 1: all-reduce), then per bucket waits
for it, updates this rank's segments with the wrapped optimizer and starts
the all-gather of the new slice, so that bucket k's all-gather travels
while bucket k+1 is updated. Eagerly the collectives are
``torch.distributed``'s asynchronous ones; inside ``torch.compile`` the
functional collectives, which dynamo traces and whose waits the compiler
places at first use.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import torch
from torch.distributed import ProcessGroup

from fdp import _bucket, _mode, _sharded, _tree
from fdp._comm import _agreement, _training, _transforms
from fdp._sharding import _owners, _shards, _zero_comm, _zero_join
from fdp._sharding._shards import Part, Shards, ZeroState
from fdp.optim import _base, _clip, _whole
from fdp.optim._base import OptimizerProtocol
from fdp.optim._checks import check_grad, dense_grad

T = TypeVar("T")


class ZeroRedundancy:
    """Shards a functional optimizer's state (and, at stage 2, the reduced gradients).

    Each rank keeps the optimizer state of one slice of every bucket of
    parameters, ``1/world`` of the whole: slices split leaves, and only the
    last rank's slice of a bucket is shorter, by the bucket's padding (fewer
    than ``world`` elements). A step takes
    this rank's *local* gradients (not reduced: do not wrap the loss in
    :class:`fdp.DistributedDataParallel`), reduce-scatters them (stage 2;
    stage 1 all-reduces and keeps a slice), averages, updates this rank's
    slice, and all-gathers the new parameters. Ten steps equal DDP plus the
    same optimizer; ``None`` gradients (on every rank) leave their leaf,
    its step and its slots untouched, as torch does.

    Args:
        optimizer: an ``fdp.optim`` optimizer (``init``/``update``); it
            must act element by element, as SGD and Adam(W) do.
        params: the parameter tree the steps will receive (structure,
            shapes, dtypes, devices, memory layouts); the same on every rank.
        group: the process group (default: the world).
        stage: 2 (reduce-scatter) or 1 (all-reduce, then slice).
        bucket_cap_mb: the size of a bucket in MiB.
        reduce_dtype: the dtype gradients travel in (e.g. ``torch.bfloat16``:
            half float32's bytes); ``None``: their own. Buckets already as
            narrow (or complex) keep theirs.
        sum_dtype: the dtype the reduction adds in (``torch.float32``: each
            rank's chunk added where it lands, so the error does not grow
            with the ranks); ``None``: on the wire, in ``reduce_dtype``.

    Example::

        zero = fdp.ZeroRedundancy(fdp.optim.adamw(1e-3), params)
        state = zero.init(params)
        for batch in loader:
            grads = torch.func.grad(loss)(params, batch)
            params, state = zero.step(grads, state, params)
    """

    def __init__(
        self,
        optimizer: OptimizerProtocol,
        params: Any,
        *,
        group: ProcessGroup | None = None,
        stage: int = 2,
        bucket_cap_mb: float = _bucket.BUCKET_CAP_MB,
        reduce_dtype: torch.dtype | None = None,
        sum_dtype: torch.dtype | None = None,
    ) -> None:
        call = "fdp.ZeroRedundancy"
        with _agreement.local_checks(call, "params", group):  # an error on one rank: on every
            self._wire = _wire(call, reduce_dtype, sum_dtype)
            if not isinstance(optimizer, _base.OptimizerProtocol):
                raise TypeError(
                    f"{call}: `optimizer` expected an fdp.optim optimizer (slots, init and update: "
                    f"fdp.optim.OptimizerProtocol); got {_tree.describe(optimizer)}"
                )
            if isinstance(stage, bool) or stage not in (1, 2):
                raise ValueError(f"{call}: `stage` expected 1 or 2; got {stage!r}")
            cap = _agreement.check_cap(bucket_cap_mb, "bucket_cap_mb", call=call)
            _agreement.require_member(call, group)
            leaves, self._spec, tensors = _tree.tensor_leaves(
                params, call=call, arg="params", float_only=True
            )
            trained = [t if t is not None and t.numel() > 0 else None for t in tensors]
            described = _agreement.signature(params, leaves, "params", requires_grad=False)
        _agreement.check(described, group=group, call=call, arg="params")
        paths = _tree.paths(params, "params")
        _agreement.check_values(tensors, paths, group=group, call=call, arg="params")
        self.optimizer, self.group, self.stage = optimizer, group, stage
        self._planned = _tree.Planned(params, owner="this ZeroRedundancy")
        _sharded.register_local(self, self._planned, group)  # GradScaler.unscale syncs
        # The structure as flatten() gives it while compiling (None: custom nodes).
        self._traced_spec = _tree.traced_spec(params)
        self._trained = [i for i, t in enumerate(trained) if t is not None]
        self.shards: Shards = _shards.plan(params, trained, cap=cap, group=group)
        self._keys = ("step", *optimizer.slots)
        self._part_optimizers = _bind(optimizer, params, self.shards.parts)
        whole = _whole.whole_leaves(call, optimizer, params)  # Muon: each matrix on one owner
        self._owners = _owners.Owners(self.shards, whole, group) if whole else None
        self.last_grad_norm: torch.Tensor | None = None
        self._fingerprints: dict[tuple[bool, ...], _agreement.Fingerprint] = {}
        self._pool = _zero_comm.Pool()
        self._joined: _zero_join.Joined | None = None

    def _in_lockstep(self) -> bool:
        return self._joined is None  # inside join(), ranks that left mirror step() only

    def __repr__(self) -> str:
        s = self.shards
        return (
            f"fdp.ZeroRedundancy({self.optimizer!r}, stage={self.stage}, rank {s.rank} of "
            f"{s.world}, {len(s.parts)} buckets)"
        )

    def init(self, params: Any) -> ZeroState:
        """The optimizer state of this rank's slices, before the first step."""
        leaves = self._checked_params("fdp.ZeroRedundancy.init", params)
        per_part = []
        with torch.no_grad():
            for part, optimizer in zip(self.shards.parts, self._part_optimizers, strict=True):
                segs = [_segment(part, leaves, s).clone() for s in part.segments]
                # param_groups: each segment's leaf's label; Muon: slices, not matrices
                state = getattr(optimizer, "init_pieces", optimizer.init)(segs)
                if set(state) != set(self._keys):
                    raise TypeError(
                        f"fdp.ZeroRedundancy.init: `optimizer`.init gave a state with entries "
                        f"{sorted(state)}; expected {sorted(self._keys)} (step and its slots)"
                    )
                per_part.append(state)
        slots = {k: [st[k] for st in per_part] for k in self._keys}
        return ZeroState(slots, self.shards)

    @_transforms.eager_under_transforms("fdp.ZeroRedundancy.step")
    def step(
        self,
        grads: Any,
        state: ZeroState,
        params: T,
        *,
        donate: bool = False,
        max_norm: float | torch.Tensor | None = None,
    ) -> tuple[T, ZeroState]:
        """One step from this rank's local ``grads``: the new parameters and state.

        Nothing passed in is changed, unless ``donate=True``: then the
        optimizer writes into ``state``'s tensors and this rank's slices of
        ``params`` (see ``fdp.optim``'s ``update``), which the caller gives
        up. Eagerly, the new parameter leaves are views of the gathered
        buckets and require grad where the old ones did; every call checks
        (one tiny all-reduce, hidden behind packing) that all ranks pass
        gradients of the same structure, ``None`` included.

        With ``max_norm``, the averaged gradients are clipped to that global
        L2 norm first, as ``torch.nn.utils.clip_grad_norm_`` on DDP's
        gradients would: each rank holds a slice of them, so the norm costs
        one more all-reduce (of one number), and every bucket is reduced
        before the first is updated. The norm before clipping is then in
        :attr:`last_grad_norm` (the same 0-d tensor value on every rank).
        """
        if self._joined is not None:  # first, so that ranks that left pair with it
            return self._step_joined(grads, state, params, donate, max_norm)
        return self._step(grads, state, params, donate, max_norm)

    def _step_joined_traced(
        self, grads: Any, state: ZeroState, params: T, donate: bool, max_norm: Any
    ) -> tuple[T, ZeroState]:
        raise NotImplementedError(
            "fdp.ZeroRedundancy.step: a compiled step inside join(); join mirrors eager steps "
            "only: step eagerly inside the block"
        )

    @_mode.traced_as(_step_joined_traced)
    def _step_joined(
        self, grads: Any, state: ZeroState, params: T, donate: bool, max_norm: Any
    ) -> tuple[T, ZeroState]:
        joined = self._joined
        if joined is None:  # narrowing only: step() calls this inside join()
            return self._step(grads, state, params, donate, max_norm)
        joined.before(grads)
        new_params, new_state = self._step(grads, state, params, donate, max_norm)
        joined.after(new_params, new_state)
        return new_params, new_state

    @contextlib.contextmanager
    def join(self, params: Any, state: ZeroState) -> Iterator[_zero_join.Joined]:
        """Lets ranks with different numbers of batches step together (torch's ``Join``).

        Each rank runs its own loop of :meth:`step` inside the block, starting
        from ``params`` and ``state``. A rank that runs out of data leaves
        its loop; on leaving the block it mirrors the steps of the ranks still
        training with zero gradients (its slice of the parameters and of the
        state is updated with their average; gradients are divided by the
        initial world size), until every rank has left. The block's value
        holds every rank's latest parameters and state after it: read
        ``joined.params`` and ``joined.state`` (a rank that left early holds
        there what the others hold). Eager steps only. A rank with no batch at
        all mirrors with a zero gradient at every floating-point leaf, so
        the others must pass gradients there too (the same structure, as in
        every step).

        Example::

            with zero.join(params, state) as joined:
                for x, y in my_uneven_shard:
                    grads = torch.func.grad(loss)(params, x, y)
                    params, state = zero.step(grads, state, params)
            params, state = joined.params, joined.state
        """
        if self._joined is not None:
            raise RuntimeError("fdp.ZeroRedundancy.join: already inside join")
        joined = _zero_join.Joined(params, state, self.group)
        self._joined = joined
        try:
            with _training.joining(self.group, joined.announce):
                yield joined
                joined.mirror(lambda g, st, p: self._step(g, st, p, False, None))
        finally:
            self._joined = None

    def _step_traced(
        self,
        grads: Any,
        state: ZeroState,
        params: T,
        donate: bool,
        max_norm: float | torch.Tensor | None,
    ) -> tuple[T, ZeroState]:
        """The compiled step: functional collectives, no cross-rank check (nothing to read)."""
        call = "fdp.ZeroRedundancy.step"
        p, g = self._checked_step(call, grads, state, params, max_norm)
        s = self.shards
        comm = _zero_comm.Traced(self.group, self.stage, s.rank, s.world, self._wire)
        return self._run(call, comm, grads, state, p, g, donate, max_norm, checked=True)

    @_mode.traced_as(_step_traced)
    def _step(
        self,
        grads: Any,
        state: ZeroState,
        params: T,
        donate: bool,
        max_norm: float | torch.Tensor | None,
    ) -> tuple[T, ZeroState]:
        call = "fdp.ZeroRedundancy.step"
        p, g = self._checked_step(call, grads, state, params, max_norm)
        slots_now = _tree.flatten(state.slots)[0]
        lr = getattr(self.optimizer, "lr", None)
        s = self.shards
        if _base.differentiable(lr, p, g, {"slots": slots_now}):
            if self._owners is not None:
                raise ValueError(
                    f"{call}: `optimizer` needs whole leaves, whose exchange between ranks "
                    "carries no derivative; got inputs that require grad or are under a "
                    "torch.func transform (step without them, or with fdp.DistributedDataParallel)"
                )
            # Checked before the first collective, as on the fast path.
            fingerprint = self._fingerprint(grads, g)
            fingerprint.finish(
                fingerprint.start(self.group), group=self.group, call=call, arg="grads"
            )
            comm: Any = _zero_comm.Differentiable(self.group, s.rank, s.world, self._wire)
            return self._run(call, comm, grads, state, p, g, donate, max_norm, checked=True)
        comm = _zero_comm.Eager(self.group, self.stage, s.rank, s.world, self._pool, self._wire)
        return self._run(call, comm, grads, state, p, g, donate, max_norm, checked=False)

    def _run(
        self,
        call: str,
        comm: Any,
        grads: Any,
        state: ZeroState,
        p: list[Any],
        g: list[torch.Tensor | None],
        donate: bool,
        max_norm: float | torch.Tensor | None,
        *,
        checked: bool,
    ) -> tuple[Any, ZeroState]:
        """Packs, reduces and updates the buckets; ``checked``: the grads check is done."""
        differentiable = isinstance(comm, _zero_comm.Differentiable)
        with contextlib.nullcontext() if differentiable else torch.no_grad():
            checking = None if checked else self._fingerprint(grads, g).start(self.group)
            # The check ends before the first reduction: a rank whose grads
            # differ exchanges nothing else, so no collective may pair wrongly.
            packed = [_pack(part, g, self.shards.world) for part in self.shards.parts]
            if checking is not None:
                self._fingerprint(grads, g).finish(
                    checking, group=self.group, call=call, arg="grads"
                )
            out, slots = self._exchange(comm, packed, p, g, state, donate, max_norm, differentiable)
        spec = self._planned.structure(call)
        return _tree.unflatten(spec, out), ZeroState(slots, self.shards)

    def _checked_step(
        self,
        call: str,
        grads: Any,
        state: ZeroState,
        params: Any,
        max_norm: float | torch.Tensor | None,
    ) -> tuple[list[Any], list[Any]]:
        """``params``' and ``grads``' leaves, checked; an error is raised on every rank."""
        try:
            if max_norm is not None and not isinstance(max_norm, torch.Tensor) and max_norm < 0:
                raise ValueError(f"{call}: `max_norm` expected a number >= 0; got {max_norm!r}")
            p = self._checked_params(call, params)
            g = self._checked_grads(call, grads, params, p)
            if not isinstance(state, ZeroState) or state.shards is not self.shards:
                raise ValueError(
                    f"{call}: `state` expected the ZeroState this ZeroRedundancy's init "
                    f"returned; got {_tree.describe(state)}"
                )
        except (ValueError, TypeError) as e:
            self._share(call, e, grads)
            raise
        return p, g

    def _exchange(
        self,
        comm: Any,
        packed: list[Any],
        p: list[Any],
        g: list[Any],
        state: ZeroState,
        donate: bool,
        max_norm: float | torch.Tensor | None,
        differentiable: bool,
    ) -> tuple[list[Any], dict[str, list[Any]]]:
        """Reduce-scatter each bucket, update this rank's slices, all-gather the new values."""
        parts = self.shards.parts
        started = [comm.reduce(k, flat) for k, flat in enumerate(packed)]
        clipped = None if max_norm is None else self._clip(comm, started, max_norm)
        gathers, slots = [], {k: list(v) for k, v in state.slots.items()}
        for k, part in enumerate(parts):
            reduced = comm.reduced(started[k]) if clipped is None else clipped[k]
            pieces = self._update(
                part, k, p, g, reduced, slots, donate=donate, detach=not differentiable
            )
            gathers.append(comm.gather(k, pieces))
        out = list(p)
        for part, handle in zip(parts, gathers, strict=True):
            _unpack(part, comm.gathered(handle), p, out, leaf=not (comm.traced or differentiable))
        return out, slots

    def _clip(
        self, comm: Any, started: list[Any], max_norm: float | torch.Tensor
    ) -> list[torch.Tensor]:
        """Every bucket's averaged slice, scaled to the global ``max_norm``."""
        reduced = [comm.reduced(s) for s in started]
        total = _clip.sharded_norm(reduced, norm_type=2.0, combine=lambda t, op: comm.total(t))
        self.last_grad_norm = total
        scale = _clip.clip_scale(total, max_norm)
        if isinstance(comm, _zero_comm.Eager):  # the slices are this step's own buffers
            return [r.mul_(scale.to(r.device, r.dtype)) for r in reduced]
        return [r * scale.to(r.device, r.dtype) for r in reduced]

    def release(self) -> None:
        """Drops the flat buffers kept for reuse (freed once no result views them)."""
        self._pool.clear()

    def _update(
        self,
        part: Part,
        k: int,
        p: list[Any],
        g: list[torch.Tensor | None],
        reduced: torch.Tensor,
        slots: dict[str, list[Any]],
        *,
        donate: bool,
        detach: bool,
    ) -> list[torch.Tensor]:
        """Updates bucket ``k``'s segments; returns the pieces of this rank's new slice."""
        segs = part.segments
        grads = [None if g[s.leaf] is None else reduced[s.at : s.at + s.hi - s.lo] for s in segs]
        params = [_segment(part, p, s, detach=detach) for s in segs]
        mine = {key: slots[key][k] for key in self._keys}
        extra = {"donate": True} if donate else {}  # an optimizer of the user's may lack it
        opt, owners = self._part_optimizers[k], self._owners
        if owners is None:
            new, st = opt.update(grads, mine, params, **extra)
        else:  # see fdp/_sharding/_owners.py
            pending = opt.begin(grads, mine, params, **extra)
            stepped = {i for i in owners.optimizers if g[i] is not None}
            (updates,) = owners.exchange([part], [pending.directions], stepped)
            new, st = pending.finish(updates, shapes=owners.shapes_of(part))
        for key in self._keys:
            slots[key][k] = st[key]
        pieces, pos = [], 0
        for s, t in zip(segs, new, strict=True):
            if s.at > pos:
                pieces.append(reduced.new_zeros(s.at - pos))
            pieces.append(t)
            pos = s.at + s.hi - s.lo
        if part.size > pos or not pieces:
            pieces.append(reduced.new_zeros(part.size - pos))
        return pieces

    def _checked_params(self, call: str, params: Any) -> list[Any]:
        return self._planned.leaves(call, "params", params)

    def _checked_grads(
        self, call: str, grads: Any, params: Any, p: list[Any]
    ) -> list[torch.Tensor | None]:
        leaves = self._planned.leaves(call, "grads", grads, kinds=False)
        out: list[torch.Tensor | None] = [None] * len(leaves)
        for i in self._trained:
            if leaves[i] is not None:
                check_grad(call, params, i, p[i], leaves[i])
                out[i] = dense_grad(call, params, i, leaves[i])  # the buckets are dense
        return out

    def _share_traced(self, call: str, error: Exception, grads: Any) -> None:
        """Nothing while dynamo traces: a graph cannot carry the error's text to other ranks."""

    @_mode.traced_as(_share_traced)
    def _share(self, call: str, error: Exception, grads: Any) -> None:
        """Makes this rank's input error every rank's, in the exchange the others run.

        The other ranks are in the grads check, the first collective of a
        step: this rank takes part with its grads' signature and its error
        appended, so that every rank raises the same error rather than
        the others waiting in the reduction.
        """
        if self.shards.world > 1:
            _agreement.share_error(call, "grads", grads, error, self.group)

    def _fingerprint(self, grads: Any, g: Sequence[torch.Tensor | None]) -> _agreement.Fingerprint:
        """The fingerprint of this pattern of ``None`` gradients (computed once per pattern)."""
        missing = tuple(g[i] is None for i in self._trained)
        found = self._fingerprints.get(missing)
        if found is None:
            leaves = _tree.flatten(grads)[0]
            described = _agreement.signature(grads, leaves, "grads", requires_grad=False)
            found = self._fingerprints[missing] = _agreement.Fingerprint(described)
        return found


def _bind(optimizer: OptimizerProtocol, params: Any, parts: Sequence[Part]) -> list[Any]:
    """Per bucket, the optimizer of its segments (``param_groups`` labels them by leaf)."""
    if not isinstance(optimizer, _base.Grouped):
        return [optimizer] * len(parts)
    labels = optimizer.labels(params)
    return [optimizer.bind([labels[s.leaf] for s in part.segments]) for part in parts]


def _segment(
    part: Part, leaves: Sequence[Any], s: _shards.Segment, *, detach: bool = True
) -> torch.Tensor:
    leaf = leaves[s.leaf].detach() if detach else leaves[s.leaf]
    return _bucket.memory_flat(leaf, part.bucket.order(s.j))[s.lo : s.hi]


def _pack(part: Part, g: Sequence[torch.Tensor | None], world: int) -> list[torch.Tensor]:
    """Bucket ``part``'s local gradients in slice order, padded to ``world`` slices, in pieces."""
    bucket = part.bucket
    return bucket.pieces([g[i] for i in bucket.indices], numel=part.size * world)


def _unpack(
    part: Part, full: torch.Tensor, p: Sequence[Any], out: list[Any], *, leaf: bool
) -> None:
    """Leaves of the gathered bucket ``full`` into ``out``: views, with the old leaves' strides."""
    for i, new in zip(part.bucket.indices, part.bucket.unpack(full), strict=True):
        if leaf and p[i].requires_grad:  # a new leaf for the next loss.backward()
            new.requires_grad_()
        out[i] = new


def _wire(
    call: str, reduce_dtype: torch.dtype | None, sum_dtype: torch.dtype | None
) -> _zero_comm.Wire | None:
    """The checked ``reduce_dtype``/``sum_dtype`` pair, or None: each bucket in its own dtype."""
    for name, dtype in (("reduce_dtype", reduce_dtype), ("sum_dtype", sum_dtype)):
        _agreement.check_dtype(dtype, name, call=call)
    if reduce_dtype is None:
        if sum_dtype is not None:
            raise ValueError(
                f"{call}: `sum_dtype` expected a `reduce_dtype` to add up (e.g. "
                f"reduce_dtype=torch.bfloat16); got sum_dtype={sum_dtype} alone"
            )
        return None
    return _zero_comm.Wire(reduce_dtype, sum_dtype)
