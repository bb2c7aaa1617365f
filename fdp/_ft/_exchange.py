"""One fragment's pseudo-gradient averaged over the workers: started, later finished.

DiLoCo's synchronisation in two halves, so that a streaming fragment's
reduction can run while inner steps go on: :func:`start` launches it and
returns an :class:`Exchange`; :meth:`Exchange.wait` gives the averaged
leaves. The wire:
- the leaves' dtype or a floating ``sync_dtype``: one all-reduce per dtype of
  the leaves packed flat, each rank's values divided by the group size as
  they are packed (as :func:`fdp.all_reduce_grads` does);
- ``torch.int8`` or a float8 dtype: the leaves as one float32 vector through
  :mod:`fdp._comm._quantized_mean` (an all-to-all, then an all-gather);
- a :class:`FaultTolerance`: the same packed leaves through its
  :meth:`~FaultTolerance.mean_start`; an exchange whose quorum changed before
  it lands is not :meth:`Exchange.current` (every replica group of the new
  quorum starts it again).

Beside the values, every exchange averages ``[count, count**2, training]``
in float64: the mean's square equals the mean of squares only if every
worker's count is the same, which :meth:`Exchange.wait` checks; ``training``
is 1, or 0 on a worker that has left ``DiLoCo.join`` and mirrors the
others with zeros, so the mean is rescaled to the workers still training.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from fdp._comm import _quantized_mean
from fdp._ft._fault_tolerance import FaultTolerance

__all__ = ["QUANTIZED", "Exchange", "start"]

QUANTIZED = (torch.int8, *_quantized_mean.FLOAT8)


class Exchange:
    """A fragment's reduction under way (or done, under a :class:`FaultTolerance`)."""

    def __init__(
        self,
        finish: Any,
        check: torch.Tensor,
        work: Any,
        call: str,
        *,
        advance: Any = None,
        current: Any = None,
        trusted: Any = None,
    ) -> None:
        self._finish, self._check, self._work, self._call = finish, check, work, call
        self._advance, self._current, self._trusted = advance, current, trusted

    def current(self) -> bool:
        """Whether it can still land: under a FaultTolerance, the quorum it started in lives."""
        return self._current is None or bool(self._current())

    def advance(self) -> None:
        """Moves a two-phase (quantized) reduction to its second phase; else nothing."""
        if self._advance is not None:
            self._advance()

    def training(self) -> float:
        """The share of the workers that sent as training (1.0 outside ``join``), as soon
        as the check has arrived (over a process group: ``join`` refuses a FaultTolerance)."""
        if self._work is not None:
            self._work.wait()
        return float(self._check[2])

    def wait(self, count: int) -> list[torch.Tensor]:
        """The leaves averaged over the workers still training, after checking that every
        worker sent at ``count`` steps (none training: the zeros that were sent)."""
        if self._work is not None:
            self._work.wait()
        leaves: list[torch.Tensor] = self._finish()
        share = float(self._check[2])
        if self._trusted is not None and not self._trusted():
            return leaves  # a failed step's values: discarded at its commit
        mean, mean_square, _ = self._check.tolist()
        if abs(mean * mean - mean_square) > 1e-6 * max(1.0, mean_square):
            raise ValueError(
                f"{self._call}: `state` expected the same step count on every worker at a "
                f"synchronisation; got {count} here and others elsewhere (every worker must "
                "call update equally often, or run its loop inside DiLoCo.join)"
            )
        if 0.0 < share < 1.0 - 1e-9:  # some left join: what they sent is zeros
            leaves = [leaf * (1.0 / share) for leaf in leaves]
        return leaves


def start(
    deltas: list[torch.Tensor],
    count: int,
    *,
    wire: torch.dtype | None,
    group: ProcessGroup | FaultTolerance | None,
    call: str,
    training: bool = True,
) -> Exchange:
    """Starts averaging ``deltas`` (a fragment's pseudo-gradient leaves) over ``group``.

    ``training=False``: this worker has left ``DiLoCo.join``; ``deltas`` are
    its zeros, and the others' mean is taken over the workers still training.
    """
    check = torch.tensor([count, count * count, float(training)], dtype=torch.float64)
    with torch.no_grad():
        if isinstance(group, FaultTolerance):
            wired, dtypes, flats = _packed(deltas, wire)
            pending = group.mean_start([*flats, check])

            def finish() -> list[torch.Tensor]:
                pending.wait()
                return _unpacked(wired, dtypes, flats)

            return Exchange(
                finish, check, None, call, current=pending.current, trusted=pending.trusted
            )
        scale = 1.0 / dist.get_world_size(group)
        check.mul_(scale)
        check_work = dist.all_reduce(check, group=group, async_op=True)
        if wire is not None and wire in QUANTIZED:
            return _quantized(deltas, wire, group, check, check_work, call)
        return _plain(deltas, wire, group, scale, check, check_work, call)


def _plain(
    deltas: list[torch.Tensor],
    wire: torch.dtype | None,
    group: ProcessGroup | None,
    scale: float,
    check: torch.Tensor,
    check_work: Any,
    call: str,
) -> Exchange:
    """One all-reduce per wire dtype of the leaves packed flat, pre-divided."""
    wired, dtypes, flats = _packed(deltas, wire)
    works = [dist.all_reduce(f.mul_(scale), group=group, async_op=True) for f in flats]

    def finish() -> list[torch.Tensor]:
        for w in works:
            w.wait()
        return _unpacked(wired, dtypes, flats)

    return Exchange(finish, check, check_work, call)


def _packed(
    deltas: list[torch.Tensor], wire: torch.dtype | None
) -> tuple[list[torch.Tensor], list[torch.dtype], list[torch.Tensor]]:
    """The leaves in the wire's dtype, their dtypes, one flat buffer per dtype."""
    wired = [d.to(wire) if wire is not None else d for d in deltas]
    dtypes = list(dict.fromkeys(d.dtype for d in wired))
    flats = [torch.cat([d.reshape(-1) for d in wired if d.dtype == dt]) for dt in dtypes]
    return wired, dtypes, flats


def _unpacked(
    wired: list[torch.Tensor], dtypes: list[torch.dtype], flats: list[torch.Tensor]
) -> list[torch.Tensor]:
    """The leaves again, as views of the reduced flat buffers."""
    offsets = dict.fromkeys(dtypes, 0)
    out = []
    for d in wired:
        flat, at = flats[dtypes.index(d.dtype)], offsets[d.dtype]
        out.append(flat[at : at + d.numel()].view(d.shape))
        offsets[d.dtype] = at + d.numel()
    return out


def _quantized(
    deltas: list[torch.Tensor],
    wire: torch.dtype,
    group: ProcessGroup | None,
    check: torch.Tensor,
    check_work: Any,
    call: str,
) -> Exchange:
    """The leaves as one float32 vector through the block-quantized mean."""
    flat = torch.cat([d.reshape(-1).to(torch.float32) for d in deltas])
    pending = _quantized_mean.quantized_mean_start(flat, wire=wire, group=group)

    def finish() -> list[torch.Tensor]:
        mean, out, at = pending.wait(), [], 0
        for d in deltas:
            out.append(mean[at : at + d.numel()].view(d.shape))
            at += d.numel()
        return out

    return Exchange(finish, check, check_work, call, advance=pending.advance)
