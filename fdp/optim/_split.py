"""``fdp.optim.split_transforms``: whole-leaf transforms shared out over replicated ranks.

Under ``fdp.DistributedDataParallel`` every rank holds every leaf and the
same averaged gradients, so every rank would run Muon's Newton-Schulz on
every matrix. Wrapped here, each rank runs ``begin`` (element by element, on
everything: the state stays replicated), transforms only the leaves it owns
(owners planned as for shards, ``fdp.optim._whole.plan_owners``), and one
all-gather per dtype hands every rank every update for ``finish``. The
values are the unwrapped optimizer's: the transform of a leaf is the same
function of the same direction on whichever rank runs it.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from fdp import _tree
from fdp._comm import _raw
from fdp.optim import _param_groups
from fdp.optim._whole import WholeLeafOptimizer, plan_owners, transform_leaves, whole_leaves

T = TypeVar("T")
_CALL = "fdp.optim.split_transforms"


class SplitTransforms:
    """``optimizer`` with its whole-leaf transforms shared out; see :func:`split_transforms`."""

    def __init__(self, optimizer: Any, group: ProcessGroup | None) -> None:
        grouped = isinstance(optimizer, _param_groups.ParamGroups)
        if not isinstance(optimizer, WholeLeafOptimizer) and not (grouped and optimizer.whole_leaf):
            raise TypeError(
                f"{_CALL}: `optimizer` expected a whole-leaf optimizer (fdp.optim.muon, a "
                "WholeLeafOptimizer) or param_groups holding one; got "
                f"{_tree.describe(optimizer)}"
            )
        self.optimizer, self.group, self.slots = optimizer, group, optimizer.slots
        self.whole_leaf = True

    def __repr__(self) -> str:
        return f"fdp.optim.split_transforms({self.optimizer!r})"

    def init(self, params: Any) -> dict[str, Any]:
        """The unwrapped optimizer's state (replicated)."""
        return dict(self.optimizer.init(params))

    def update(
        self, grads: Any, state: dict[str, Any], params: T, *, donate: bool = False
    ) -> tuple[T, dict[str, Any]]:
        """One step: the unwrapped optimizer's, each leaf transformed on one rank."""
        whole = whole_leaves(_CALL, self.optimizer, params)
        opt = self.optimizer
        if isinstance(opt, _param_groups.ParamGroups):
            opt = opt.bind(opt.labels(params))
        pending = opt.begin(grads, state, params, donate=donate)
        live = [i for i, d in enumerate(pending.directions) if d is not None and i in whole]
        shapes = {i: _shape(pending.directions[i]) for i in live}
        world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        owner = plan_owners(shapes, world)
        mine = [i for i in live if owner[i] == rank]
        done: dict[int, torch.Tensor] = {}
        by_optimizer: dict[int, list[int]] = {}
        for i in mine:
            by_optimizer.setdefault(id(whole[i]), []).append(i)
        for idx in by_optimizer.values():
            directions = [_tensor(pending.directions[i]) for i in idx]
            done |= dict(
                zip(idx, transform_leaves(whole[idx[0]].transform, directions), strict=True)
            )
        updates: list[torch.Tensor | None] = [None] * len(pending.directions)
        for i, u in self._gathered(live, owner, done, pending.directions, world).items():
            updates[i] = u
        new, new_state = pending.finish(updates)
        out: T = new
        return out, new_state

    def _gathered(
        self,
        live: list[int],
        owner: dict[int, int],
        done: dict[int, torch.Tensor],
        directions: list[torch.Tensor | None],
        world: int,
    ) -> dict[int, torch.Tensor]:
        """Every live leaf's update, from its owner: one all-gather per dtype and device."""
        kinds: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        for i in live:
            d = _tensor(directions[i])
            kinds.setdefault((d.dtype, d.device), []).append(i)
        out: dict[int, torch.Tensor] = {}
        for (dtype, device), idx in kinds.items():
            per_rank = [[i for i in idx if owner[i] == r] for r in range(world)]
            sizes = [sum(_tensor(directions[i]).numel() for i in ids) for ids in per_rank]
            width = max(sizes)
            mine = [done[i].reshape(-1) for i in per_rank[dist.get_rank(self.group)]]
            flat = torch.cat(mine) if mine else torch.empty(0, dtype=dtype, device=device)
            if flat.numel() < width:  # equal rows for the all-gather
                flat = torch.cat([flat, flat.new_zeros(width - flat.numel())])
            rows = _raw.all_gather(flat, group=self.group).reshape(world, width)
            for r, ids in enumerate(per_rank):
                sizes_r = [_tensor(directions[i]).numel() for i in ids]
                pieces = rows[r, : sum(sizes_r)].split_with_sizes(sizes_r)
                for i, piece in zip(ids, pieces, strict=True):
                    out[i] = piece.view(_tensor(directions[i]).shape)
        return out


def _tensor(t: torch.Tensor | None) -> torch.Tensor:
    if t is None:
        raise RuntimeError("fdp internal error: a live leaf without a direction")
    return t


def _shape(t: torch.Tensor | None) -> torch.Size:
    return _tensor(t).shape


def split_transforms(optimizer: Any, *, group: ProcessGroup | None = None) -> SplitTransforms:
    """Shares a whole-leaf optimizer's transforms out over ranks that hold the same leaves.

    For replicated training (``fdp.DistributedDataParallel``): each rank
    steps everything element by element, orthogonalizes (Muon) only the
    matrices it owns (owners balance the cost), and one all-gather gives
    every rank every update. The parameters and state are the unwrapped
    optimizer's; every rank must call ``update`` with the same gradients'
    ``None`` pattern (DDP's averaged gradients have it). Sharded training
    does this itself (``ZeroRedundancy``, ``fsdp.optimizer``).

    Args:
        optimizer: ``fdp.optim.muon(...)``, another ``WholeLeafOptimizer``, or
            ``param_groups`` holding one.
        group: the ranks that share the work (default: the world).

    Example::

        opt = fdp.optim.split_transforms(fdp.optim.param_groups(
            lambda name, t: "muon" if t.ndim >= 2 else "adamw",
            {"muon": fdp.optim.muon(0.02), "adamw": fdp.optim.adamw(3e-4)},
        ))
        state = opt.init(params)
        grads = fdp.grad(loss)(params)      # loss calls ddp(params)
        params, state = opt.update(grads, state, params)
    """
    return SplitTransforms(optimizer, group)
