"""``make_functional``'s call inside ``torch.compile``: the state put in the module's own dicts.

Eagerly each call runs on shells of the module (:mod:`fdp._shells`),
which dynamo would trace leaf by leaf, as it would
``torch.func.functional_call``'s swap: about 140 traced lines a leaf,
half of what dynamo read of a Llama's loss (``benchmarks/bench_trace_time.py``).
Compiled code runs on one thread, so here the call puts the state's tensors
straight into the module's parameter and buffer dicts, every tied name of a
tensor included, runs the module, and puts the module's tensors back, as
``functional_call`` does. What goes where is a :class:`Plan`, worked out
by :func:`plan`, which dynamo runs as plain Python while it traces
(``fdp._compat.traced_constant``): the traced code only reads it, about ten
lines a leaf.

That holds while dynamo traces the module whole. Where its forward has a
graph break, dynamo runs the call eagerly on shells instead
(``fdp._compat.traced_whole``): code that dynamo leaves eager may run the
module's layers again after the call returned (a checkpointed block's
recompute in backward), and must find the call's tensors there, not the
module's own put back.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from fdp import _compat, _shells

_CALL = "fdp.make_functional"


class Plan(NamedTuple):
    """Where a call's tensors go, for its names in order.

    ``owners``: the modules that hold them, each ``(parent, child name)``,
    a parent's index counting the root as 0 and ``owners[k]`` as ``k + 1``;
    ``swaps``: ``(owner, parameter, key, name)`` for each place a name's
    tensor takes (its tied names' places too), ``parameter`` whether the
    key is in ``_parameters`` (else ``_buffers``), ``name`` its index in the
    names; ``ties``: pairs of names of one tied tensor, which must be given
    one tensor; ``unknown``: the first name the module does not have;
    ``example``: a name it has.
    """

    owners: tuple[tuple[int, str], ...]
    swaps: tuple[tuple[int, bool, str, int], ...]
    ties: tuple[tuple[int, int], ...]
    unknown: str | None
    example: str | None


def plan(module: nn.Module, names: tuple[str, ...]) -> Plan:
    """The :class:`Plan` of a call of ``module`` with the tensors of ``names``."""
    places: dict[int, list[tuple[str, bool, str]]] = {}
    group: dict[str, int] = {}
    for prefix, m in module.named_modules(remove_duplicate=False):
        for parameter, table in ((True, m._parameters), (False, m._buffers)):
            for key, tensor in table.items():
                name = f"{prefix}.{key}" if prefix else key
                # A None slot is a place of its own: no tensor ties it to another.
                ident = id(tensor) if tensor is not None else -len(group) - 1
                places.setdefault(ident, []).append((prefix, parameter, key))
                group[name] = ident
    unknown = next((n for n in names if n not in group), None)
    first: dict[int, int] = {}
    ties: list[tuple[int, int]] = []
    owners: list[tuple[int, str]] = []
    paths = {"": 0}
    swaps: list[tuple[int, bool, str, int]] = []
    for i, name in enumerate(names):
        if name not in group:
            continue
        ident = group[name]
        if ident in first:
            ties.append((first[ident], i))
            continue
        first[ident] = i
        for prefix, parameter, key in places[ident]:
            swaps.append((_owner(prefix, paths, owners), parameter, key, i))
    return Plan(tuple(owners), tuple(swaps), tuple(ties), unknown, next(iter(group), None))


def _owner(prefix: str, paths: dict[str, int], owners: list[tuple[int, str]]) -> int:
    """The index of the module at ``prefix``, its ancestors added to ``owners`` first."""
    index = paths.get(prefix)
    if index is None:
        parent, _, child = prefix.rpartition(".")
        owners.append((_owner(parent, paths, owners), child))
        index = paths[prefix] = len(owners)
    return index


def _on_shells(
    module: nn.Module,
    state: Mapping[str, Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    planned: Callable[[tuple[str, ...]], Plan],
    prepare: Callable[[list[tuple[nn.Module, nn.Module]]], None] | None,
) -> Any:
    """The call where dynamo met a graph break in the module: on shells, as eagerly.

    After a graph break the module's tensors put back in its own dicts
    would be what a checkpointed block that dynamo left eager recomputes
    with in backward; the shells keep the call's. They are made and closed
    untraced; the forward, called from here, is compiled in pieces, as any
    graph-broken code.
    """
    call = _enter(module, state, sync_batch_norm=False, group=None, prepare=prepare)
    try:
        out = call.shell(*args, **kwargs)
    except BaseException:
        _leave(call, failed=True)
        raise
    _leave(call, failed=False)
    return out


def _swapped(
    module: nn.Module,
    state: Mapping[str, Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    planned: Callable[[tuple[str, ...]], Plan],
    prepare: Callable[[list[tuple[nn.Module, nn.Module]]], None] | None,
) -> Any:
    """``module(*args, **kwargs)`` with ``state``'s tensors in its own dicts, while traced.

    ``planned``: :func:`plan` of the module, marked for dynamo to run as Python.
    """
    names = tuple(state)
    p = planned(names)
    values = [state[name] for name in names]
    _check(p, names, values)
    mods = [module]
    for parent, child in p.owners:
        mods.append(mods[parent]._modules[child])  # type: ignore[arg-type]
    swapped: list[tuple[dict[str, Any], str, Any]] = []
    try:
        for owner, parameter, key, i in p.swaps:
            table = mods[owner]._parameters if parameter else mods[owner]._buffers
            swapped.append((table, key, table[key]))
            table[key] = values[i]
        return module(*args, **kwargs)
    finally:
        for table, key, original in reversed(swapped):
            table[key] = original


def _check(p: Plan, names: tuple[str, ...], values: list[Any]) -> None:
    """The eager call's refusals: a leaf not a tensor, a name the module lacks, a tie split."""
    for name, value in zip(names, values, strict=True):
        if value is not None and not isinstance(value, torch.Tensor):
            raise TypeError(
                f"{_CALL}: `state` leaf {name!r} expected a tensor or None; "
                f"got {type(value).__name__}"
            )
    if p.unknown is not None:
        raise ValueError(
            f"{_CALL}: `state` leaf {p.unknown!r} expected a name of the module's parameters or "
            f"buffers; got a name the module does not have (e.g. {p.example!r})"
        )
    for i, j in p.ties:
        if values[i] is not values[j]:
            raise ValueError(
                f"{_CALL}: `state` leaves {names[i]!r} and {names[j]!r} expected one tensor "
                "(they are tied: the same tensor in the module); got two different tensors"
            )


_enter = _compat.compiler_disable(_shells.enter, reason="fdp.make_functional makes its shells")
_leave = _compat.compiler_disable(_shells.leave, reason="fdp.make_functional leaves its shells")
# ``module(*args, **kwargs)`` with ``state``'s tensors in place of its own,
# compiled: dynamo traces _swapped in its place; where it cannot trace the
# module whole (a graph break in its forward), it runs _on_shells there.
call = _compat.traced_whole(_on_shells, _swapped)
