"""Fully sharded models users bring: each unit gathered while its submodule runs.

``fsdp.wrap(fn)``, with ``fn`` from ``fdp.make_functional(model)``, returns
``run(shards, *args, **kwargs)``: the model's forward where each unit is
all-gathered when the forward of its submodule starts (``"transformer.h.0"``,
a block) and resharded when that forward ends, as ``fsdp.apply`` does for a
function the user writes (prefetch, re-gather in backward, ``no_sync``,
per-unit dtypes). The call runs on ``make_functional``'s per-call shells
(``fdp/_functional.py``): a unit's parameters are put into the shells while
its scope runs and taken out after it; outside, a stand-in with the
parameter's shape, dtype and device and no storage (:class:`Unheld`) raises
a clear error if an op reads it.

Scopes. A unit that names a submodule with a ``forward`` (a block, the
root ``""``) is gathered for that submodule's forward, and so for every
submodule under it (the outer unit stays gathered, as torch's root does).
A parameter of the unit that another module holds outside that submodule
(GPT-2's ``lm_head.weight``, which is ``transformer.wte.weight``) makes
that module's forward a scope of the unit too. A unit that names no module
with a forward (a ``ModuleList``) is gathered by the forward of each module
that holds one of its parameters.

Note [a unit used twice]: its gradient reduced once. Within one call a unit
is gathered once: a later scope of the same unit reuses the leaves of the
first gather (one all-gather node in the graph, so one reduce-scatter in
backward), refilling their freed storage outside autograd and freeing it
again after (:class:`Live`). Non-reentrant activation checkpointing re-runs a
scope in backward: it finds the unit refilled for backward and reuses it.
Reentrant checkpointing runs the forward under ``no_grad`` (a gather of its
own, freed at the scope's end) and re-runs it in backward, where the scope
gathers afresh outside the chain of units and the inner backward reduces it.

The module's own full parameters are released by ``wrap`` (:class:`Released`):
a forward of the module outside fdp then raises, and ``fsdp.restore(shards)``
or ``model.load_state_dict(...)`` gives it full parameters again.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fdp import _compat, _functional, _mode, _tree
from fdp._sharding import _fsdp_reshard

CALL = "fdp.FullyShardedDataParallel.wrap"


class Unheld(torch.Tensor):
    """A sharded parameter whose unit is not gathered now: metadata only; any op raises."""

    leaf: str
    unit: str

    @staticmethod
    def __new__(cls, like: torch.Tensor, leaf: str, unit: str, device: torch.device) -> Unheld:
        out: Any = _compat.storage_free(cls, like, requires_grad=like.requires_grad, device=device)
        out.leaf, out.unit = leaf, unit
        made: Unheld = out
        return made

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        found = [a for a in _tree.flatten((args, kwargs))[0] if isinstance(a, Unheld)]
        leaf, unit = (found[0].leaf, found[0].unit) if found else ("?", "?")
        raise RuntimeError(
            f"{CALL}: parameter {leaf!r} (unit {unit!r}) was used ({func}) outside the forward "
            "of the modules that gather its unit: only the unit's submodule, and the modules "
            "that hold its tensors, gather it. Name units that are submodules whose forward "
            "uses them (`units=`), or call fsdp(shards) for the whole tree"
        )

    def __repr__(self) -> str:  # type: ignore[override]
        return f"Unheld({self.leaf!r}, unit {self.unit!r}, shape {tuple(self.shape)})"


@dataclass
class Live:
    """A unit gathered in this call: its leaves, and the buffers freed after its scope."""

    leaves: dict[int, torch.Tensor]
    gathered: list[Any]  # _fsdp_reshard.Gathered
    since: int = 0  # the chain's entries of this gather
    until: int = 0
    held: _fsdp_reshard.Held | None = None
    depth: int = 0
    refilled: bool = False  # refilled by this scope (a later use), to free at its end
    in_backward: bool = False


@dataclass
class Plan:
    """Where each sharded parameter sits in the module, and which forwards gather what."""

    slots: dict[str, list[tuple[int, str, int]]]  # unit -> (module id, key, leaf)
    needs: dict[int, list[str]]  # module id -> units its forward gathers, in plan order
    unheld: dict[int, Unheld]  # leaf -> its stand-in
    state: dict[str, torch.Tensor]  # what the shells get: kept leaves and stand-ins
    enclosing: set[str]  # units whose submodule holds other units' submodules


def plan(fsdp: Any, module: nn.Module) -> Plan:
    """The :class:`Plan` of ``module`` for ``fsdp``'s units (see the module docstring)."""
    names = _tree.names(fsdp._meta)
    index = {n: i for i, n in enumerate(names)}
    unit_of = {i: u.name for u in fsdp.units for b in u.buckets for i in b.indices}
    canonical = {id(t): n for n, t in itertools.chain(module.named_parameters(),
                                                      module.named_buffers())}  # fmt: skip
    scopes = {u: _scope(module, u) for u in fsdp.unit_names}
    slots: dict[str, list[tuple[int, str, int]]] = {u: [] for u in fsdp.unit_names}
    needs: dict[int, set[str]] = {}
    for path, m in module.named_modules(remove_duplicate=False):
        for key, t in m._parameters.items():
            i = index.get(canonical.get(id(t), ""), -1) if t is not None else -1
            if i not in unit_of:
                continue
            unit = unit_of[i]
            if (id(m), key, i) not in slots[unit]:
                slots[unit].append((id(m), key, i))
            scope = scopes[unit]
            if scope is None or not _inside(path, scope):
                needs.setdefault(id(m), set()).add(unit)
    for unit, scope in scopes.items():
        if scope is not None:
            needs.setdefault(id(module.get_submodule(scope)), set()).add(unit)
    metas = _tree.flatten(fsdp._meta)[0]
    # On the shards' device, which the module's code may read (``self.device``).
    device = {i: b.device for u in fsdp.units for b in u.buckets for i in b.indices}
    unheld = {i: Unheld(metas[i], names[i], unit, device[i]) for i, unit in unit_of.items()}
    state: dict[str, torch.Tensor] = {names[i]: t for i, t in unheld.items()}
    state |= {names[i]: t for i, t in fsdp._kept.items() if isinstance(t, torch.Tensor)}
    order = fsdp.unit_names
    inner = [s for s in scopes.values() if s is not None]
    enclosing = {u for u, s in scopes.items() if s is not None and any(
        t != s and _inside(t, s) for t in inner)}  # fmt: skip
    needs_in_order = {k: [u for u in order if u in v] for k, v in needs.items()}
    return Plan(slots, needs_in_order, unheld, state, enclosing)


def _inside(path: str, scope: str) -> bool:
    return scope == "" or path == scope or path.startswith(scope + ".")


def _scope(module: nn.Module, unit: str) -> str | None:
    """The submodule whose forward gathers ``unit``: the one it names, if it has a forward."""
    try:
        sub = module.get_submodule(unit)
    except AttributeError:
        return None
    return None if type(sub).forward is nn.Module.forward else unit


class Wrapped:
    """``run(shards, *args, **kwargs)``: ``fn``'s module, each unit gathered in its scope."""

    def __init__(self, fsdp: Any, fn: Callable[..., Any]) -> None:
        module = _functional.module_of(fn)
        if module is None:
            raise TypeError(
                f"{CALL}: `fn` expected the function fdp.make_functional(module) returned (its "
                f"module's forward is where units are gathered); got {_tree.describe(fn)}. For "
                "your own function, gather units with fsdp.apply or fsdp.gather"
            )
        self.fsdp, self.fn, self.module = fsdp, fn, module
        self.plan = plan(fsdp, module)

    def __call__(
        self, shards: dict[str, tuple[torch.Tensor, ...]], *args: Any, **kwargs: Any
    ) -> Any:
        if _mode.traced():  # compiled: SimpleFSDP's recomputed gathers (fsdp.__call__)
            return self.fn(self.fsdp(shards), *args, **kwargs)
        self.fsdp._check_shards(f"{CALL}(fn)", shards)
        self.fsdp._chain.reset()  # a pass of its own
        run = Pass(self, shards)
        return _functional.module_call(self.fn, self.plan.state, args, kwargs, run.prepare)


@dataclass
class Pass:
    """One call: the units gathered so far and the shells' parameter dicts."""

    wrapped: Wrapped
    shards: dict[str, tuple[torch.Tensor, ...]]
    live: dict[str, Live] = field(default_factory=dict)
    tables: dict[int, dict[str, Any]] = field(default_factory=dict)

    def prepare(self, pairs: list[tuple[nn.Module, nn.Module]]) -> None:
        needs = self.wrapped.plan.needs
        for m, shell in pairs:
            self.tables[id(m)] = shell.__dict__["_parameters"]
            units = needs.get(id(m))
            if units:
                shell.__dict__["forward"] = self._scoped(units, shell.forward)

    def _scoped(self, units: Sequence[str], forward: Callable[..., Any]) -> Callable[..., Any]:
        def scoped(*args: Any, **kwargs: Any) -> Any:
            for unit in units:
                self._enter(unit)
            out = None
            try:
                out = forward(*args, **kwargs)
            finally:
                for unit in reversed(units):
                    self._leave(unit, out)
            return out

        return scoped

    def _install(self, unit: str, live: Live | None) -> None:
        unheld = self.wrapped.plan.unheld
        for mid, key, i in self.wrapped.plan.slots[unit]:
            self.tables[mid][key] = unheld[i] if live is None else live.leaves[i]

    def _enter(self, unit: str) -> None:
        live = self.live.get(unit)
        if live is not None and live.depth > 0:  # an enclosing scope holds it
            live.depth += 1
            return
        if live is None:
            live = self.live[unit] = self._gather(unit)
        elif live.held is not None:  # used again in this call: the same leaves, refilled
            freed = [b for b in live.held.buffers if b.storage.nbytes() != b.nbytes]
            with _compat.label(f"fdp::fsdp.refill {unit}"):
                for buffer in live.held.buffers:
                    buffer.refill()  # no-op where gathered; waits for one under way
            live.refilled = bool(freed) and not _compat.in_backward()
        live.depth = 1
        self._install(unit, live)

    def _gather(self, unit: str) -> Live:
        fsdp = self.wrapped.fsdp
        state, mine = fsdp._states[unit], self.shards[unit]
        tree = fsdp._blank()
        backward = _compat.in_backward()  # a reentrant checkpoint's recompute
        since = fsdp._chain.mark()
        ready = None if backward else fsdp._prefetch.ready(state, self.shards, fsdp._states)
        gathered = fsdp._gather_into(tree, state, mine, ready, chained=not backward)
        leaves = {i: tree[i] for b in state.unit.buckets for i in b.indices}
        return Live(leaves, gathered, since, fsdp._chain.mark(), in_backward=backward)

    def _leave(self, unit: str, out: Any) -> None:
        live = self.live[unit]
        live.depth -= 1
        if live.depth:
            return
        flat_out = _tree.flatten(out)[0]
        outputs = [t for t in flat_out if isinstance(t, torch.Tensor) and t.requires_grad]
        if live.in_backward or out is None:  # a recompute's graph holds it, or the call failed
            del self.live[unit]
        elif live.held is None:
            self._reshard(unit, live, out, flat_out, outputs)
        if self.live.get(unit) is not live or live.held is None:
            # Dropped (in no graph), or kept whole (a transform): nothing freed.
            if self.live.get(unit) is not live:
                self._install(unit, None)
            return
        if live.refilled:  # a later use: freed again
            live.refilled = False
            for buffer in live.held.buffers:
                buffer.free()
        self._install(unit, None)
        if outputs:
            _fsdp_reshard.reshard(live.held, outputs)
            # A recompute in backward (activation checkpointing inside the
            # block) reads the shells: the leaves are back while refilled.
            hook = torch.autograd.graph.register_multi_grad_hook
            hook(tuple(outputs), lambda _: self._install(unit, live), mode="any")

    def _reshard(
        self, unit: str, live: Live, out: Any, flat_out: list[Any], outputs: list[torch.Tensor]
    ) -> None:
        """A first gather at its scope's end: resharded, kept, or dropped from the call."""
        fsdp = self.wrapped.fsdp
        trained = any(t.requires_grad for t in live.leaves.values())
        if not (trained and torch.is_grad_enabled()):
            del self.live[unit]  # in no graph: freed as the call lets go of it
            return
        if not (fsdp.reshard_after_forward and _fsdp_reshard.eligible(outputs)):
            return  # kept (a transform, or reshard_after_forward=False): reused as it is
        _fsdp_reshard.check_not_returned(f"{CALL}(fn)", unit, out, flat_out, live.gathered)
        with _compat.label(f"fdp::fsdp.reshard {unit}"):
            buffers = [_fsdp_reshard.Resharded(*g) for g in live.gathered if g[0].requires_grad]
        if unit in self.wrapped.plan.enclosing:
            # Note [an enclosing unit prefetches nothing]: backward reaches its outputs
            # first and needs it to the end (torch's root): the unit its scope closed
            # after is the innermost block, which its own outputs' refill fetches later.
            held = _fsdp_reshard.Held(buffers, None)
        else:
            held = fsdp._prefetch.held(buffers)
        fsdp._states[unit].resharded = held
        fsdp._chain.attach(live.since, held, until=live.until)
        live.held = held


class Released:
    """The module's own parameters that ``wrap`` released, and how to give them back."""

    def __init__(self, fsdp: Any, module: nn.Module) -> None:
        names = _tree.names(fsdp._meta)
        sharded = {names[i] for u in fsdp.units for b in u.buckets for i in b.indices}
        self.module = module
        self.params = [(n, p, p.shape) for n, p in module.named_parameters() if n in sharded]
        with torch.no_grad():
            for _, p, _ in self.params:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.ids = {id(p) for _, p, _ in self.params}
        # One released parameter's slot tells a direct call of the module (the slot
        # holds it) from a compiled call through functional_call (swapped out).
        owner, _, key = self.params[0][0].rpartition(".") if self.params else ("", "", "")
        self._probe = (module.get_submodule(owner), key) if self.params else None
        self._hooks = [
            module.register_forward_pre_hook(self._refuse),
            module.register_load_state_dict_pre_hook(self._before_load),  # type: ignore[no-untyped-call]
        ]

    def _refuse(self, module: nn.Module, args: Any) -> None:
        if module is not self.module or self._probe is None:  # fdp's shells pass
            return
        owner, key = self._probe
        if owner._parameters.get(key) is self.params[0][1]:
            name = self.params[0][0]
            raise RuntimeError(
                f"{CALL}: the module's own parameters were released when it was wrapped "
                f"(e.g. {name!r}); its forward runs through the function wrap returned, "
                "run(shards, ...). For the full module again: fsdp.restore(shards), or "
                "module.load_state_dict(fsdp.full(shards))"
            )

    def _before_load(self, module: nn.Module, *args: Any) -> None:
        self.restore(None)

    def restore(self, full: dict[str, torch.Tensor] | None) -> None:
        """Full-size storage again (``full``'s values, else uninitialized: a load follows)."""
        with torch.no_grad():
            for name, p, shape in self.params:
                value = None if full is None else full[name]
                p.data = torch.empty(shape, dtype=p.dtype, device=p.device) if value is None else (
                    value.detach().to(p.dtype).clone())  # fmt: skip
        self.params, self.ids, self._probe = [], set(), None
        for hook in self._hooks:
            hook.remove()


def wrap(fsdp: Any, fn: Callable[..., Any]) -> Wrapped:
    """``fsdp.wrap(fn)``: the wrapped call; the module's copy released (once)."""
    wrapped = Wrapped(fsdp, fn)
    if not any(r.module is wrapped.module and r.params for r in fsdp._released):
        fsdp._released.append(Released(fsdp, wrapped.module))
    return wrapped


def restore(fsdp: Any, full: Any) -> None:
    """``fsdp.restore``: every released module's parameters from ``full`` (``fsdp.full``)."""
    values = dict(zip(_tree.names(full), _tree.flatten(full)[0], strict=True))
    for released in fsdp._released:
        released.restore(values)
    fsdp._released = []


def refuse_released(call: str, released: Sequence[Released], params: Any) -> None:
    """Raises if ``params`` hold a parameter ``wrap`` released (its values are gone)."""
    ids: set[int] = set().union(*(r.ids for r in released)) if released else set()
    if not ids:
        return
    leaves = _tree.flatten(params)[0]
    for name, leaf in zip(_tree.names(params), leaves, strict=True):
        if id(leaf) in ids:
            raise ValueError(
                f"{call}: `params` leaf {name!r} expected the parameter's values; got a "
                "parameter fsdp.wrap released (its module's own copy, now empty). Shard before "
                "wrap, keep the shards, or fsdp.restore(shards) first"
            )
