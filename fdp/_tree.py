"""optree glue shared by every module: flattening, leaf paths, structure checks.

fdp flattens with ``none_is_leaf=True``: a ``None`` is a leaf with a path of its
own, so a params tree and a grads tree with missing entries have the same
structure and the same leaf count, and error messages can point at a ``None``.
Dict keys are flattened in sorted order (optree's default), so two processes
that built the same dict in different insertion orders agree on leaf order;
unflattening restores each dict's own insertion order.
"""

from __future__ import annotations

import collections
import collections.abc
import operator
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import optree
import torch

from fdp import _mode

NONE_IS_LEAF = True

# optree's spec; while compiling, the nested tuples of _flatten_traceable.
Spec = optree.PyTreeSpec | tuple[Any, ...]


def flatten(tree: Any) -> tuple[list[Any], Spec]:
    """Leaves in optree order and the structure to rebuild the tree."""
    if _mode.traced():  # dynamo traces a walk in Python, not optree's C flatten
        leaves: list[Any] = []
        return leaves, _flatten_traceable(tree, leaves)
    return optree.tree_flatten(tree, none_is_leaf=NONE_IS_LEAF)


def flatten_optree(tree: Any) -> tuple[list[Any], optree.PyTreeSpec] | None:
    """optree's flatten of ``tree`` (C, fast), or None while dynamo traces (see :func:`flatten`)."""
    if _mode.traced():
        return None
    return optree.tree_flatten(tree, none_is_leaf=NONE_IS_LEAF)


def unflatten(spec: Spec, leaves: list[Any]) -> Any:
    """Inverse of :func:`flatten`."""
    if isinstance(spec, tuple):
        return _unflatten_traceable(spec, iter(leaves))
    return optree.tree_unflatten(spec, leaves)


# Dynamo cannot trace optree.tree_flatten over dicts in torch 2.13 (it fails on
# optree's DictMetaData), so while compiling fdp flattens the builtin
# containers itself, in optree's order: dict and defaultdict keys sorted (in
# insertion order when unsortable), OrderedDict in insertion order, tuples,
# namedtuples and lists in order, everything else (None included) a leaf.
# The spec is a nested tuple; unflatten restores each dict's insertion order.
_LEAF = ("*",)


def _sorted_keys(d: dict[Any, Any]) -> list[Any]:
    try:
        return sorted(d)
    except TypeError:
        return list(d)


def _flatten_traceable(node: Any, leaves: list[Any]) -> tuple[Any, ...]:
    kind = type(node)
    if kind is dict or kind is collections.defaultdict or kind is collections.OrderedDict:
        keys = list(node) if kind is collections.OrderedDict else _sorted_keys(node)
        children = tuple(_flatten_traceable(node[k], leaves) for k in keys)
        factory = node.default_factory if kind is collections.defaultdict else None
        return ("dict", kind, factory, tuple(node), tuple(keys), children)
    # getattr, not hasattr: torch 2.10's dynamo cannot trace hasattr on a class under
    # a torch.func transform.
    named = issubclass(kind, tuple) and getattr(kind, "_fields", None) is not None
    if kind is list or kind is tuple or named:
        return ("seq", kind, tuple(_flatten_traceable(c, leaves) for c in node))
    leaves.append(node)
    return _LEAF


def _unflatten_traceable(spec: tuple[Any, ...], leaves: Iterator[Any]) -> Any:
    if spec == _LEAF:
        return next(leaves)
    if spec[0] == "dict":
        _, kind, factory, order, keys, children = spec
        values = {k: _unflatten_traceable(c, leaves) for k, c in zip(keys, children, strict=True)}
        items = [(k, values[k]) for k in order]
        if kind is collections.defaultdict:
            return collections.defaultdict(factory, items)
        return kind(items)
    _, kind, children = spec
    values_ = [_unflatten_traceable(c, leaves) for c in children]
    if kind is list:
        return values_
    if kind is tuple:
        return tuple(values_)
    return kind(*values_)  # a namedtuple


def ties(leaves: Sequence[Any], indices: Iterable[int] | None = None) -> dict[int, int]:
    """Tied leaves: leaf index -> the index of the first leaf holding the same tensor.

    A tensor at several leaves (tied weights) is one tensor: every layer
    copies, shards, reduces or saves it once, at its first leaf, and gives
    the others that same result (as ``load_state_dict`` keeps ties).
    Leaves that are not tensors are never tied. ``indices`` limits the
    leaves looked at (in that order).

    Example:
        >>> w = torch.ones(2)
        >>> ties([w, torch.ones(2), w])
        {2: 0}
    """
    tied: dict[int, int] = {}
    firsts: list[int] = []
    by_id: dict[int, int] = {}
    compiling = _mode.traced()
    for i in range(len(leaves)) if indices is None else indices:
        leaf = leaves[i]
        if not isinstance(leaf, torch.Tensor):
            continue
        if compiling:
            # Note [ties at trace time]: a scan by ``is``, at trace time only: dynamo before torch
            # 2.13 cannot take the id() of a tensor made inside the trace
            # (under a torch.func transform).
            j = next((f for f in firsts if leaves[f] is leaf), i)
        else:
            j = by_id.setdefault(id(leaf), i)
        if j == i:
            firsts.append(i)
        else:
            tied[i] = j
    return tied


def traced_spec(tree: Any) -> tuple[Any, ...] | None:
    """The spec :func:`flatten` gives ``tree`` while compiling, if its leaves match optree's.

    ``None`` when they do not (a custom pytree node is a leaf while compiling):
    then a structure planned eagerly cannot be matched inside a compiled graph.
    """
    traced: list[Any] = []
    spec = _flatten_traceable(tree, traced)
    eager = optree.tree_leaves(tree, none_is_leaf=NONE_IS_LEAF)
    same = len(traced) == len(eager) and all(a is b for a, b in zip(traced, eager, strict=True))
    return spec if same else None


def picker(positions: Sequence[int]) -> Callable[[Sequence[Any]], tuple[Any, ...]]:
    """``lambda s: tuple(s[p] for p in positions)`` in one C call (``operator.itemgetter``).

    For the per-call checks over a tree's leaves: a C call picks them at a
    tenth of a Python loop's cost per leaf.
    """
    if len(positions) == 1:
        only = positions[0]
        return lambda s: (s[only],)
    if not positions:
        return lambda s: ()
    return operator.itemgetter(*positions)


def insertion_order(tree: Any) -> list[int]:
    """``tree``'s leaf indices (optree's order) with every dict's keys in insertion order.

    optree sorts a dict's keys; a dict keeps the order it was built in,
    which for a module's state (``make_functional``, ``named_parameters``)
    is the order the layers run. DDP plans its buckets backwards along it,
    as torch's DDP does along ``model.parameters()``, so that a bucket's
    gradients arrive together in backward.
    """
    return _insertion_order(tree, [0])


def _insertion_order(node: Any, counter: list[int]) -> list[int]:
    if optree.tree_is_leaf(node, none_is_leaf=NONE_IS_LEAF):
        counter[0] += 1
        return [counter[0] - 1]
    children, _, entries, _ = optree.tree_flatten_one_level(node, none_is_leaf=NONE_IS_LEAF)
    spans = [_insertion_order(child, counter) for child in children]
    if type(node) in (dict, collections.defaultdict):  # the kinds optree sorts
        position = {key: p for p, key in enumerate(node)}
        spans = [span for _, span in sorted(zip(entries, spans, strict=True),
                                             key=lambda pair: position[pair[0]])]  # fmt: skip
    return [i for span in spans for i in span]


def paths(tree: Any, root: str) -> list[str]:
    """Python expressions (``params['layers'][0].weight``) naming each leaf of ``tree``."""
    accessors = optree.tree_accessors(tree, none_is_leaf=NONE_IS_LEAF)
    return [accessor.codify(root) for accessor in accessors]


class Planned:
    """The tree a DDP or a ZeroRedundancy was planned for, that later trees must match.

    Its structure (eagerly, and as :func:`flatten` gives it while compiling)
    and each leaf's kind: a tensor's shape, dtype and device, another
    leaf's type. One check, one message, for every caller.
    """

    def __init__(self, tree: Any, *, owner: str) -> None:
        leaves, self.spec = flatten(tree)
        self.traced = traced_spec(tree)
        self.kinds = _kinds(leaves)
        self.owner = owner

    def structure(self, call: str) -> Spec:
        """The spec :func:`flatten` gives a matching tree here (eager or compiling)."""
        if not _mode.traced():
            return self.spec
        if self.traced is None:
            raise TypeError(
                f"{call}: inside torch.compile the tree {self.owner} was planned for must be "
                "built from dicts, lists, tuples and namedtuples (a custom pytree node is a "
                "leaf there); call it outside the compiled function"
            )
        return self.traced

    def leaves(self, call: str, arg: str, tree: Any, *, kinds: bool = True) -> list[Any]:
        """``tree``'s leaves, or a ValueError naming ``arg`` (and the leaf) where it differs."""
        leaves, spec = flatten(tree)
        of = f"the tree {self.owner} was planned for"
        require_structure(call, arg, spec, self.structure(call), of=of)
        if not kinds or _kinds(leaves) == self.kinds:
            return leaves
        for i, leaf in enumerate(leaves):
            if _kind(leaf) != self.kinds[i]:
                raise ValueError(
                    f"{call}: `{arg}` leaf {path(tree, i, arg)} expected "
                    f"{_describe_kind(self.kinds[i])}; got {describe(leaf)}"
                )
        return leaves


def require_structure(call: str, arg: str, got: Spec, expected: Spec, *, of: str) -> None:
    """A ValueError naming ``arg`` unless ``got`` is ``expected``, the structure of ``of``."""
    if got != expected:
        raise ValueError(
            f"{call}: `{arg}` expected the structure of {of}; "
            f"{structure_difference(got, expected, arg)}"
        )


def structure_difference(got: object, expected: object, root: str) -> str:
    """Where ``got`` differs from ``expected``: the first container of another type, else the
    leaves it lacks and adds, by path. Never both specs whole: a model's run to thousands of
    characters, with the one difference hard to find."""
    if not isinstance(got, optree.PyTreeSpec) or not isinstance(expected, optree.PyTreeSpec):
        return f"expected {expected}; got {got}"  # while tracing: fdp's own nested tuples
    want = dict.fromkeys(a.codify(root) for a in expected.accessors())
    have = dict.fromkeys(a.codify(root) for a in got.accessors())
    parts = [] if len(want) == len(have) else [f"expected {_count(len(want))}, got {len(have)}"]
    retyped = _retyped(got, expected, root)
    missing = [p for p in want if p not in have]
    extra = [p for p in have if p not in want]
    if retyped is not None:
        parts.append(retyped)
    else:
        if missing:
            parts.append(f"missing {_some(missing)}")
        if extra:
            parts.append(f"unexpected {_some(extra)}")
    # Same leaves, same containers: a node's metadata (a defaultdict's factory) differs.
    return "; ".join(parts) or "a container's metadata differs (a defaultdict's default_factory)"


def _count(n: int) -> str:
    return f"{n} leaf" if n == 1 else f"{n} leaves"


def _some(paths: list[str], shown: int = 3) -> str:
    more = f" and {len(paths) - shown} more" if len(paths) > shown else ""
    return ", ".join(paths[:shown]) + more


def _retyped(got: optree.PyTreeSpec, expected: optree.PyTreeSpec, at: str) -> str | None:
    """The first container (depth first, along entries both have) of another type, if any."""
    if got.type is not expected.type:
        return f"{at} is {_node(got)} where {_node(expected)} was expected"
    named = got.type is not None and not issubclass(got.type, collections.abc.Mapping)
    ours = dict(zip(expected.entries(), expected.children(), strict=True))
    for entry, child in zip(got.entries(), got.children(), strict=True):
        theirs = ours.get(entry)
        if theirs is not None and child != theirs:
            fields = getattr(got.type, "_fields", None)  # a namedtuple's entries are indices
            if fields is not None and isinstance(entry, int):
                entry = fields[entry]
            step = f".{entry}" if named and isinstance(entry, str) else f"[{entry!r}]"
            found = _retyped(child, theirs, at + step)
            if found is not None:
                return found
    return None


def _node(spec: optree.PyTreeSpec) -> str:
    if spec.is_leaf():
        return "a leaf"
    name = getattr(spec.type, "__name__", str(spec.type))
    return f"an {name}" if name[:1].lower() in "aeiou" else f"a {name}"


def _kinds(leaves: list[Any]) -> list[tuple[Any, ...]]:
    """Each leaf's :func:`_kind` (inline: a call per leaf is a third of the cost)."""
    tensor = torch.Tensor
    return [
        ("tensor", t.shape, t.dtype, t.device) if isinstance(t, tensor) else ("other", type(t))
        for t in leaves
    ]


def _kind(leaf: Any) -> tuple[Any, ...]:
    if isinstance(leaf, torch.Tensor):
        return ("tensor", leaf.shape, leaf.dtype, leaf.device)
    return ("other", type(leaf))


def _describe_kind(kind: tuple[Any, ...]) -> str:
    if kind[0] == "tensor":
        return f"a tensor of shape {tuple(kind[1])}, dtype {kind[2]} on {kind[3]}"
    return "None" if kind[1] is type(None) else f"a {kind[1].__name__}"


def names(tree: Any) -> list[str]:
    """Each leaf's dotted name, as ``named_parameters`` writes it (``layers.0.weight``)."""
    accessors = optree.tree_accessors(tree, none_is_leaf=NONE_IS_LEAF)
    return [".".join(str(getattr(e, "field", e.entry)) for e in accessor) for accessor in accessors]


def segments(tree: Any) -> list[list[tuple[str, bool]]]:
    """Each leaf's name as segments, each with whether it indexes a sequence.

    A key holding dots (``make_functional``'s flat ``"h.0.attn.weight"``) is
    split as ``named_parameters`` wrote it, and a segment of digits there, or
    a dict key of digits, counts as an index, as a ``ModuleList``'s does: a
    flat state and its nested form give the same segments.
    """
    out = []
    for accessor in optree.tree_accessors(tree, none_is_leaf=NONE_IS_LEAF):
        parts: list[tuple[str, bool]] = []
        for e in accessor:
            if isinstance(e, optree.SequenceEntry) and not hasattr(e, "field"):
                parts.append((str(e.entry), True))
            elif isinstance(e.entry, str) and not hasattr(e, "field"):
                parts += [(piece, piece.isdigit()) for piece in e.entry.split(".")]
            else:
                parts.append((str(getattr(e, "field", e.entry)), False))
        out.append(parts)
    return out


def block(parts: list[tuple[str, bool]]) -> str:
    """A leaf's block, from its name's segments (:func:`segments`): FSDP's default
    unit, and what Streaming DiLoCo's default fragments keep whole.

    The top-level entry, or the element of a top-level list; within it, the
    first list element (a ``ModuleList``'s block) that holds more than one
    leaf's worth of path, so every transformer block is a unit, whether the
    state is nested or flat with dotted names (``transformer.h.0``).
    """
    if not parts:
        return ""
    end = 2 if len(parts) > 1 and parts[1][1] and not parts[0][1] else 1
    for i in range(end, len(parts) - 1):
        if parts[i][1]:
            end = i + 1
            break
    return ".".join(name for name, _ in parts[:end])


def path(tree: Any, index: int, root: str) -> str:
    """The path of leaf ``index``; computed only when an error needs it."""
    return paths(tree, root)[index]


def describe(leaf: object) -> str:
    """A short description of a leaf for error messages."""
    import torch

    if isinstance(leaf, torch.Tensor):
        return f"a tensor of shape {tuple(leaf.shape)}, dtype {leaf.dtype} on {leaf.device}"
    if leaf is None:
        return "None"
    return f"{type(leaf).__name__} {leaf!r}"[:200]


def describe_tree(tree: object, *, each: str) -> str:
    """:func:`describe` of a leaf; a container by its type and size, with ``each``:
    how to call for each leaf. Never printed whole: dynamo cannot print a tensor."""
    leaves, _ = flatten(tree)
    if len(leaves) == 1 and leaves[0] is tree:
        return describe(tree)
    count = f"{len(leaves)} leaf" if len(leaves) == 1 else f"{len(leaves)} leaves"
    return f"a {type(tree).__name__} of {count} (one tensor a call: {each})"


def tensor_leaves(
    tree: Any, *, call: str, arg: str, float_only: bool
) -> tuple[list[Any], Any, list[torch.Tensor | None]]:
    """Leaves, spec, and per leaf the tensor to communicate (None: not communicated)."""
    leaves, spec = flatten(tree)
    selected: list[torch.Tensor | None] = []
    for i, leaf in enumerate(leaves):
        if leaf is None:
            selected.append(None)
            continue
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"{call}: `{arg}` leaf {path(tree, i, arg)} expected a tensor or None; "
                f"got {describe(leaf)}{torch_habit(leaf)}"
            )
        if leaf.layout != torch.strided:
            raise TypeError(
                f"{call}: `{arg}` leaf {path(tree, i, arg)} expected a dense tensor; "
                f"got layout {leaf.layout}"
            )
        floating = leaf.is_floating_point() or leaf.is_complex()
        selected.append(leaf if floating or not float_only else None)
    return leaves, spec, selected


def torch_habit(leaf: Any) -> str:
    """What to do instead, for a leaf a torch.nn user passes where fdp takes a tree of tensors."""
    if isinstance(leaf, torch.nn.Module):
        return (
            ". fdp works on a module's state, not the module (torch's DDP wraps the "
            "module): fn, state = fdp.make_functional(module), then pass state"
        )
    if isinstance(leaf, Iterator):
        return (
            ". An iterator (module.parameters()?) is read once and has no names: pass a "
            "tree of tensors, such as the state of fn, state = fdp.make_functional(module)"
        )
    return ""
