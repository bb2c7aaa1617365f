"""A call's *shells*: the module tree copied for one eager ``make_functional`` call.

Each shell is made at the call from its module's current ``__dict__``; it
shares every tensor but owns its ``_parameters``, ``_buffers`` and
``_modules`` dicts. Outside a replica, a subtree without parameters or
buffers (dropout, an activation) runs as itself: no tensor of the call goes
there. The call's tensors are installed in the shells and stay there:
autograd saved-tensor recomputation (non-reentrant activation
checkpointing) that runs the shells' layers again during backward finds
the tensors the forward used, not the module's own. Threads never share a
shell, so concurrent calls do not disturb one another or the module.

What the forward changes of the module's Python state (plain attributes,
buffers it registers) is written back to the module when the call ends, as
a module call would leave it; under ``parallel_apply`` only replica 0's,
once every replica has finished (see :mod:`fdp._replica`). Hooks the
forward registers go straight to the module outside a replica, as in a
module call (the shells share the module's hook dicts); a replica's go to
copies, and replica 0's copies become the module's.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from fdp import _compat, _replica

_CALL = "fdp.make_functional"
_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


class _KeepAlive:
    """A non-full backward hook (``register_backward_hook``) that holds its shell.

    torch wraps such hooks with a weak reference to the module and runs them
    in backward, after the call returned: without this the shell is gone by
    then ("the hook of a dead Module").
    """

    __slots__ = ("hook", "shell")

    def __init__(self, hook: Callable[..., Any], shell: nn.Module) -> None:
        self.hook = hook
        self.shell = shell

    def __call__(self, *args: Any) -> Any:
        return self.hook(*args)


_SET_ATTR = object.__setattr__  # past nn.Module.__setattr__, which would file "__dict__"

# A tensor name's place in a call's shells: the shell's dict, the key, the module's tensor.
_Slot = tuple[dict[str, Any], str, Any]


class _Walk:
    """One call's shells and slots, made in one walk of the module tree.

    ``pairs``: ``(module, shell)`` for every module with a shell, the root
    first (each module once); ``slots``: every name of a parameter or buffer, tied and
    shared ones included (``named_modules(remove_duplicate=False)``), with
    its shell's dict, key, and the module's tensor.
    """

    __slots__ = ("copied", "group", "kept", "pairs", "shells", "slots", "sync_batch_norm")

    def __init__(self, *, sync_batch_norm: bool, group: Any, copied: bool) -> None:
        self.pairs: list[tuple[nn.Module, nn.Module]] = []
        self.shells: dict[int, nn.Module] = {}
        self.slots: dict[str, _Slot] = {}
        self.kept: list[int] = []  # indices of pairs whose shell holds a _KeepAlive
        self.sync_batch_norm, self.group = sync_batch_norm, group
        # Copies of the hook dicts (_CONTAINERS): a replica's own. Outside one the
        # shells share the module's, as a module call registers on the module.
        self.copied = copied

    def visit(self, m: nn.Module, prefix: str, *, root: bool = False) -> nn.Module:
        """``m``'s shell (made at its first visit), its subtree's and its names' slots.

        Outside a replica a subtree without parameters or buffers (dropout,
        activations) gets no shell: it runs as itself, as in a module call,
        since no tensor of the call is installed there (17 of GPT-2's 60
        modules).
        """
        shell = self.shells.get(id(m))
        dot = f"{prefix}." if prefix else ""
        children = {
            name: None if child is None else self.visit(child, dot + name)
            for name, child in m._modules.items()
        }
        if shell is None:
            if not root and self._bare(m, children):
                self.shells[id(m)] = m
                return m
            shell = self.shells[id(m)] = self._shell(m)
            shell.__dict__["_modules"] = children
            self.pairs.append((m, shell))
        if shell is not m:
            attrs, slots = shell.__dict__, self.slots
            params, buffers = attrs["_parameters"], attrs["_buffers"]
            for key, param in m._parameters.items():
                slots[dot + key] = (params, key, param)
            for key, buffer in m._buffers.items():
                slots[dot + key] = (buffers, key, buffer)
        return shell

    def _bare(self, m: nn.Module, children: dict[str, nn.Module | None]) -> bool:
        """Whether ``m`` runs as itself: no tensors in its subtree, outside a replica.

        A name registered as None counts as a tensor: a batch norm without
        statistics or affine weights keeps its shell, which ``sync_batch_norm``
        swaps the class of.
        """
        return (
            not self.copied
            and not m._parameters
            and not m._buffers
            and all(map(operator.is_, children.values(), m._modules.values()))
        )

    def _shell(self, m: nn.Module) -> nn.Module:
        shell = object.__new__(type(m))
        # A copy set as the whole __dict__: a dict's own copy clones its table
        # (0.3 against 0.5 us for GPT-2's 37 keys, updated in one by one).
        _SET_ATTR(shell, "__dict__", m.__dict__.copy())
        attrs = shell.__dict__
        if self.sync_batch_norm and isinstance(m, _BATCH_NORMS):
            # Imported here: the single-process core imports nothing distributed.
            from fdp._comm import _sync_batch_norm

            _sync_batch_norm.synced(shell, self.group)
        if self.copied:  # hooks a replica's forward registers stay in its shell
            for key in _CONTAINERS:
                container = attrs.get(key)
                if container is not None:
                    attrs[key] = container.copy()
        attrs["_parameters"] = dict(m._parameters)
        attrs["_buffers"] = dict(m._buffers)
        if m._backward_hooks and m._is_full_backward_hook is False:
            attrs["_backward_hooks"] = {
                key: _KeepAlive(hook, shell) for key, hook in m._backward_hooks.items()
            }
            self.kept.append(len(self.pairs))  # the index visit gives it (reversed in _shells)
        return shell


def _shells(module: nn.Module, *, sync_batch_norm: bool, group: Any, copied: bool) -> _Walk:
    """The call's shells of every module of the tree, and the slots of every tensor name."""
    walk = _Walk(sync_batch_norm=sync_batch_norm, group=group, copied=copied)
    walk.visit(module, "", root=True)
    # Children are shelled before their parent: the root first, as callers read pairs.
    walk.pairs.reverse()
    walk.kept = [len(walk.pairs) - 1 - index for index in walk.kept]
    return walk


# Copied apart, with the call's tensors and child shells.
_OWN = frozenset(("_parameters", "_buffers", "_modules"))
# Every other dict and set torch gives a module (hooks, non-persistent buffer
# names), read off a new module once. A forward may add to them in place (a
# Hugging Face model installs output-recording hooks on its first call): a
# replica's shell adds to its own copy, and replica 0's is written back when
# the call succeeds, as one direct call would leave the module. Outside a
# replica the shells share the module's: the forward adds to them as a
# module call does (copying a dozen per module cost a third of the shells).
_CONTAINERS = tuple(
    k
    for k, v in nn.Module().__dict__.items()
    if k not in _OWN and type(v) in (dict, set, OrderedDict)
)


# What a forward changes without registering a hook (register_buffer(persistent=False)).
_UNHOOKED_CONTAINERS = tuple(k for k in _CONTAINERS if "hooks" not in k)


def _install(slots: dict[str, _Slot], state: Mapping[str, Any]) -> None:
    """Puts ``state``'s tensors in the shells, every tied name of a tensor included."""
    chosen: dict[int, tuple[str, torch.Tensor | None]] = {}
    for name, value in state.items():
        if value is not None and not isinstance(value, torch.Tensor):
            raise TypeError(
                f"{_CALL}: `state` leaf {name!r} expected a tensor or None; "
                f"got {type(value).__name__}"
            )
        slot = slots.get(name)
        if slot is None:
            raise ValueError(
                f"{_CALL}: `state` leaf {name!r} expected a name of the module's parameters or "
                f"buffers; got a name the module does not have (it has {len(slots)}, "
                f"e.g. {next(iter(slots), None)!r})"
            )
        table, key, original = slot
        if original is None:
            table[key] = value
            continue
        first = chosen.setdefault(id(original), (name, value))
        if first[1] is not value:
            raise ValueError(
                f"{_CALL}: `state` leaves {first[0]!r} and {name!r} expected one tensor (they are "
                "tied: the same tensor in the module); got two different tensors"
            )
    for table, key, original in slots.values():
        hit = chosen.get(id(original)) if original is not None else None
        if hit is not None:
            table[key] = hit[1]


def _changed(before: dict[str, Any], now: dict[str, Any]) -> bool:
    # C-speed identity check; assignments keep key order, additions append.
    return len(before) != len(now) or not all(map(operator.is_, before.values(), now.values()))


def _writer(
    pairs: list[tuple[nn.Module, nn.Module]],
    before: list[dict[str, Any]],
    handles: int | None,
    *,
    copied: bool,
) -> Callable[[], None]:
    """What writes the forward's changes to Python state back to the modules.

    ``handles``: :func:`fdp._compat.hook_handles_made` before the shells
    were made. Where no handle was made since, no hook was registered, and
    of the containers only the non-persistent buffer names can have changed.
    ``copied``: whether the shells have copies of the containers (a
    replica's); else they are the module's own, changed in place already.
    """

    def write() -> None:
        hooked = handles is None or _compat.hook_handles_made() != handles
        containers = () if not copied else _CONTAINERS if hooked else _UNHOOKED_CONTAINERS
        for (m, shell), old in zip(pairs, before, strict=True):
            now = shell.__dict__
            for key in containers:
                # Added to in place (a hook registered): the shell's copy, which
                # the registration's handle removes from, becomes the module's.
                mine = now.get(key)
                if mine is not None and mine is old.get(key) and mine != m.__dict__.get(key):
                    m.__dict__[key] = mine
            if _changed(old, now) or now.keys() != old.keys():
                for key in old.keys() - now.keys():
                    m.__dict__.pop(key, None)
                for key, value in now.items():
                    if old.get(key, now) is not value:
                        m.__dict__[key] = value
            for key, value in shell._buffers.items():
                if key not in m._buffers:  # registered by the forward
                    m._buffers[key] = value

    return write


class Call(NamedTuple):
    """One eager call between :func:`enter` and :func:`leave`."""

    walk: _Walk
    before: list[dict[str, Any]]  # each shell's __dict__ before the forward
    write: Callable[[], None]
    copied: bool

    @property
    def shell(self) -> nn.Module:
        """The root's shell: what runs the forward."""
        return self.walk.pairs[0][1]


def enter(
    module: nn.Module,
    state: Mapping[str, Any],
    *,
    sync_batch_norm: bool,
    group: Any,
    prepare: Callable[[list[tuple[nn.Module, nn.Module]]], None] | None,
) -> Call:
    """A call's shells of ``module``, with ``state``'s tensors installed.

    ``prepare(pairs)`` then runs on the ``(module, shell)`` pairs, the root
    first: the caller may replace a shell's tensors or its ``forward``.
    """
    handles = _compat.hook_handles_made()
    copied = _replica.running()
    walk = _shells(module, sync_batch_norm=sync_batch_norm, group=group, copied=copied)
    pairs = walk.pairs
    _install(walk.slots, state)
    if prepare is not None:  # a fully sharded call installs its units per block
        prepare(pairs)
    before = [shell.__dict__.copy() for _, shell in pairs]
    return Call(walk, before, _writer(pairs, before, handles, copied=copied), copied)


def leave(call: Call, *, failed: bool) -> None:
    """Ends ``call``: what its forward changed of the module's Python state is written back.

    A replica's once every replica has finished, and only replica 0's; a
    direct call that raised leaves what its forward changed before the
    error, as ``module(x)`` does, a replica's that raised nothing
    (DataParallel's rule).
    """
    _unkeep(call.walk, call.before)
    if not failed:
        _replica.defer(call.write)
    elif not call.copied:
        call.write()


def _unkeep(walk: _Walk, before: list[dict[str, Any]]) -> None:
    """Gives the shells that hold a ``_KeepAlive`` the module's hooks back, once called.

    A _KeepAlive refers to its shell; the shell must not refer back (no cycle).
    """
    for index in walk.kept:
        m, shell = walk.pairs[index]
        shell.__dict__["_backward_hooks"] = before[index]["_backward_hooks"] = m._backward_hooks
