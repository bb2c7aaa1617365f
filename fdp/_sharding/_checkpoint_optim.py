"""Torch optimizers in checkpoints: an ``Optimizer``, or its ``state_dict()``, in a state.

A torch optimizer's state dict keeps its per-parameter state under
``"state"``, keyed by parameter index, and only once it has stepped: a
fresh optimizer's, which is what a restarted job has, holds none. As
``like`` for :func:`fdp.load_checkpoint` it would read none of the saved
moments. Here each optimizer state dict in ``like`` gets its ``"state"``
from the checkpoint's entries under it (each tensor's shape and dtype from
the checkpoint's metadata, as DCP's optimizer state-dict helpers rebuild
it), and an ``Optimizer`` object in a state is saved as its
``state_dict()`` and loaded into in place (``load_state_dict``), as
``torch.distributed.checkpoint.state_dict.set_state_dict`` does.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from typing import Any

import optree
import torch

from fdp._sharding._shards import ZeroState

_SUBSCRIPT = re.compile(r"\[('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|-?\d+)\]")


def is_optimizer_state(x: object) -> bool:
    """Whether ``x`` is a torch optimizer's ``state_dict()`` (``state`` and ``param_groups``)."""
    return (
        isinstance(x, dict)
        and isinstance(x.get("state"), dict)
        and isinstance(x.get("param_groups"), list)
        and all(isinstance(g, dict) and "params" in g for g in x["param_groups"])
    )


def _stops(x: object) -> bool:
    return isinstance(x, (torch.optim.Optimizer, ZeroState)) or is_optimizer_state(x)


def _flatten(tree: Any) -> tuple[list[Any], list[str], Any]:
    leaves, spec = optree.tree_flatten(tree, is_leaf=_stops, none_is_leaf=True)
    accessors = optree.tree_accessors(tree, is_leaf=_stops, none_is_leaf=True)
    return leaves, [a.codify("") for a in accessors], spec


def for_save(state: Any) -> Any:
    """``state`` with each torch ``Optimizer`` replaced by its ``state_dict()``."""
    leaves, _, spec = _flatten(state)
    if not any(isinstance(x, torch.optim.Optimizer) for x in leaves):
        return state
    saved = [x.state_dict() if isinstance(x, torch.optim.Optimizer) else x for x in leaves]
    return optree.tree_unflatten(spec, saved)


def for_load(like: Any, metadata: dict[str, Any]) -> tuple[Any, Callable[[Any], Any]]:
    """``like`` with each torch optimizer's ``"state"`` as the checkpoint holds it, and
    what turns the loaded state back into ``like``'s (optimizers loaded in place)."""
    leaves, keys, spec = _flatten(like)
    optimizers = {i: x for i, x in enumerate(leaves) if isinstance(x, torch.optim.Optimizer)}
    if not optimizers and not any(is_optimizer_state(x) for x in leaves):
        return like, lambda loaded: loaded
    expanded = list(leaves)
    for i, x in enumerate(leaves):
        if isinstance(x, torch.optim.Optimizer):
            expanded[i] = _filled(x.state_dict(), keys[i], metadata, _devices(x))
        elif is_optimizer_state(x):
            expanded[i] = _filled(x, keys[i], metadata, {})

    def finish(loaded: Any) -> Any:
        out, _, out_spec = _flatten(loaded)
        for i, opt in optimizers.items():
            opt.load_state_dict(out[i])
            out[i] = opt
        return optree.tree_unflatten(out_spec, out)

    return optree.tree_unflatten(spec, expanded), finish


def _devices(opt: torch.optim.Optimizer) -> dict[int, torch.device]:
    """Each parameter index of ``opt.state_dict()``'s, its parameter's device."""
    params = [p for group in opt.param_groups for p in group["params"]]
    return {i: p.device for i, p in enumerate(params)}


def _filled(
    state_dict: dict[str, Any], prefix: str, metadata: dict[str, Any], devices: dict[int, Any]
) -> dict[str, Any]:
    """``state_dict`` whose ``"state"`` holds a tensor (or a value) per entry under it."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    head = f"{prefix}['state']"
    state: dict[Any, Any] = {}
    for key, saved in metadata.items():
        path = _subscripts(key[len(head) :]) if key.startswith(head) else None
        if not path:
            continue
        value: Any = None  # a Python value: DCP reads it in place of this
        if isinstance(saved, TensorStorageMetadata):
            device = devices.get(path[0], torch.device("cpu"))
            # A 0-d step stays on the CPU, as torch's load_state_dict keeps it.
            device = torch.device("cpu") if len(saved.size) == 0 else device
            value = torch.empty(saved.size, dtype=saved.properties.dtype, device=device)
        node = state
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return {**state_dict, "state": state, "param_groups": _groups(state_dict, prefix, metadata)}


def _groups(state_dict: dict[str, Any], prefix: str, metadata: dict[str, Any]) -> list[Any]:
    """``state_dict``'s param groups with each option the checkpoint's groups have and they
    lack (``initial_lr``, which a scheduler adds): torch's ``load_state_dict`` takes the
    saved groups' options."""
    head = f"{prefix}['param_groups']"
    groups = [dict(g) for g in state_dict["param_groups"]]
    for key in metadata:
        path = _subscripts(key[len(head) :]) if key.startswith(head) else None
        if path and len(path) == 2 and isinstance(path[0], int) and path[0] < len(groups):
            groups[path[0]].setdefault(path[1], None)  # a Python value: DCP reads it here
    return groups


def _subscripts(rest: str) -> list[Any] | None:
    """``[0]['exp_avg']`` as ``[0, 'exp_avg']``; None unless ``rest`` is only subscripts."""
    parts = _SUBSCRIPT.findall(rest)
    if "".join(f"[{p}]" for p in parts) != rest:
        return None
    return [ast.literal_eval(p) for p in parts]
