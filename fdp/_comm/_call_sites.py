"""Agreeing once per call site: the public collectives' fast path for small tensors.

Every public collective makes the ranks agree on its arguments before the
payload moves (:mod:`fdp._comm._agreement`): a tensor of another size or
dtype on one rank would abort gloo or pair collectives wrongly. That is one
more round trip per call, which latency-bound callers (a contrastive loss
gathering embeddings, an MoE all-to-all) pay every step.

Here ranks agree once per call site (the caller's file, function and line)
and shape: every rank then remembers what that site agreed on. At a
remembered site each rank compares its own arguments with the remembered
ones locally and sends one flag *inside* the payload's collective (an
element appended to what travels): a rank whose arguments differ sends a
payload of the remembered shape (zeros) with its flag set, so the sizes
always match, and every rank sees the flag in the same result. Then every
rank runs the full comparison, which raises the same error everywhere (or,
when all ranks changed alike, as a last smaller batch does, agrees on the
new arguments and runs the collective again).

What every rank remembers is the same because it changes only on verdicts
every rank reaches together. A site whose arguments keep changing (two
shapes alternating) goes back to agreeing before every call. Above
:data:`FOLD_BYTES` (or for a reduction in a dtype whose sum of flags could
wrap) the flag travels beside the payload instead, in a tiny all-reduce
started just before it: appending would copy the payload. A sum or mean
all-reduce copies its payload into the result anyway, and appends at any
size (:class:`Payload`).

What it gives up: the ranks must run the same program. Ranks that call
collectives at *different* remembered sites with different sizes were
already wrong (their collectives pair with each other); with the round trip
they got a clear error, without it gloo may abort. docs/collectives.md says so.
"""

from __future__ import annotations

import enum
import hashlib
import os
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from fdp import _compat, _mode

# At most this many bytes per rank, not reduced, travel with a flag appended (foldable).
FOLD_BYTES = 1 << 20
# Sites remembered per group (the oldest forgotten first, on every rank alike).
MAX_SITES = 256
# Dtypes whose sum, max and min of a 0/1 flag are exact for any number of ranks.
_REDUCIBLE = {
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
    torch.complex64, torch.complex128, torch.int16, torch.int32, torch.int64,
}  # fmt: skip


def here() -> tuple[Any, ...]:
    """The caller's site: the first frame outside fdp and torch, and the one that called it.

    Two frames: a helper of the user's that gathers several tensors is a
    site per line that calls it. Each frame as (file name, function, line):
    the base name, so ranks with checkouts at other paths name the same site.
    """
    frame: Any = sys._getframe(1)
    while frame.f_back is not None:
        module = frame.f_globals.get("__name__", "")
        if not (module.startswith(("fdp.", "torch.")) or module in ("fdp", "torch")):
            break
        frame = frame.f_back
    site = []
    for _ in range(2):
        if frame is None:
            break
        code = frame.f_code
        site.append((os.path.basename(code.co_filename), code.co_name, frame.f_lineno))
        frame = frame.f_back
    return tuple(site)


def site_hash(call: str, site: tuple[Any, ...]) -> int:
    """A 62-bit hash of a call at a site, the same on every rank."""
    digest = hashlib.blake2b(repr((call, site)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


@dataclass
class Agreed:
    """What every rank agreed on at a site: the arguments' key and what they gave."""

    key: tuple[Any, ...]  # shape, dtype, device type and the options
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    value: Any  # the call's checked options (a normalised dim)
    folded: bool  # the flag travels in the payload; else in an all-reduce beside it
    calls: int = 0
    misses: int = 0
    _flags: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    def stand_in(self) -> torch.Tensor:
        """Zeros of the agreed shape: what a rank whose arguments differ sends."""
        return torch.zeros(self.shape, dtype=self.dtype, device=self.device)

    def flag(self, raised: bool) -> torch.Tensor:
        """One element of the agreed dtype: 1 where this rank's arguments differ.

        Made once per site (only ever copied into a payload, never written).
        """
        if self._flags is None:
            both = torch.tensor([0, 1], dtype=self.dtype, device=self.device)
            self._flags = (both[:1], both[1:])
        return self._flags[int(raised)]

    def beside(self, raised: bool, group: ProcessGroup | None) -> tuple[torch.Tensor, Any]:
        """The flag in a tiny all-reduce (MAX) started now, before the payload's collective."""
        with _compat.functorch_disabled():
            flag = torch.full((1,), int(raised), dtype=torch.int32, device=self.device)
            return flag, dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group, async_op=True)

    def unstable(self) -> bool:
        """Whether the site's arguments change often enough to agree before each call."""
        return self.misses >= 2 and self.misses * 16 > self.calls


class Sites:
    """Per process group, the sites agreed on (weakly keyed: gone with the group)."""

    def __init__(self) -> None:
        self._groups: weakref.WeakKeyDictionary[Any, dict[Any, Agreed | None]] = (
            weakref.WeakKeyDictionary()
        )

    def _of(self, group: ProcessGroup | None) -> dict[Any, Agreed | None]:
        key = dist.group.WORLD if group is None else group
        return self._groups.setdefault(key, {})

    def lookup(self, group: ProcessGroup | None, site: Any) -> tuple[bool, Agreed | None]:
        """Whether the site is known, and its agreement (None: agree before each call)."""
        sites = self._of(group)
        return site in sites, sites.get(site)

    def put(self, group: ProcessGroup | None, site: Any, agreed: Agreed | None) -> None:
        """Remembers ``agreed`` at ``site`` (None: always agree first there), on every rank."""
        sites = self._of(group)
        sites.pop(site, None)
        sites[site] = agreed
        while len(sites) > MAX_SITES:
            del sites[next(iter(sites))]


SITES = Sites()


class Payload(enum.Enum):
    """What a collective does with its payload, which decides where a flag can travel."""

    MOVED = "moved"  # gathered or exchanged: any dtype; appended up to FOLD_BYTES
    REDUCED = "reduced"  # summed or compared: an exact dtype; appended up to FOLD_BYTES
    COPIED = "copied"  # summed into a copy made anyway (all_reduce): an exact dtype, any size


def foldable(x: torch.Tensor, payload: Payload) -> bool:
    """Whether a flag can travel appended to ``x``.

    A reduction needs a dtype whose sum of flags is exact. A collective that
    copies its payload into its result anyway appends at any size; other
    large payloads send the flag beside them: appending would copy the
    payload, and a tiny all-reduce started just before it overlaps with it.
    """
    if payload is Payload.MOVED:
        return x.numel() * x.element_size() <= FOLD_BYTES and not x.is_quantized
    if x.dtype not in _REDUCIBLE:
        return False
    return payload is Payload.COPIED or x.numel() * x.element_size() <= FOLD_BYTES


def flagged(flags: torch.Tensor) -> bool:
    """Whether any rank set its flag (read under any ``torch.func`` wrappers)."""
    if not _mode.transform_running() and not flags.requires_grad:
        return any(flags.tolist())  # a few flags: cheaper read as numbers than reduced
    with torch.no_grad(), _compat.functorch_disabled():
        return bool(_compat.unwrap_all_functorch(flags).detach().ne(0).any().item())
