"""Optimizers whose update needs each whole leaf: ``fdp.optim.WholeLeafOptimizer``.

Muon orthogonalizes each weight matrix's momentum; Shampoo preconditions it
from both sides; normalized SGD divides it by its norm. Each update is
three parts, and only the middle one needs the whole leaf:

1. :meth:`WholeLeafOptimizer.direction`, element by element: the state's new
   slots (momentum) and the direction the update starts from;
2. :meth:`WholeLeafOptimizer.transform`, per leaf: a function of the whole
   direction (Newton-Schulz, a norm), given a stack of same-shaped leaves
   at once (one batched call);
3. :meth:`WholeLeafOptimizer.apply`, element by element: the new parameters
   from the transformed updates (decay, a rate that depends on the shape).

Written that way, a step over whole leaves is the three parts in a row; a
sharded strategy can run parts 1 and 3 on its slices and part 2 where the
whole leaf is (``Optimizer``'s docstring has the contract every optimizer
keeps; this class adds the split).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from typing import Any, TypeVar

import torch

from fdp import _tree
from fdp.optim import _lists, _param_groups
from fdp.optim._base import Optimizer, is_param, like_leaves
from fdp.optim._lists import Lists, Ops
from fdp.optim._pending import Pending

T = TypeVar("T")


class WholeLeafOptimizer(Optimizer):
    """An optimizer whose update is a function of each whole leaf (Muon, normalized SGD).

    Subclass it, set ``name``, ``slots`` and ``min_ndim`` (leaves with fewer
    dimensions are refused, naming ``fdp.optim.param_groups``), and write
    :meth:`direction` and :meth:`transform` (and :meth:`apply` when the
    step is not ``params - lr * update``). Schedules, ``donate=True``,
    compiled steps, steps under ``torch.func`` transforms, ``param_groups``
    and checkpoints work as for ``sgd`` and ``adamw``. Complex leaves are
    refused (a matrix function of their real view would not be theirs).

    Example (normalized SGD with momentum)::

        >>> import torch, fdp
        >>> class NormalizedSGD(fdp.optim.WholeLeafOptimizer):
        ...     name, slots, min_ndim = "normalized_sgd", ("momentum_buffer",), 1
        ...     def direction(self, ops, params, grads, slots, steps, donate):
        ...         bufs = ops("lerp", slots["momentum_buffer"], grads, 0.1, own=donate)
        ...         return bufs, {"momentum_buffer": bufs}
        ...     def transform(self, directions):
        ...         dims = tuple(range(1, directions.ndim))  # dim 0 stacks the leaves
        ...         return directions / directions.norm(dim=dims, keepdim=True).clamp(min=1e-12)
        >>> opt = NormalizedSGD(0.5)
        >>> p = {"w": torch.ones(2, 2)}
        >>> p, state = opt.update({"w": torch.full((2, 2), 3.0)}, opt.init(p), p)
        >>> p["w"][0].tolist()
        [0.75, 0.75]
    """

    whole_leaf = True  # what ZeroRedundancy and fsdp.optimizer look for
    min_ndim = 1

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        where = f"fdp.optim.WholeLeafOptimizer subclass {cls.__qualname__}"
        for method in ("direction", "transform"):
            if getattr(cls, method) is getattr(WholeLeafOptimizer, method):
                raise TypeError(f"{where}: expected a `{method}` method (see its docstring)")

    def direction(
        self,
        ops: Ops,
        params: Lists,
        grads: Lists,
        slots: Mapping[str, Lists],
        steps: Lists,
        donate: bool,
    ) -> tuple[Lists, Mapping[str, Lists]]:
        """Element by element: each leaf's direction, and the new slots.

        The arguments are :meth:`Optimizer.rule`'s. A direction may be a
        new slot itself: :meth:`transform` must not write into it.
        """
        raise NotImplementedError

    def transform(self, directions: torch.Tensor) -> torch.Tensor:
        """Whole leaves: the updates of a stack of same-shaped leaves' directions.

        ``directions`` has the leaves along dimension 0 (``(k, *shape)``);
        return a tensor of the same shape (in any dtype: it is cast to the
        leaf's), a function of each leaf alone, without writing into
        ``directions``.
        """
        raise NotImplementedError

    def apply(
        self,
        ops: Ops,
        params: Lists,
        updates: Lists,
        shapes: list[torch.Size],
        lr: float | torch.Tensor,
        donate: bool,
    ) -> Lists:
        """Element by element: the new parameters, ``params - lr * updates`` unless overridden.

        ``shapes`` are the whole leaves' shapes (a slice's own shape may differ).
        """
        return self._scaled_add(ops, params, updates, -lr, donate)

    def rule(
        self,
        ops: Ops,
        params: Lists,
        grads: Lists,
        slots: Mapping[str, Lists],
        steps: Lists,
        donate: bool,
        lr: float | torch.Tensor,
    ) -> tuple[Lists, Mapping[str, Lists]]:
        """The three parts over whole leaves (see the module docstring)."""
        directions, new_slots = self.direction(ops, params, grads, slots, steps, donate)
        updates = transform_leaves(self.transform, list(directions))
        shapes = [p.shape for p in params]
        return self.apply(ops, params, updates, shapes, lr, donate), new_slots

    def init(self, params: Any) -> dict[str, Any]:
        """The state before the first step; leaves this optimizer cannot step are refused."""
        self._check_leaves(f"fdp.optim.{self.name}.init", params, None)
        return super().init(params)

    def init_pieces(self, pieces: Any) -> dict[str, Any]:
        """:meth:`init` of slices of leaves (a sharded strategy's), which are not checked."""
        return super().init(pieces)

    def update(
        self, grads: Any, state: dict[str, Any], params: T, *, donate: bool = False
    ) -> tuple[T, dict[str, Any]]:
        """One step (see :meth:`Optimizer.update`); leaves it cannot step are refused."""
        self._check_leaves(f"fdp.optim.{self.name}.update", params, grads)
        pending = self.begin(grads, state, params, donate=donate)
        live = [(i, d) for i, d in enumerate(pending.directions) if d is not None]
        done = transform_leaves(self.transform, [d for _, d in live])
        updates: list[torch.Tensor | None] = [None] * len(pending.directions)
        for (i, _), u in zip(live, done, strict=True):
            updates[i] = u
        return self.finish(pending, updates)

    def begin(
        self, grads: Any, state: dict[str, Any], params: Any, *, donate: bool = False
    ) -> Pending:
        """The step's first part: the new state and each stepped leaf's direction.

        :meth:`update` is ``begin``, :meth:`transform` of each direction,
        then :meth:`finish`; a sharded strategy calls the two on its slices
        and transforms where the whole leaves are. Checks as ``update``.
        """
        leaves, _ = _tree.flatten(params)
        g = _tree.flatten(grads)[0]
        live = [i for i, t in enumerate(leaves) if is_param(t) and i < len(g) and g[i] is not None]
        box: dict[str, Any] = {}

        def rule(
            ops: Ops, ps: Lists, gs: Lists, slots: Mapping[str, Lists], steps: Lists, own: bool,
            lr: float | torch.Tensor,
        ) -> tuple[Lists, Mapping[str, Lists]]:  # fmt: skip
            directions, new_slots = self.direction(ops, ps, gs, slots, steps, own)
            box.update(ops=ops, params=list(ps), directions=list(directions), lr=lr)
            return ps, new_slots

        new_params, new_state = self._update_with(rule, grads, state, params, donate=donate)
        directions: list[torch.Tensor | None] = [None] * len(leaves)
        for j, i in enumerate(live if box else []):
            directions[i] = box["directions"][j]
        return Pending(directions, new_params, new_state, _Finisher(self, box, live, donate))

    def finish(
        self,
        pending: Pending,
        updates: list[torch.Tensor | None],
        *,
        params: Any = None,
        shapes: list[torch.Size | None] | None = None,
    ) -> tuple[Any, dict[str, Any]]:
        """The step's last part: the new parameters from each stepped leaf's update.

        ``updates`` are aligned with ``pending.directions``; ``params`` (by
        default ``pending.params``) is the tree whose stepped leaves are
        replaced; ``shapes`` the whole leaves' shapes where a leaf is a
        slice of one (by default each leaf's own).
        """
        return pending.finish(updates, params=params, shapes=shapes)

    def _check_leaves(self, call: str, params: Any, grads: Any) -> None:
        """Refuses complex leaves and leaves of too few dimensions (with a gradient, if given)."""
        leaves, spec = _tree.flatten(params)
        stepped = None
        if grads is not None:
            g, got = _tree.flatten(grads)
            stepped = [x is not None for x in g] if got == spec else None
        for i, t in enumerate(leaves):
            if not isinstance(t, torch.Tensor) or not (t.is_floating_point() or t.is_complex()):
                continue
            if stepped is not None and not stepped[i]:  # another group's leaf (param_groups)
                continue
            where = f"`params` leaf {_tree.path(params, i, 'params')}"
            if t.is_complex():
                raise ValueError(
                    f"{call}: {where} expected a real floating-point tensor; got {t.dtype} "
                    f"({self.name} transforms whole real leaves): step it with another "
                    "optimizer through fdp.optim.param_groups"
                )
            if t.ndim < self.min_ndim:
                _param_groups.refuse_shards(
                    call,
                    params,
                    why=f"and {self.name} needs each whole leaf",
                    instead="use fsdp.optimizer(...), which sends each leaf's pieces to one "
                    "rank to step it whole",
                )
                raise ValueError(
                    f"{call}: {where} expected a tensor of at least {self.min_ndim} "
                    f"dimensions; got shape {tuple(t.shape)}. Give such leaves (biases, norms) "
                    "another optimizer with fdp.optim.param_groups, e.g. "
                    f"param_groups(lambda name, t: '{self.name}' if t.ndim >= {self.min_ndim} "
                    f"else 'adamw', {{'{self.name}': ..., 'adamw': fdp.optim.adamw(...)}})"
                )


def transform_leaves(transform: Any, directions: list[torch.Tensor]) -> list[torch.Tensor]:
    """``transform`` over same-shaped leaves stacked (one call per shape, dtype and device)."""
    groups: dict[tuple[Any, ...], list[int]] = {}
    for j, d in enumerate(directions):
        groups.setdefault((tuple(d.shape), d.dtype, d.device), []).append(j)
    out: list[Any] = [None] * len(directions)
    for idx in groups.values():
        if len(idx) == 1:  # no copy
            stacked = directions[idx[0]].unsqueeze(0)
        else:
            stacked = torch.stack([directions[j] for j in idx])
        updates = transform_stack(transform, stacked)
        for j, u in zip(idx, updates.unbind(0), strict=True):
            # In the leaf's dtype: exact (torch adds a bfloat16 update to a float32
            # parameter the same way), and a tensor rate times it is not rounded to bfloat16.
            out[j] = u.to(directions[j].dtype)
    return out


def transform_stack(transform: Any, stacked: torch.Tensor) -> torch.Tensor:
    """``transform`` of a stack of same-shaped leaves, checked to keep the stack's shape."""
    updates = transform(stacked)
    if not isinstance(updates, torch.Tensor) or updates.shape != stacked.shape:
        raise TypeError(
            "fdp.optim.WholeLeafOptimizer.transform: expected a tensor of the stack's shape "
            f"{tuple(stacked.shape)}; got {_tree.describe(updates)}"
        )
    return updates


class _Finisher:
    """``apply`` over the stepped leaves, in the ops and rate ``begin`` used."""

    def __init__(
        self, opt: WholeLeafOptimizer, box: dict[str, Any], live: list[int], donate: bool
    ) -> None:
        self.opt, self.box, self.live, self.donate = opt, box, live, donate

    def __call__(
        self, updates: list[Any], params: Any, shapes: list[torch.Size | None] | None
    ) -> Any:
        if not self.box:  # nothing was stepped
            return params
        leaves, spec = _tree.flatten(params)
        ops, live = self.box["ops"], self.live
        ups = [updates[i] for i in live]
        whole = [shapes[i] if shapes is not None else None for i in live]
        sizes = [w if w is not None else leaves[i].shape for w, i in zip(whole, live, strict=True)]
        foreach = isinstance(ops, _lists.Foreach)
        with torch.no_grad() if foreach else contextlib.nullcontext():
            new = self.opt.apply(ops, self.box["params"], ups, sizes, self.box["lr"], self.donate)
        out = list(leaves)
        if not self.donate:  # donated: written in place
            new = like_leaves(new, [leaves[i] for i in live]) if foreach else new
            for j, i in enumerate(live):
                out[i] = new[j]
        return _tree.unflatten(spec, out)


def whole_leaves(call: str, optimizer: Any, params: Any) -> dict[int, WholeLeafOptimizer]:
    """Each leaf a whole-leaf optimizer steps (by label under ``param_groups``), checked."""
    if isinstance(optimizer, WholeLeafOptimizer):
        optimizer._check_leaves(call, params, None)
        return {i: optimizer for i, t in enumerate(_tree.flatten(params)[0]) if _real(t)}
    if not isinstance(optimizer, _param_groups.ParamGroups):
        return {}
    labels = optimizer.labels(params)
    leaves, spec = _tree.flatten(params)
    out: dict[int, WholeLeafOptimizer] = {}
    for label, opt in optimizer.optimizers.items():
        if not isinstance(opt, WholeLeafOptimizer):
            continue
        mine = [t if lab == label else None for t, lab in zip(leaves, labels, strict=True)]
        opt._check_leaves(call, _tree.unflatten(spec, mine), None)
        out |= {i: opt for i, t in enumerate(mine) if _real(t)}
    return out


def _real(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() > 0


def _matrices(shape: torch.Size) -> int:
    return math.prod(shape[:-2]) if len(shape) > 2 else 1


def _cost(shape: torch.Size) -> int:
    if len(shape) < 2:
        return shape.numel()
    m, n = shape[-2], shape[-1]
    return _matrices(shape) * m * n * min(m, n)


def plan_owners(shapes: dict[int, torch.Size], world: int) -> dict[int, int]:
    """Greedy: the costliest leaf first, to the least loaded rank (ties: the lower rank)."""
    load = [0] * world
    owner: dict[int, int] = {}
    for i in sorted(shapes, key=lambda i: (-_cost(shapes[i]), i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += _cost(shapes[i])
    return owner
