"""``fdp.optim.GradScaler``: ``torch.amp.GradScaler``'s dynamic loss scaling, functionally.

torch's scaler finds gradients through an optimizer's ``param_groups``; a
functional loop has trees instead, so the same arithmetic is split into
pure steps the loop calls itself: ``scale`` the loss, ``unscale`` the
gradients (which also says whether any is not finite), step unless one is
not, and ``update`` the scale. The state is two 0-d tensors, so it goes
into a checkpoint with the rest.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from fdp import _sharded, _tree

T = TypeVar("T")


class GradScaler:
    """Dynamic loss scaling for float16 training with ``fdp.optim`` or ``fdp.ZeroRedundancy``.

    The arithmetic of ``torch.amp.GradScaler`` (same defaults, same scale
    after every step, the same steps skipped): the loss is multiplied by
    the scale; the gradients are multiplied by its reciprocal; a step whose
    gradients hold an ``inf`` or ``nan`` is skipped and the scale multiplied
    by ``backoff_factor``; after ``growth_interval`` finite steps in a row
    the scale is multiplied by ``growth_factor``.

    Args:
        init_scale: the first scale.
        growth_factor: the factor after ``growth_interval`` finite steps.
        backoff_factor: the factor after a step with a non-finite gradient.
        growth_interval: finite steps between growths.

    Example:
        >>> import torch, fdp
        >>> scaler, opt = fdp.optim.GradScaler(init_scale=1024.0), fdp.optim.sgd(0.1)
        >>> params = {"w": torch.ones(2)}
        >>> state, scaled = scaler.init(), opt.init(params)
        >>> loss = lambda p: (p["w"] ** 2).sum()
        >>> grads = torch.func.grad(lambda p: scaler.scale(loss(p), state))(params)
        >>> grads, found_inf = scaler.unscale(grads, state)
        >>> if not found_inf:
        ...     params, scaled = opt.update(grads, scaled, params)
        >>> state = scaler.update(state, found_inf)
        >>> params["w"].tolist(), float(state["scale"])
        ([0.800000011920929, 0.800000011920929], 1024.0)
    """

    def __init__(
        self,
        *,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        call = "fdp.optim.GradScaler"
        checks = (
            ("init_scale", init_scale, init_scale > 0, "> 0"),
            ("growth_factor", growth_factor, growth_factor > 1, "> 1"),
            ("backoff_factor", backoff_factor, 0 < backoff_factor < 1, "in (0, 1)"),
            ("growth_interval", growth_interval, growth_interval >= 1, "an int >= 1"),
        )
        for name, value, ok, expected in checks:
            if not ok or isinstance(value, bool):
                raise ValueError(f"{call}: `{name}` expected {expected}; got {value!r}")
        if not isinstance(growth_interval, int):
            raise TypeError(f"{call}: `growth_interval` expected an int; got {growth_interval!r}")
        self.init_scale, self.growth_factor = float(init_scale), float(growth_factor)
        self.backoff_factor, self.growth_interval = float(backoff_factor), growth_interval

    def __repr__(self) -> str:
        hyper = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"fdp.optim.GradScaler({hyper})"

    def init(self, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """The first state: ``{"scale": float32, "growth_tracker": int32}`` 0-d tensors."""
        return {
            "scale": torch.full((), self.init_scale, dtype=torch.float32, device=device),
            "growth_tracker": torch.zeros((), dtype=torch.int32, device=device),
        }

    def scale(self, outputs: T, state: dict[str, torch.Tensor]) -> T:
        """``outputs`` (a loss, or a tree of tensors) multiplied by the scale."""
        scale = state["scale"]
        leaves, spec = _tree.flatten(outputs)
        scaled = [None if t is None else t * scale.to(t.device) for t in leaves]
        out: T = _tree.unflatten(spec, scaled)
        return out

    def unscale(
        self,
        grads: T,
        state: dict[str, torch.Tensor],
        *,
        sync: bool | None = None,
        group: ProcessGroup | None = None,
    ) -> tuple[T, torch.Tensor]:
        """The gradients divided by the scale, and whether any is not finite.

        Args:
            grads: a tree of scaled gradients (and ``None``).
            state: the scaler's state.
            sync: take the answer of every rank of ``group`` (one all-reduce
                of a flag): needed where one rank may overflow alone. By
                default (``None``) the trees that differ across ranks by
                design are synced over their group: the gradients of an
                ``fdp.FullyShardedDataParallel``'s shards (each rank holds
                other elements) and local gradients of the structure of a
                live ``fdp.ZeroRedundancy``'s parameters (what its ``step``
                takes; eagerly, outside its ``join``); any other tree not: averaged gradients
                (DDP) agree already. ``True``: always (other local
                gradients; ZeRO's while compiling). ``False``: this
                rank's answer alone.
            group: the process group of ``sync`` (default: the shards' or
                the ZeroRedundancy's, else the world).

        Returns:
            The unscaled gradients (new tensors) and ``found_inf``, a 0-d
            float32 tensor: 1.0 when a gradient holds ``inf`` or ``nan``
            (skip the step), else 0.0.
        """
        inv = state["scale"].double().reciprocal().float()  # as torch computes it
        leaves, spec = _tree.flatten(grads)
        present = [g for g in leaves if g is not None]
        found = torch.zeros((), dtype=torch.float32, device=state["scale"].device)
        if present:
            finite = torch.stack([torch.isfinite(g).all().to(found.device) for g in present])
            found = (~finite.all()).to(torch.float32)
        if sync is None:  # every rank holds the same format: all sync, or none
            sync, own = _own_group(grads)
            group = own if group is None else group
        if sync and dist.is_initialized():
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
        unscaled = [None if g is None else g * inv.to(g.device) for g in leaves]
        return _tree.unflatten(spec, unscaled), found

    def update(
        self, state: dict[str, torch.Tensor], found_inf: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """The state after a step: backed off after ``found_inf``, grown after an interval."""
        scale, tracker = state["scale"], state["growth_tracker"]
        found = found_inf.to(scale.device) > 0
        successful = tracker + 1
        grow = successful >= self.growth_interval
        # torch multiplies the float32 scale by the factors in double precision
        # and rounds once: 900 * 1.1 is 990.0, not float32's 990.00006.
        wide = scale.double()
        grown = (wide * self.growth_factor).to(scale.dtype)
        grown = torch.where(torch.isfinite(grown), grown, scale)  # torch keeps a finite scale
        backed_off = (wide * self.backoff_factor).to(scale.dtype)
        new_scale = torch.where(found, backed_off, torch.where(grow, grown, scale))
        zero = torch.zeros_like(tracker)
        new_tracker = torch.where(found | grow, zero, successful.to(tracker.dtype))
        return {"scale": new_scale, "growth_tracker": new_tracker}


def _own_group(grads: Any) -> tuple[bool, Any]:
    """Whether ``grads`` differ across ranks by design (shards' or ZeRO's local), and over what."""
    owner = _sharded.owner(grads, none_ok=True)
    if owner is not None:
        return True, owner.group
    return _sharded.local_group(grads)
