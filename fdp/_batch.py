"""Batches in the containers users really pass: flattening them to split, and rebuilding.

``scatter`` and ``gather`` see inputs and outputs through :func:`flatten`, which
goes into far more than optree's builtin nodes: dict and list subclasses, any
``Mapping`` (Hugging Face's ``BatchEncoding``) or ``Sequence``, namedtuples,
dataclasses, and node types registered with optree (in any namespace) or with
``torch.utils._pytree``. Each replica gets the user's own type back, rebuilt
around its chunk. A user container that holds no tensor is not split at all:
every replica gets the object itself. Any other object that holds tensors is
refused with an error, because splitting it is impossible and broadcasting it
whole would silently give every replica the full batch.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
from collections.abc import Iterator, Mapping, MutableMapping, MutableSequence, Sequence
from typing import Any, Union

import optree
import torch

from fdp import _compat, _tree

_ATOMS = (str, bytes, bytearray, int, float, complex, bool, torch.device, torch.dtype, range)
_PLAIN = (torch.Tensor, type(None), *_ATOMS)
_DICTS = (dict, collections.OrderedDict, collections.defaultdict)


class Node:
    """One container of a flattened batch: how to rebuild it around new children.

    ``children`` holds a ``Node`` per child container and ``None`` per leaf.
    Two nodes are equal when kind, type, keys and children agree (the
    container's other contents, kept in ``template``, are not compared).
    """

    __slots__ = ("children", "keys", "kind", "template", "type")

    def __init__(
        self, kind: str, template: Any, keys: tuple[Any, ...], children: tuple[Node | None, ...]
    ) -> None:
        self.kind = kind
        self.type = type(template)
        self.template = template  # the original, or a registered node's context
        self.keys = keys
        self.children = children

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Node) and (self.kind, self.type, self.keys, self.children) == (
            other.kind,
            other.type,
            other.keys,
            other.children,
        )

    def __hash__(self) -> int:
        return hash((self.kind, self.type, self.keys))

    def __repr__(self) -> str:
        inner = ", ".join(
            f"{k!r}: {'*' if c is None else repr(c)}"
            for k, c in zip(self.keys, self.children, strict=False)
        )
        return f"{self.type.__name__}({inner})"


Spec = Union[Node, optree.PyTreeSpec, None]  # noqa: UP007 (a runtime alias, py3.10)


def flatten(tree: Any, *, call: str, root: str) -> tuple[list[Any], Spec]:
    """The leaves of ``tree`` and its structure (``None``: the tree is one leaf).

    Trees of builtin containers only (the common case) take optree's C
    flatten; anything else is walked here. While compiling, always walked:
    dynamo traces the walk, not optree over dicts.
    """
    fast = _tree.flatten_optree(tree)
    if fast is not None and all(isinstance(leaf, _PLAIN) for leaf in fast[0]):
        return fast
    leaves: list[Any] = []
    return leaves, _walk(tree, leaves, root, call)


def _children(x: Any) -> tuple[str, tuple[Any, ...], list[Any], Any] | None:
    """``(kind, keys, children, template)`` of a container, ``None`` for a leaf."""
    kind = type(x)
    if isinstance(x, torch.Tensor) or x is None or isinstance(x, _ATOMS):
        return None
    if kind in _DICTS:
        return "dict", tuple(x), list(x.values()), x
    if kind is list or kind is tuple:
        return "seq", tuple(range(len(x))), list(x), x
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return "namedtuple", tuple(x._fields), list(x), x
    registered = _compat.registered_node(kind)
    if registered is not None:
        children, context = registered[0](x)
        return "registered", tuple(range(len(children))), children, (x, context)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        names = tuple(f.name for f in dataclasses.fields(x))
        return "dataclass", names, [getattr(x, n) for n in names], x
    if isinstance(x, Mapping):
        return "mapping", tuple(x), [x[k] for k in x], x
    if isinstance(x, Sequence):
        return "sequence", tuple(range(len(x))), list(x), x
    return None


def _walk(x: Any, leaves: list[Any], path: str, call: str) -> Node | None:
    found = _children(x)
    if found is None:
        _refuse_opaque(x, path, call)
        leaves.append(x)
        return None
    kind, keys, children, template = found
    start = len(leaves)
    nodes = tuple(
        _walk(c, leaves, _child_path(path, kind, k), call)
        for k, c in zip(keys, children, strict=True)
    )
    if kind not in ("dict", "seq", "namedtuple") and not any(
        isinstance(leaf, torch.Tensor) for leaf in leaves[start:]
    ):
        # A user container without tensors is shared whole, never rebuilt.
        del leaves[start:]
        leaves.append(x)
        return None
    node = Node(kind, template, keys, nodes)
    if kind == "registered":
        node.type, node.template = type(template[0]), template[1]
    return node


def _child_path(path: str, kind: str, key: Any) -> str:
    if kind in ("namedtuple", "dataclass"):
        return f"{path}.{key}"
    return f"{path}[{key!r}]"


def _refuse_opaque(x: Any, path: str, call: str) -> None:
    """Raises if ``x`` is an object fdp cannot split that holds tensors."""
    if isinstance(x, (torch.Tensor, torch.nn.Module, type)) or x is None or isinstance(x, _ATOMS):
        return  # a module or a class is an argument shared by every replica, not data
    holder = _tensor_inside(x, path, depth=2)
    if holder is not None:
        raise TypeError(
            f"{call}: leaf {path} is a {type(x).__qualname__}, which fdp cannot split, and it "
            f"holds a tensor at {holder}; expected tensors in a dict, list, tuple, namedtuple, "
            "Mapping, Sequence or dataclass, or a type registered with "
            "optree.register_pytree_node or torch.utils._pytree.register_pytree_node. "
            "Register it, or pass its tensors directly"
        )


def _tensor_inside(x: Any, path: str, *, depth: int) -> str | None:
    """The path of a tensor among ``x``'s attributes (a few levels deep), if any."""
    if depth == 0:
        return None
    attrs = dict(getattr(x, "__dict__", {}))
    for name in getattr(type(x), "__slots__", ()):
        if hasattr(x, name):
            attrs[name] = getattr(x, name)
    for name, value in attrs.items():
        if isinstance(value, torch.Tensor):
            return f"{path}.{name}"
        if isinstance(value, (list, tuple, dict)):
            for i, item in enumerate(value.values() if isinstance(value, dict) else value):
                if isinstance(item, torch.Tensor):
                    return f"{path}.{name}[{i}]"
        elif not isinstance(value, _ATOMS) and value is not None:
            inner = _tensor_inside(value, f"{path}.{name}", depth=depth - 1)
            if inner is not None:
                return inner
    return None


def unflatten(spec: Spec, leaves: list[Any]) -> Any:
    """Inverse of :func:`flatten`, the user's types rebuilt around ``leaves``."""
    if isinstance(spec, optree.PyTreeSpec):
        return optree.tree_unflatten(spec, leaves)
    return _build(spec, iter(leaves))


def _build(spec: Node | None, leaves: Iterator[Any]) -> Any:
    if spec is None:
        return next(leaves)
    children = [_build(c, leaves) for c in spec.children]
    kind, template = spec.kind, spec.template
    if kind == "registered":
        return _compat.registered_node(spec.type)[1](template, children)  # type: ignore[index]
    if kind == "seq":
        return children if spec.type is list else tuple(children)
    if kind == "namedtuple":
        return spec.type(*children)
    if kind == "dict":
        items = zip(spec.keys, children, strict=True)
        if spec.type is collections.defaultdict:
            return collections.defaultdict(template.default_factory, items)
        return spec.type(items)
    return _rebuild(spec, children)


def _rebuild(spec: Node, children: list[Any]) -> Any:
    """A user's Mapping, Sequence or dataclass with new children, same type and extras."""
    template = spec.template
    if spec.kind == "dataclass":
        new = copy.copy(template)
        for name, value in zip(spec.keys, children, strict=True):
            object.__setattr__(new, name, value)  # frozen dataclasses too
        return new
    if isinstance(template, collections.deque):
        return collections.deque(children, maxlen=template.maxlen)
    if isinstance(template, (MutableMapping, MutableSequence)):
        new = copy.copy(template)
        if isinstance(new, MutableMapping):
            for key, value in zip(spec.keys, children, strict=True):
                new[key] = value
        else:
            new[:] = children
        return new
    if isinstance(template, Mapping):
        return spec.type(zip(spec.keys, children, strict=True))
    return spec.type(children)


def paths(spec: Spec, root: str) -> list[str]:
    """The path of every leaf, in leaf order (for error messages)."""
    if isinstance(spec, optree.PyTreeSpec):
        return [accessor.codify(root) for accessor in spec.accessors()]
    if spec is None:
        return [root]
    out: list[str] = []
    for key, child in zip(spec.keys, spec.children, strict=True):
        out.extend(paths(child, _child_path(root, spec.kind, key)))
    return out
