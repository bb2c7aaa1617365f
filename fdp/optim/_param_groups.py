"""``fdp.optim.param_groups``: torch.optim's parameter groups over a parameter tree.

Each leaf gets a label (from a function of its name and tensor, or a tree of
labels), each label an optimizer with its own hyperparameters: no weight
decay on biases and norms, a smaller learning rate for a pretrained trunk,
Muon on the weight matrices and AdamW on the rest. One step runs every group's
optimizer on its own leaves; a leaf's ``None`` gradient already means "leave
it as it is" to every ``fdp.optim`` optimizer, so each group's update sees
the other groups' gradients as ``None``. The state has one optimizer's
format, every group's slots (``None`` at a leaf whose group has no such
slot), so checkpoints and :class:`fdp.ZeroRedundancy` take it unchanged;
ZeroRedundancy labels its slices by the leaves they come from.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch

from fdp import _sharded, _tree
from fdp.optim._pending import Chain, Pending

T = TypeVar("T")
Label = Callable[[str, torch.Tensor], str]


def refuse_shards(call: str, params: Any, *, why: str, instead: str) -> None:
    """Raises if ``params`` are a registered holder's shards: ``why`` they cannot be stepped."""
    owner = _sharded.owner(params)
    if owner is not None:
        raise ValueError(
            f"{call}: `params` are the shards of {owner!r}: each shard holds pieces of "
            f"several leaves in one 1-D tensor, {why}; {instead}"
        )


def _refuse_shards(call: str, params: Any) -> None:
    refuse_shards(
        call,
        params,
        why="so `label` would see every shard as a 1-D tensor (t.ndim <= 1 everywhere) "
        "and name no leaf",
        instead="use fsdp.optimizer(fdp.optim.param_groups(...)), which labels each piece by "
        "its leaf",
    )


class ParamGroups:
    """Several optimizers, one per label of the parameters; see :func:`param_groups`."""

    name = "param_groups"

    def __init__(self, label: Label | Any, optimizers: Mapping[str, Any]) -> None:
        call = "fdp.optim.param_groups"
        if not isinstance(optimizers, Mapping) or not optimizers:
            raise TypeError(
                f"{call}: `optimizers` expected a non-empty dict of label -> fdp.optim optimizer; "
                f"got {_tree.describe(optimizers)}"
            )
        for k, opt in optimizers.items():
            if not (
                callable(getattr(opt, "init", None)) and callable(getattr(opt, "update", None))
            ):
                raise TypeError(
                    f"{call}: `optimizers[{k!r}]` expected an fdp.optim optimizer; "
                    f"got {_tree.describe(opt)}"
                )
        self.label, self.optimizers = label, dict(optimizers)
        # Every group's slots, in order: a leaf holds its own group's, None in the others
        # (Muon's momentum on the matrices, AdamW's moments on the rest).
        self.slots = tuple(
            dict.fromkeys(k for o in optimizers.values() for k in getattr(o, "slots", ()))
        )
        self.whole_leaf = any(getattr(o, "whole_leaf", False) for o in optimizers.values())

    @property
    def shared_slots(self) -> bool:
        """Whether every group keeps the same slots (one optimizer's state format)."""
        return all(tuple(getattr(o, "slots", ())) == self.slots for o in self.optimizers.values())

    def __repr__(self) -> str:
        return f"fdp.optim.param_groups({self.label!r}, {self.optimizers!r})"

    def labels(self, params: Any) -> list[str | None]:
        """Each leaf's label (``None`` for a ``None`` leaf), checked against ``optimizers``."""
        call = "fdp.optim.param_groups"
        leaves, spec = _tree.flatten(params)
        if callable(self.label):
            _refuse_shards(call, params)
            names = _tree.names(params)
            got = [None if t is None else self.label(names[i], t) for i, t in enumerate(leaves)]
        else:
            given, given_spec = _tree.flatten(self.label)
            if given_spec != spec:
                raise ValueError(
                    f"{call}: `label` expected a tree of labels shaped like `params`, or a "
                    "function (name, tensor) -> label; "
                    f"{_tree.structure_difference(given_spec, spec, 'label')}"
                )
            got = [None if t is None else given[i] for i, t in enumerate(leaves)]
        first: dict[int, int] = {}  # a tensor's first leaf, for tied weights
        for i, lab in enumerate(got):
            if leaves[i] is not None and lab not in self.optimizers:
                raise ValueError(
                    f"{call}: `label` gave leaf {_tree.path(params, i, 'params')} the label "
                    f"{lab!r}; expected one of {sorted(self.optimizers)}"
                )
            j = first.setdefault(id(leaves[i]), i) if leaves[i] is not None else i
            if got[j] != lab:  # torch.optim refuses a parameter in two groups
                raise ValueError(
                    f"{call}: `label` gave one tensor (tied) two labels: leaf "
                    f"{_tree.path(params, j, 'params')} {got[j]!r} and leaf "
                    f"{_tree.path(params, i, 'params')} {lab!r}; expected one group per "
                    "tensor, as torch.optim does (its steps would apply twice)"
                )
        return got

    def init(self, params: Any) -> dict[str, Any]:
        """The state before the first step: each leaf's own group's slots, ``None`` in others'."""
        if self.shared_slots:  # one format: the first optimizer's init says it all
            return dict(next(iter(self.optimizers.values())).init(params))
        return self.init_labelled(params, self.labels(params))

    def init_labelled(
        self, params: Any, labels: Sequence[str | None], *, pieces: bool = False
    ) -> dict[str, Any]:
        """:meth:`init` with each leaf's label given (``labels``, one per leaf); ``pieces``:
        the leaves are slices of leaves (whole-leaf optimizers do not check their shapes)."""
        leaves, spec = _tree.flatten(params)
        out: dict[str, list[Any]] = {k: [None] * len(leaves) for k in ("step", *self.slots)}
        for label, opt in self.optimizers.items():
            mine = [t if lab == label else None for t, lab in zip(leaves, labels, strict=True)]
            if all(t is None for t in mine):
                continue
            init = getattr(opt, "init_pieces", opt.init) if pieces else opt.init
            for key, tree in init(_tree.unflatten(spec, mine)).items():
                for i, value in enumerate(_tree.flatten(tree)[0]):
                    if mine[i] is not None:
                        out[key][i] = value
        return {k: _tree.unflatten(spec, v) for k, v in out.items()}

    def init_every(self, params: Any) -> dict[str, Any]:
        """Every group's slots for every leaf (trees that cannot be labelled: shards)."""
        state: dict[str, Any] = {}
        for opt in self.optimizers.values():
            init = getattr(opt, "init_pieces", opt.init)  # shards are slices, not matrices
            for key, tree in init(params).items():
                state.setdefault(key, tree)
        return state

    def update(
        self, grads: Any, state: dict[str, Any], params: T, *, donate: bool = False
    ) -> tuple[T, dict[str, Any]]:
        """One step of every group's optimizer on its own leaves."""
        return self.bind(self.labels(params)).update(grads, state, params, donate=donate)

    def bind(self, labels: Sequence[str | None]) -> Bound:
        """The optimizer for a flat list of leaves labelled ``labels`` (ZeroRedundancy's slices)."""
        return Bound(self, list(labels))


class Bound:
    """:class:`ParamGroups` with fixed per-leaf labels."""

    def __init__(self, groups: ParamGroups, labels: list[str | None]) -> None:
        self.groups, self.labels, self.slots = groups, labels, groups.slots

    def init(self, params: Any) -> dict[str, Any]:
        return self.groups.init_labelled(params, self.labels, pieces=True)

    def update(
        self, grads: Any, state: dict[str, Any], params: T, *, donate: bool = False
    ) -> tuple[T, dict[str, Any]]:
        g, spec = _tree.flatten(grads)
        if len(g) != len(self.labels):
            raise ValueError(
                f"fdp.optim.param_groups.update: `grads` expected {len(self.labels)} leaves "
                f"(the labelled parameters); got {len(g)}"
            )
        for label, opt in self.groups.optimizers.items():
            mine = [gi if lab == label else None for gi, lab in zip(g, self.labels, strict=True)]
            if all(m is None for m in mine):
                continue
            extra = {"donate": True} if donate else {}
            params, new = opt.update(_tree.unflatten(spec, mine), state, params, **extra)
            state = {**state, **new}  # the other groups' slots stay
        return params, state

    def begin(
        self, grads: Any, state: dict[str, Any], params: Any, *, donate: bool = False
    ) -> Pending:
        """The groups' step up to the whole-leaf transform (``WholeLeafOptimizer.begin``).

        Groups of element-wise optimizers step completely here; whole-leaf
        groups give their directions, which ``Pending.finish`` completes.
        """
        g, spec = _tree.flatten(grads)
        directions: list[torch.Tensor | None] = [None] * len(g)
        pendings = []
        for label, opt in self.groups.optimizers.items():
            mine = [gi if lab == label else None for gi, lab in zip(g, self.labels, strict=True)]
            if all(m is None for m in mine):
                continue
            if getattr(opt, "whole_leaf", False):
                pending = opt.begin(_tree.unflatten(spec, mine), state, params, donate=donate)
                params, state = pending.params, {**state, **pending.state}
                for i, d in enumerate(pending.directions):
                    if d is not None:
                        directions[i] = d
                pendings.append(pending)
            else:
                extra = {"donate": True} if donate else {}
                params, new = opt.update(_tree.unflatten(spec, mine), state, params, **extra)
                state = {**state, **new}
        return Pending(directions, params, state, Chain(pendings))


def param_groups(label: Label | Any, optimizers: Mapping[str, Any]) -> ParamGroups:
    """torch.optim's parameter groups: an optimizer per label of the parameter leaves.

    Args:
        label: a function ``(name, tensor) -> label`` (``name`` is the leaf's
            dotted path, ``"layers.0.b"``, as ``named_parameters`` gives it;
            a namedtuple's field by name),
            or a tree of labels shaped like the parameters.
        optimizers: ``{label: optimizer}`` (e.g. AdamW with and without
            weight decay, or Muon and AdamW).

    Returns:
        An optimizer with ``init`` and ``update``; its state holds every
        group's slots (``None`` where a leaf's group has no such slot).

    Raises:
        ValueError: a leaf's label is not in ``optimizers``, or the
            optimizers' state slots differ.

    Example:
        >>> import torch, fdp
        >>> no_decay = lambda name, t: "no_decay" if t.ndim <= 1 else "decay"
        >>> opt = fdp.optim.param_groups(
        ...     no_decay,
        ...     {"decay": fdp.optim.sgd(0.1, weight_decay=1.0), "no_decay": fdp.optim.sgd(0.1)},
        ... )
        >>> params = {"w": torch.ones(1, 1), "b": torch.ones(1)}
        >>> zeros = {"w": torch.zeros(1, 1), "b": torch.zeros(1)}
        >>> new, _ = opt.update(zeros, opt.init(params), params)
        >>> new["w"].item(), new["b"].item()
        (0.8999999761581421, 1.0)
    """
    return ParamGroups(label, optimizers)
