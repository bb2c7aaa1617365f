"""LocalSGD and DiLoCo over parameter trees: local inner steps, a rare averaged outer step.

Each worker (a rank, or a replica group under :class:`FaultTolerance`)
takes ``sync_every`` steps of its own inner optimizer on its own data. Then
the workers average their *pseudo-gradient*, the distance travelled since
the last synchronisation (``anchor - params``), and an outer optimizer
steps the shared anchor with it; every worker continues from the new
anchor. Communication is one all-reduce of the parameters' size every
``sync_every`` steps instead of every step (DiLoCo, Douillard et al. 2023;
LocalSGD is the outer step ``anchor - mean`` of plain averaging).
"""

from __future__ import annotations

from typing import Any

import optree
import torch
from torch.distributed import ProcessGroup

from fdp._comm._tree_collectives import all_reduce_grads
from fdp._ft._fault_tolerance import FaultTolerance
from fdp.optim._base import OptimizerProtocol
from fdp.optim._rules import sgd

__all__ = ["DiLoCo", "LocalSGD"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class DiLoCo:
    """DiLoCo: any fdp optimizer inside, an outer fdp optimizer every ``sync_every`` steps.

    ``init(params)`` and ``update(grads, state, params) -> (params, state)``
    have the shape of an ``fdp.optim`` optimizer, so a training loop swaps
    one for the other. ``update`` runs the inner optimizer on this worker's
    gradients (local: nothing is communicated) and, at every
    ``sync_every``-th call, the synchronisation: the pseudo-gradients
    ``anchor - params`` averaged over the workers, the outer optimizer's
    step of the anchor with them, and the new anchor as every worker's
    parameters. The inner optimizer's state stays each worker's own, as in
    the paper.

    Every worker must call ``update`` the same number of times (equal
    shards); a synchronisation checks that their counts agree and raises on
    every worker if not.

    Args:
        inner: the inner optimizer (any ``fdp.optim`` optimizer, e.g. AdamW).
        outer: the outer optimizer, stepping the anchor with the averaged
            pseudo-gradient; default Nesterov SGD (lr 0.7, momentum 0.9), the
            paper's.
        sync_every: inner steps between synchronisations (the paper's H).
        group: whom to average with: a ``torch.distributed`` process group
            (default: the world), or a :class:`FaultTolerance`, whose live
            replica groups are the workers; then each synchronising ``update``
            runs inside ``FaultTolerance.step`` (see :meth:`syncs`).
        sync_dtype: the dtype of the pseudo-gradient on the wire (e.g.
            ``torch.bfloat16``: half the bytes of float32); default the
            parameters' own.

    Example::

        diloco = fdp.DiLoCo(fdp.optim.adamw(1e-3), sync_every=50)
        state = diloco.init(params)
        for x, y in loader:  # this rank's shard
            grads = torch.func.grad(loss)(params, x, y)
            params, state = diloco.update(grads, state, params)
    """

    def __init__(
        self,
        inner: OptimizerProtocol,
        *,
        outer: OptimizerProtocol | None = None,
        sync_every: int,
        group: ProcessGroup | FaultTolerance | None = None,
        sync_dtype: torch.dtype | None = None,
    ) -> None:
        call = f"fdp.{type(self).__name__}"
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"{call}: `sync_every` expected a positive int; got {sync_every!r}")
        if sync_dtype is not None and sync_dtype not in _FLOATS:
            raise TypeError(
                f"{call}: `sync_dtype` expected a floating-point dtype or None; got {sync_dtype!r}"
            )
        for name, opt in (("inner", inner), ("outer", outer)):
            if opt is not None and not (hasattr(opt, "init") and hasattr(opt, "update")):
                raise TypeError(
                    f"{call}: `{name}` expected an fdp.optim optimizer (init and update); "
                    f"got {type(opt).__name__}"
                )
        if isinstance(group, FaultTolerance) and group.init_sync:
            raise ValueError(
                f"{call}: `group` expected a FaultTolerance made with init_sync=False; got one "
                "that copies one replica group's state to all at the first synchronisation, "
                "which would discard the other workers' first local steps"
            )
        self.inner = inner
        self.outer = outer if outer is not None else sgd(0.7, momentum=0.9, nesterov=True)
        self.sync_every = sync_every
        self.group = group
        self.sync_dtype = sync_dtype

    def __repr__(self) -> str:
        return f"fdp.{type(self).__name__}({self.inner!r}, sync_every={self.sync_every})"

    def init(self, params: Any) -> dict[str, Any]:
        """The inner and outer optimizers' states, the anchor (a copy of ``params``), the count."""
        anchor = optree.tree_map(_copy, params, none_is_leaf=True)
        return {
            "inner": self.inner.init(params),
            "outer": self.outer.init(anchor),
            "anchor": anchor,
            "count": torch.zeros((), dtype=torch.int64),
        }

    def syncs(self, state: dict[str, Any]) -> bool:
        """Whether the next :meth:`update` synchronises (under :class:`FaultTolerance`, run it
        inside ``FaultTolerance.step``; the other updates run outside)."""
        return (int(state["count"]) + 1) % self.sync_every == 0

    def update(self, grads: Any, state: dict[str, Any], params: Any) -> tuple[Any, dict[str, Any]]:
        """One inner step; every ``sync_every``-th, then the averaged outer step.

        Returns:
            ``(params, state)``: after a synchronisation, ``params`` is a copy
            of the new anchor, the same on every worker.
        """
        due = self.syncs(state)
        params, inner = self.inner.update(grads, state["inner"], params)
        state = {**state, "inner": inner, "count": state["count"] + 1}
        return self._sync(state, params) if due else (params, state)

    def _sync(self, state: dict[str, Any], params: Any) -> tuple[Any, dict[str, Any]]:
        """The averaged pseudo-gradient, the outer step, every worker at the new anchor."""
        with torch.no_grad():
            delta = optree.tree_map(self._delta, state["anchor"], params, none_is_leaf=True)
            count = float(state["count"])
            check = torch.tensor([count, count * count], dtype=torch.float64)
            averaged = self._average({"delta": delta, "check": check})
            self._check_counts(averaged["check"], count)
            pseudo = optree.tree_map(_back, averaged["delta"], params, none_is_leaf=True)
        anchor, outer = self.outer.update(pseudo, state["outer"], state["anchor"])
        new_params = optree.tree_map(_copy, anchor, none_is_leaf=True)
        return new_params, {**state, "anchor": anchor, "outer": outer}

    def _delta(self, anchor: Any, p: Any) -> Any:
        if not isinstance(p, torch.Tensor):
            return None
        d = anchor - p.detach()
        return d if self.sync_dtype is None else d.to(self.sync_dtype)

    def _average(self, tree: Any) -> Any:
        if isinstance(self.group, FaultTolerance):
            return self.group.all_reduce_grads(tree)
        return all_reduce_grads(tree, group=self.group)

    def _check_counts(self, check: torch.Tensor, count: float) -> None:
        mean, mean_square = check.tolist()
        if abs(mean * mean - mean_square) > 1e-6 * max(1.0, mean_square):
            raise ValueError(
                f"fdp.{type(self).__name__}.update: `state` expected the same step count on "
                f"every worker at a synchronisation; got {int(count)} here and others elsewhere "
                "(every worker must call update equally often: equal shards)"
            )


class LocalSGD(DiLoCo):
    """LocalSGD: ``sync_every`` local steps, then every worker takes the workers' mean.

    DiLoCo with the outer step ``anchor - mean(anchor - params)``, i.e. plain
    SGD with learning rate 1 and no momentum: the parameters are averaged.

    Example::

        local = fdp.LocalSGD(fdp.optim.sgd(0.1), sync_every=8)
        state = local.init(params)
        params, state = local.update(grads, state, params)
    """

    def __init__(
        self,
        inner: OptimizerProtocol,
        *,
        sync_every: int,
        group: ProcessGroup | FaultTolerance | None = None,
        sync_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            inner, outer=sgd(1.0), sync_every=sync_every, group=group, sync_dtype=sync_dtype
        )


def _copy(t: Any) -> Any:
    return t.detach().clone() if isinstance(t, torch.Tensor) else t


def _back(d: Any, p: Any) -> Any:
    """The averaged pseudo-gradient in the parameter's dtype (from ``sync_dtype``)."""
    return None if d is None else d.to(p.dtype)
