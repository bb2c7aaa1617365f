"""``fdp.FullyShardedDataParallel``: parameters, gradients and optimizer state sharded by unit.

A params tree is cut into units (subtrees: a block, a layer; by default
each top-level entry, and each block of a list, a ``ModuleList``'s, in a
nested tree or in ``make_functional``'s flat dotted names). Each
unit's floating-point leaves are packed as DDP packs a bucket (one flat
buffer per dtype, every leaf in its memory order, ``fdp/_bucket.py``),
padded to a multiple of the world size and cut into one equal shard per
rank. A rank keeps only its shards (``shard(params)``), which are the
parameters its optimizer steps: an ``fdp.optim`` optimizer updates them
element by element, exactly as it would update the averaged unsharded
tree. ``fsdp(shards)`` (or ``fsdp.gather(shards, unit)``, one unit where
the model uses it) all-gathers units back into leaves, differentiably: the
backward reduce-scatters each unit's gradients as soon as backward produces
them (``fdp/_sharding/_fsdp_gather.py``), so no rank holds the gradient of more than
one unit at a time, and the shards' gradient is the mean over ranks.
docs/fsdp.md has the data flow.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from fdp import _bucket, _compat, _sharded, _tree
from fdp._comm import _agreement
from fdp._sharding import (
    _fsdp_accumulate,
    _fsdp_chain,
    _fsdp_clip,
    _fsdp_gather,
    _fsdp_module,
    _fsdp_optim,
    _fsdp_plan,
    _fsdp_prefetch,
    _fsdp_reshard,
    _fsdp_state,
    _fsdp_unit,
    _owners,
    _shards,
)
from fdp._sharding._shards import ZeroState
from fdp.optim import _param_groups, _whole

T = TypeVar("T")


class FullyShardedDataParallel:
    """Fully sharded data parallelism (ZeRO-3, FSDP) for functions over parameter trees.

    Construction, on every rank with the same tree, plans the units; then
    each rank keeps only its shards, and the model gathers them:

    - ``shards = fsdp.shard(params)``: this rank's shards, a dict from unit
      name to a tuple of flat 1-D tensors (one per dtype in the unit), in
      the parameters' dtypes (the master copy). Step them with any
      ``fdp.optim`` optimizer; the full ``params`` can be dropped.
    - ``fsdp(shards)``: the whole params tree, every unit all-gathered;
      ``fsdp.gather(shards, name)``: one unit's subtree (with ``None``
      outside it), for models that gather each unit where they use it.
      Both are differentiable: ``loss.backward()`` (with shards that
      require grad), ``torch.autograd.grad`` and ``torch.func.grad`` give
      the shards the gradient of the mean over ranks of the ranks' losses,
      reduce-scattered unit by unit; ``torch.func.jvp``/``vmap`` and
      nested transforms see linear maps with exact rules.
    - ``fsdp.apply(shards, name, fn, *args)``: ``fn(unit, *args)`` with the
      unit gathered just for it, and (``reshard_after_forward``) freed
      until backward needs it again: the way to hold one unit at a time.
    - ``fsdp.full(shards)``: the whole tree outside autograd (evaluation,
      export), in the parameters' own dtypes.

    Args:
        params: the parameter tree (tensor and ``None`` leaves), the same
            structure, shapes and dtypes on every rank.
        units: dotted names of the subtrees that are gathered together
            (``"blocks.0"``, as ``named_parameters`` writes them); leaves
            under no name form one more unit, ``""``. ``None``: each
            top-level entry, each element of a top-level list, and each
            block of a deeper list (``"transformer.h.0"``), nested or flat.
        group: the process group the shards are cut across (default: the
            world).
        param_dtype: the dtype parameters are gathered and computed in
            (e.g. ``torch.bfloat16``); ``None``: their own.
        reduce_dtype: the dtype gradients are reduce-scattered in (e.g.
            ``torch.float32``); ``None``: ``param_dtype``'s.
        sum_dtype: the dtype the reduce-scatter adds in. ``None``: on the
            wire, in ``reduce_dtype`` (torch's; every partial sum rounded, so
            the error grows with the ranks). ``torch.float32`` with a bfloat16
            ``reduce_dtype``: bfloat16's bytes, each rank's chunk added in
            float32 where it lands (an all-to-all), one rounding per input
            at any world size.
        gather_dtype: ``torch.int8``: parameters travel block-wise quantized
            on the all-gather (ZeRO++'s qwZ: 256 values per float32 scale,
            0.27x float32's bytes), decoded to ``param_dtype``: what the
            function sees and what is trained (the gradient is exact with
            respect to the decoded weights). ``None``: in ``param_dtype``.
        unit_dtypes: a precision per unit (torch applies a policy per
            ``fully_shard`` call): unit name to a param dtype (``None``: the
            parameters' own), a pair ``(param_dtype, reduce_dtype)``, or a
            dict of ``param_dtype``, ``reduce_dtype`` and ``gather_dtype``,
            e.g. ``{"head": torch.float32}`` for a float32 head on a
            bfloat16 body, ``{"embed": {"gather_dtype": None}}``.
        mesh: instead of ``group``, a 2-D ``torch.distributed`` device mesh
            for hybrid sharding (HSDP): shards are cut across its second
            dimension and replicated across its first, whose ranks all-reduce
            the reduce-scattered gradients.
        reshard_after_forward: free a unit gathered by :meth:`apply` once
            its function returns, and gather it again for backward (FSDP2's
            option); inside ``torch.compile``, every gather is one the
            compiler recomputes in backward (SimpleFSDP). ``False`` keeps
            units gathered until backward.
        prefetch: while a unit computes, all-gather the unit that followed
            it last time (first time: the next in ``unit_names``), and in
            backward the unit backward reaches next. Eager only (compiled,
            the compiler orders the gathers); never changes a result.
        buffers: dotted names of subtrees kept whole on every rank, never
            sharded: each rank's own, updated in place (BatchNorm's running
            statistics). ``None``: in a tree holding ``nn.Parameter``
            leaves (``make_functional``'s state), the leaves that are not
            and require no grad (its buffers), as ``fully_shard`` leaves a
            module's buffers.

    Example::

        fsdp = fdp.FullyShardedDataParallel(params, param_dtype=torch.bfloat16)
        shards = fsdp.shard(params)
        opt = fdp.optim.adamw(1e-3)
        state = opt.init(shards)
        grads = torch.func.grad(lambda s: loss(fsdp(s), batch))(shards)
        shards, state = opt.update(grads, state, shards)
    """

    def __init__(
        self,
        params: Any,
        *,
        units: Sequence[str] | None = None,
        group: ProcessGroup | None = None,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        sum_dtype: torch.dtype | None = None,
        gather_dtype: torch.dtype | None = None,
        unit_dtypes: Mapping[str, Any] | None = None,
        reshard_after_forward: bool = True,
        prefetch: bool = True,
        mesh: Any = None,
        buffers: Sequence[str] | None = None,
    ) -> None:
        call = "fdp.FullyShardedDataParallel"
        group, self.replicas = _fsdp_plan.mesh_groups(call, group, mesh)
        leaves, _spec, tensors = _fsdp_plan.checked_params(call, params, group, self.replicas)
        tensors = _fsdp_plan.without_buffers(call, params, leaves, tensors, buffers)
        self.replicas_world = 1 if self.replicas is None else dist.get_world_size(self.replicas)
        self.group, self.world = group, dist.get_world_size(group)
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.reshard_after_forward = reshard_after_forward
        self._planned = _tree.Planned(params, owner="this FullyShardedDataParallel")
        self._ties = _tree.ties(tensors)  # a tied tensor is sharded once, at its first leaf
        sharded = [None if i in self._ties else t for i, t in enumerate(tensors)]
        # Leaves not sharded (None, integer tensors, buffers) are kept as given.
        self._kept = {i: leaf for i, leaf in enumerate(leaves) if tensors[i] is None}
        self.units = _fsdp_plan.plan(call, params, sharded, units, self.world)
        owner = _fsdp_plan.owners(call, params, units)
        self._borrowed = _fsdp_plan.borrowed(owner, self._ties)
        # Each leaf's shape, dtype and name without its memory: what a
        # param_groups label function looks at (``optimizer``).
        self._meta = _tree.unflatten(
            _spec, [t.detach().to("meta") if isinstance(t, torch.Tensor) else t for t in leaves]
        )
        total = self.world * self.replicas_world
        dtypes = {"param_dtype": param_dtype, "reduce_dtype": reduce_dtype}
        dtypes |= {"sum_dtype": sum_dtype, "gather_dtype": gather_dtype}
        where = {"group": group, "world": self.world, "replicas": self.replicas, "total": total}
        policies = _fsdp_gather.policies(call, self.unit_names, dtypes, unit_dtypes, **where)
        # Each unit's runtime state (fdp/_sharding/_fsdp_unit.py), in the order of its shards.
        self._states = {u.name: _fsdp_unit.UnitState(u, policies[u.name]) for u in self.units}
        self._prefetch = _fsdp_prefetch.Prefetcher(self.unit_names, enabled=prefetch)
        self._chain = _fsdp_chain.Chain()  # every gathered unit's backward on every rank
        self._sync = True
        # The same slices as a ZeroRedundancy's, for checkpoints (fdp/_sharding/_fsdp_state.py).
        buckets = [b for u in self.units for b in u.buckets]
        self._layout = _shards.from_buckets(params, buckets, sharded, group=group)
        self._bucket_units = [(u.name, b) for u in self.units for b in range(len(u.buckets))]
        _sharded.register(self)  # calls that need whole or equal trees know the shards
        self._released: list[_fsdp_module.Released] = []  # modules whose copy wrap() freed

    def holds_shards(self, tree: Any, *, none_ok: bool = False) -> bool:
        """Whether ``tree`` has ``shard``'s format (``none_ok``: a ``None`` may be a shard)."""
        return _fsdp_optim.holds_shards(self.units, tree, none_ok=none_ok)

    def __repr__(self) -> str:
        return (
            f"fdp.FullyShardedDataParallel({len(self.units)} units, world {self.world}, "
            f"param_dtype={self.param_dtype}, reduce_dtype={self.reduce_dtype})"
        )

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulates gradients without communication (DDP's ``no_sync``).

        Backward passes inside the block reduce-scatter nothing: each unit's
        full gradient is kept (in ``reduce_dtype``) and added in by the first
        backward after the block, one reduce-scatter per unit. Every rank runs
        the same micro-batches in and out of it; eager ``loss.backward()`` only
        (docs/fsdp.md, "Gradient accumulation").

        Example::

            with fsdp.no_sync():
                loss_fn(fsdp(shards), first_half).backward()
            loss_fn(fsdp(shards), second_half).backward()  # one reduce-scatter per unit
        """
        if not self._sync:
            raise RuntimeError("fdp.FullyShardedDataParallel.no_sync: already inside no_sync")
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    @property
    def unit_names(self) -> list[str]:
        """The units' names, in the order of their shards."""
        return [u.name for u in self.units]

    def shard(self, params: Any) -> dict[str, tuple[torch.Tensor, ...]]:
        """This rank's shards of ``params`` (new tensors; leaves of autograd if ``params``' are)."""
        call = "fdp.FullyShardedDataParallel.shard"
        _fsdp_module.refuse_released(call, self._released, params)
        leaves = self._planned.leaves(call, "params", params)
        rank = dist.get_rank(self.group)
        out: dict[str, tuple[torch.Tensor, ...]] = {}
        with torch.no_grad():
            for unit in self.units:
                mine = []
                for bucket, size in zip(unit.buckets, unit.sizes, strict=True):
                    parts = [leaves[i].detach() for i in bucket.indices]
                    flat = torch.cat(bucket.pieces(parts, numel=size * self.world))
                    shard = flat[rank * size : (rank + 1) * size].clone()
                    trained = any(leaves[i].requires_grad for i in bucket.indices)
                    mine.append(shard.requires_grad_(trained))
                out[unit.name] = tuple(mine)
        return out

    def __call__(self, shards: dict[str, tuple[torch.Tensor, ...]]) -> Any:
        """The params tree, every unit all-gathered (differentiably) from ``shards``."""
        call = "fdp.FullyShardedDataParallel.__call__"
        self._check_shards(call, shards)
        out = self._blank()
        self._prefetch.drop()
        self._chain.reset()  # the whole tree: a pass of its own
        mine = [t for u in self.units for t in shards[u.name]]
        started: list[_fsdp_prefetch.Started | None] = [None] * len(self.units)
        if self._prefetch.enabled and _fsdp_prefetch.eligible(mine):
            # Every unit's all-gather at once: the later ones arrive while
            # the first ones are unpacked.
            started = [_fsdp_prefetch.start(s, shards[n]) for n, s in self._states.items()]
        for state, ahead in zip(self._states.values(), started, strict=True):
            self._gather_into(out, state, shards[state.name], ahead.wait() if ahead else None)
        return _tree.unflatten(self._planned.structure(call), self._tied(out))

    def gather(self, shards: dict[str, tuple[torch.Tensor, ...]], name: str) -> Any:
        """Unit ``name``'s subtree of the params tree, all-gathered (differentiably).

        The unit ``""`` (the leaves under no named unit) is the whole tree
        with ``None`` at every leaf of the named units.
        """
        call = "fdp.FullyShardedDataParallel.gather"
        state = self._state(call, shards, name)
        out = self._blank()
        self._gather_into(
            out, state, shards[name], self._prefetch.ready(state, shards, self._states)
        )
        self._gather_borrowed(out, name, shards)
        return _fsdp_plan.subtree(
            _tree.unflatten(self._planned.structure(call), self._tied(out)), name
        )

    def apply(
        self,
        shards: dict[str, tuple[torch.Tensor, ...]],
        name: str,
        fn: Callable[..., T],
        *args: Any,
        **kwargs: Any,
    ) -> T:
        """``fn(unit, *args, **kwargs)`` with unit ``name`` gathered just for it.

        With ``reshard_after_forward`` (the default) and eager autograd, the
        unit's gathered memory is freed when ``fn`` returns and gathered
        again when backward reaches ``fn``'s outputs (``fdp/_sharding/_fsdp_reshard.py``):
        between forward and backward a rank holds its shards only. Under a
        ``torch.func`` transform or ``torch.compile`` the unit stays gathered
        until backward. Keep no gathered tensor beyond ``fn``: its memory is
        released. ``fn`` returning one (or a view of one) is refused with a
        ``ValueError`` naming the output; return what is computed from the
        parameters, or use :meth:`gather` (or ``reshard_after_forward=False``)
        for parameters needed later.
        """
        call = "fdp.FullyShardedDataParallel.apply"
        state = self._state(call, shards, name)
        tree = self._blank()
        mark = self._chain.mark()
        ready = self._prefetch.ready(state, shards, self._states)
        gathered = self._gather_into(tree, state, shards[name], ready)
        gathered += self._gather_borrowed(tree, name, shards)
        whole = _tree.unflatten(self._planned.structure(call), self._tied(tree))
        out = fn(_fsdp_plan.subtree(whole, name), *args, **kwargs)
        flat_out = _tree.flatten(out)[0]
        outputs = [t for t in flat_out if isinstance(t, torch.Tensor) and t.requires_grad]
        if self.reshard_after_forward and _fsdp_reshard.eligible(outputs):  # eager only
            _fsdp_reshard.check_not_returned(call, name, out, flat_out, gathered)
            with _compat.label(f"fdp::fsdp.reshard {name}"):  # a profiler trace shows it
                held = [_fsdp_reshard.Resharded(*g) for g in gathered if g[0].requires_grad]
            unit_held = self._prefetch.held(held)
            state.resharded = unit_held
            self._chain.attach(mark, unit_held)
            _fsdp_reshard.reshard(unit_held, outputs)
        return out

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``run(shards, *args, **kwargs)``: ``fn``'s module (``fn`` from ``make_functional``),
        each unit gathered while its submodule runs; the module's own parameters released
        (``fdp/_sharding/_fsdp_module.py``). Example: docs/models.md."""
        return _fsdp_module.wrap(self, fn)

    def restore(self, shards: dict[str, tuple[torch.Tensor, ...]]) -> None:
        """Gives the modules :meth:`wrap` released ``shards``' full values, in place."""
        _fsdp_module.restore(self, self.full(shards))

    def full(self, shards: dict[str, tuple[torch.Tensor, ...]]) -> Any:
        """The params tree outside autograd, in the parameters' own dtypes."""
        call = "fdp.FullyShardedDataParallel.full"
        _fsdp_plan.check_shards(call, self.units, shards, agree_over=self.group)
        out = self._blank()
        with torch.no_grad():
            for state in self._states.values():
                for k, (bucket, shard) in enumerate(
                    zip(state.unit.buckets, shards[state.name], strict=True)
                ):
                    how = state.policy_for(k, shard, exact=True)
                    flat = _fsdp_gather.gather(shard.detach(), how)[: bucket.numel]
                    for i, leaf in zip(bucket.indices, bucket.unpack(flat), strict=True):
                        out[i] = leaf.clone()
        return _tree.unflatten(self._planned.structure(call), self._tied(out))

    def optimizer(self, optimizer: Any, *, exchange_cap_mb: float = _bucket.BUCKET_CAP_MB) -> Any:
        """``optimizer`` for this instance's shards, with ``param_groups`` labelled per leaf.

        A shard holds pieces of several leaves in one 1-D tensor, so a label
        function that looks at the tensor (``t.ndim <= 1``) would see every
        shard as 1-D. Wrapped here, each piece takes its leaf's label, decided
        once from the tree given at construction (the function sees each
        leaf's name and a meta tensor of its shape and dtype), and the step
        equals the grouped step on the unsharded tree. The state is
        ``optimizer.init(shards)``'s. Any other optimizer is returned as it
        is: it steps element by element, shards or not. A whole-leaf optimizer
        (``fdp.optim.muon``, alone or in ``param_groups``) steps owner-based:
        each leaf's pieces go to one rank, which transforms the whole leaf
        (``fdp/_sharding/_owners.py``); one exchange moves at most
        ``exchange_cap_mb`` of whole leaves.

        Example::

            decay = lambda name, t: "no_decay" if t.ndim <= 1 else "decay"
            plain = fdp.optim.adamw(1e-3, weight_decay=0.0)
            groups = {"decay": fdp.optim.adamw(1e-3), "no_decay": plain}
            opt = fsdp.optimizer(fdp.optim.param_groups(decay, groups))
            state = opt.init(shards)
            shards, state = opt.update(grads, state, shards)
        """
        call = "fdp.FullyShardedDataParallel.optimizer"
        whole = _whole.whole_leaves(call, optimizer, self._meta)
        cap = _agreement.check_cap(exchange_cap_mb, "exchange_cap_mb", call=call)
        owners = _owners.Owners(self._layout, whole, self.group, cap=cap) if whole else None
        if not isinstance(optimizer, _param_groups.ParamGroups):
            if owners is None:
                return optimizer
            optimizer = _param_groups.param_groups(lambda name, t: "all", {"all": optimizer})
        labels = optimizer.labels(self._meta)
        return _fsdp_optim.ShardedGroups(
            optimizer, labels, self._layout, self._bucket_units, owners=owners
        )

    def clip_grad_norm(
        self,
        grads: _fsdp_clip.G,
        max_norm: float | torch.Tensor,
        *,
        norm_type: float = 2.0,
    ) -> tuple[_fsdp_clip.G, torch.Tensor]:
        """The shards' gradients scaled so that their global p-norm is at most ``max_norm``.

        The norm is over every rank's shards (one all-reduce of one number),
        so it equals ``torch.nn.utils.clip_grad_norm_(..., norm_type=p)`` on
        the unsharded gradients, for any ``p > 0`` and ``math.inf`` (with
        complex leaves, ``p = 2`` only); a tied tensor counts once. Returns
        the clipped gradients and the norm before clipping. Differentiable
        (a ``psum`` under autograd or a transform) for finite ``p``. A
        ``None`` (a unit no backward reached) counts as zeros and stays
        ``None``. ``fdp.optim.clip_by_global_norm`` of such a tree calls this.
        """
        call = "fdp.FullyShardedDataParallel.clip_grad_norm"
        return _fsdp_clip.clip_grad_norm(call, self.units, self.group, grads, max_norm, norm_type)

    def to_checkpoint(self, value: Any) -> Any:
        """``value`` (the shards, or an ``fdp.optim`` state over them) for ``fdp.save_checkpoint``.

        A ``ZeroState`` whose entries are each parameter leaf's elements
        under the key an unsharded tree would use, so the checkpoint loads
        into another world size and into unsharded parameters and state.
        Pass one to ``fdp.load_checkpoint`` as ``like`` and the result to
        :meth:`from_checkpoint`.
        """
        call = "fdp.FullyShardedDataParallel.to_checkpoint"
        # Hybrid (mesh=): each replica's ranks present the same pieces at the
        # same offsets; torch.distributed.checkpoint writes each piece once.
        return _fsdp_state.to_state(self._layout, self._bucket_units, value, call=call)

    def from_checkpoint(self, state: Any) -> Any:
        """The shards (or ``fdp.optim`` state) a loaded :meth:`to_checkpoint` state holds."""
        if not isinstance(state, ZeroState) or state.shards is not self._layout:
            raise ValueError(
                "fdp.FullyShardedDataParallel.from_checkpoint: `state` expected what "
                "load_checkpoint returned for this instance's to_checkpoint(...) as `like`; "
                f"got {_tree.describe(state)}"
            )
        return _fsdp_state.from_state(self._layout, self._bucket_units, state)

    def _state(self, call: str, shards: Any, name: str) -> _fsdp_unit.UnitState:
        self._check_shards(call, shards)
        if name not in self._states:
            raise ValueError(
                f"{call}: `name` expected one of the units {self.unit_names}; got {name!r}"
            )
        return self._states[name]

    def _blank(self) -> list[Any]:
        """The tree's leaves with only the kept ones set (None, integers, buffers)."""
        return [self._kept.get(i) for i in range(len(self._planned.kinds))]

    def _gather_borrowed(
        self, out: list[Any], name: str, shards: dict[str, tuple[torch.Tensor, ...]]
    ) -> list[_fsdp_reshard.Gathered]:
        """Gathers the units whose tensors are tied into unit ``name`` (see ``borrowed``)."""
        gathered = []
        for other in self._borrowed.get(name, ()):
            gathered += self._gather_into(out, self._states[other], shards[other], borrower=name)
        return gathered

    def _tied(self, out: list[Any]) -> list[Any]:
        """``out`` with each tied leaf the same tensor as its first (gradients then add up)."""
        for i, j in self._ties.items():
            out[i] = out[j]
        return out

    def _gather_into(
        self,
        out: list[Any],
        state: _fsdp_unit.UnitState,
        shards: Sequence[torch.Tensor],
        ready: Sequence[torch.Tensor] | None = None,
        *,
        borrower: str | None = None,
        chained: bool = True,
    ) -> list[_fsdp_reshard.Gathered]:
        """Gathers ``state``'s unit into ``out`` (``ready``: already gathered); returns each
        flat buffer with its shard, how and leaves. ``borrower``: the unit it is gathered for;
        ``chained=False``: outside the chain of units (a recompute in backward)."""
        gathered: list[_fsdp_reshard.Gathered] = []
        for k, (bucket, shard) in enumerate(zip(state.unit.buckets, shards, strict=True)):
            how = state.policy_for(k, shard)
            done = None if ready is None else _fsdp_gather.Ready(ready[k])
            buffer = _fsdp_unit.Buffer(state.name, k, borrower)
            if not self._sync:
                _fsdp_accumulate.check("fdp.FullyShardedDataParallel.no_sync", shard)
            make = functools.partial(self._gather_flat, state, buffer, shard, how, done, chained)
            recompute = self.reshard_after_forward
            flat, leaves = _fsdp_gather.unit_leaves(bucket, shard, how, make, recompute=recompute)
            for i, leaf in zip(bucket.indices, leaves, strict=True):
                out[i] = leaf
            gathered.append((flat, shard, how, leaves))
        return gathered

    def _gather_flat(
        self,
        state: _fsdp_unit.UnitState,
        buffer: _fsdp_unit.Buffer,
        shard: torch.Tensor,
        how: Any,
        done: Any,
        chained: bool = True,
    ) -> torch.Tensor:
        """A bucket's flat buffer, chained; in ``no_sync`` its gradient is kept instead."""
        if self._sync:
            flat = _fsdp_gather.gather(shard, how, done)
            flat = _fsdp_accumulate.release(state.kept, buffer, flat)
        else:  # gathered outside autograd (fdp/_sharding/_fsdp_accumulate.py)
            flat = _fsdp_gather.gather(shard.detach(), how, done)
            flat = _fsdp_accumulate.hold(state.kept, buffer, flat, shard, how.reduce_dtype)
        return self._chain.link(buffer, flat) if chained else flat

    def _check_shards(self, call: str, shards: Any) -> None:
        _fsdp_plan.check_shards(call, self.units, shards)
