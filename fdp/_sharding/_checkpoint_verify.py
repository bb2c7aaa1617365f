"""Entries written once for every rank, verified equal on every rank before a save.

``fdp.save_checkpoint`` writes an entry every rank holds under the same key
once, from the group's rank 0. Where ranks hold other values under that key
(fully sharded shards saved directly, parameters of ranks that trained
apart, a per-rank counter), the others' values would be lost without a word
(what is each rank's own by design is marked ``fdp.PerRank`` and skipped here),
so every such entry is checksummed (its bits, :func:`fdp._comm._agreement.
tensor_fingerprint`; a Python value's pickle) and compared in one all-reduce
for all of them, and a difference is refused on every rank with what the
entry probably is. A module's buffers are exempt: they drift between DDP's
broadcasts (BatchNorm statistics), and a checkpoint holds rank 0's, as torch's
DDP users save rank 0's ``state_dict``.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch.distributed import ProcessGroup

from fdp import _compat
from fdp._comm import _agreement

_SHARDS = (
    "fully sharded shards (fsdp.shard(params)) are one piece per rank: save "
    "fsdp.to_checkpoint(shards) (and fsdp.to_checkpoint(opt_state)), which writes every "
    "rank's pieces and loads at any world size"
)
_APART = (
    "parameters that trained apart: compute the loss from ddp(params), not params, and step "
    "every rank's optimizer alike; or values each rank holds its own of by design (DiLoCo or "
    "LocalSGD workers' parameters and inner states): wrap them in fdp.PerRank"
)
_BUFFERS = (
    "buffers that drift between broadcasts (BatchNorm statistics in a plain tree): "
    "fdp.broadcast_params(buffers) before saving gives every rank rank 0's"
)
_PER_RANK = (
    "a per-rank value (a position, a seed): save what every rank agrees on (a global "
    "sample position, docs/checkpoints.md), or wrap it in fdp.PerRank (each rank's own, "
    "loaded at the same world size); each rank's random number generators are saved for you"
)
_SHOWN = 5


def check(call: str, once: dict[str, Any], group: ProcessGroup | None) -> None:
    """Raises the same ValueError on every rank unless every rank holds ``once``'s values.

    ``once``: entry key -> the tensor or Python value written once for the group.
    """
    keys = list(once)
    described = [(k, _describe(once[k])) for k in keys]
    signature = _agreement.Fingerprint(described)
    signature.finish(signature.start(group), group=group, call=call, arg="state")
    with torch.no_grad(), _compat.functorch_disabled():
        differs = _agreement.differing([_fingerprint(once[k]) for k in keys], group)
    bad = [k for k, d in zip(keys, differs, strict=True) if d]
    if bad:
        raise ValueError(_message(call, bad, once))


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}, dtype {value.dtype}"
    return f"a {type(value).__name__}"


def _fingerprint(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return _agreement.tensor_fingerprint(value)
    return _agreement.value_fingerprint(value)


def _message(call: str, bad: list[str], once: dict[str, Any]) -> str:
    first = bad[0]
    more = ""
    if len(bad) > 1:
        shown = ", ".join(f"state{k}" for k in bad[1:_SHOWN])
        rest = len(bad) - _SHOWN
        more = f" (and {shown}{f', {rest} more' if rest > 0 else ''})"
    return (
        f"{call}: `state` leaf state{first}{more} is written once, from rank 0, so it "
        "expected the same values on every rank; got different values on different ranks "
        f"(their checksums differ). Probably {_guess(first, once[first])}"
    )


def _guess(key: str, value: Any) -> str:
    """What an entry that differs across ranks probably is, and the fix."""
    if not isinstance(value, torch.Tensor):
        return _PER_RANK
    if value.dim() == 1 and re.search(r"\[\d+\]$", key):
        return f"{_SHARDS}; or {_APART}"
    if value.is_floating_point() or value.is_complex():
        return f"{_APART}; or {_BUFFERS}"
    return f"{_PER_RANK}; or {_APART}"
