"""The block-wise int8 all-gather of fully sharded parameters (ZeRO++'s qwZ).

Each rank cuts its 1-D shard into blocks of :data:`BLOCK` values from the
shard's start (the last block zero-padded), and sends each block as int8
with one float32 scale: ``scale = max|x| / 127``, ``q = round(x / scale)``.
Every rank gets every rank's bytes and computes the same ``q * scale`` in
float32 (float64 for float64 parameters), cast to the compute dtype where it
lands. The wire carries
``1 + 4/BLOCK`` bytes per value (0.27x float32's, 0.53x bfloat16's); a value
is off by at most half its block's scale, ``max|x| / 254``.

One buffer per rank, its ``n`` int8 values (padded to a multiple of 4, so
the scales are aligned; a partial block's padding is not sent) then its
scales, and one all-gather of bytes.

Non-finite values make their whole block non-finite (the scale is), never a
finite wrong number. A block whose scale underflows to zero (every value
below about 2e-43) arrives as zeros.

Note [inductor slice of a broadcast product]: inductor (measured on torch
2.11, 2.13 and 2.15, CPU) miscompiles ``(q * s[..., None]).view(w, n_pad)[:,
:n].reshape(-1)``: the padded block's values come out wrong. The decode
therefore computes the whole blocks and the last partial block apart and
concatenates them, which it compiles right (checked in tests/test_quantized.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from fdp import _compat, _mode
from fdp._comm import _raw

BLOCK = 256  # values per scale
_LEVELS = 127.0  # int8's symmetric range
_CHUNK = 1024  # blocks per step of the eager encode: a 1 MiB quotient


def _aligned(n: int) -> int:
    """``n`` int8 values rounded up to whole float32s: where the scales start."""
    return -(-n // 4) * 4


def packed_bytes(n: int) -> int:
    """The bytes a rank sends for a shard of ``n`` values: ``n`` (aligned to 4), 4 per block."""
    return _aligned(n) + 4 * -(-n // BLOCK)


def _scales(wide: torch.Tensor, n: int) -> torch.Tensor:
    """Each block's scale, ``max|x| / 127`` in float32; the last block may be partial."""
    whole = n // BLOCK
    body = wide[: whole * BLOCK].view(whole, BLOCK)
    # amax and amin: one pass each, several times faster than aminmax or abs().amax().
    amax = torch.maximum(body.amax(1), body.amin(1).neg())
    if whole * BLOCK < n:
        tail = wide[whole * BLOCK :]
        amax = torch.cat([amax, torch.maximum(tail.amax(), tail.amin().neg())[None]])
    return amax / _LEVELS


def encode(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` (1-D, floating point) as :func:`packed_bytes` uint8: int8 values, then scales.

    ``out``: the uint8 buffer to write into (eager only: no temporary but
    one quotient).

    Example:
        >>> encode(torch.ones(3)).numel() == packed_bytes(3)
        True
    """
    n, whole = x.numel(), x.numel() // BLOCK
    wide = x.detach().to(torch.float32) if x.dtype != torch.float32 else x.detach()
    scale = _scales(wide, n)
    safe = torch.where(scale > 0, scale, 1.0)  # an all-zero block: zeros, not NaN
    tail = wide[whole * BLOCK :] / safe[whole:]
    if out is None:
        body = wide[: whole * BLOCK].view(whole, BLOCK) / safe[:whole, None]
        q = torch.cat([body.reshape(-1), tail]).round().to(torch.int8)
        # The padding to whole blocks is never sent: a small shard costs its values.
        q = F.pad(q, (0, _aligned(n) - n))
        return torch.cat([q.view(torch.uint8), scale.view(torch.uint8)])
    q = out[:n].view(torch.int8)
    # In chunks: a small quotient, reused, never a fresh copy of the shard (page faults).
    rows = wide[: whole * BLOCK].view(whole, BLOCK)
    for i in range(0, whole, _CHUNK):
        stop = min(i + _CHUNK, whole)
        part = rows[i:stop] / safe[i:stop, None]
        q[i * BLOCK : stop * BLOCK].view(-1, BLOCK).copy_(part.round_())
    q[whole * BLOCK :].copy_(tail.round_())
    out[n : _aligned(n)].zero_()
    out[_aligned(n) :].view(torch.float32).copy_(scale)
    return out


def decode(
    rows: torch.Tensor, n: int, dtype: torch.dtype, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Every rank's ``n`` values, rank-major, in ``dtype``, from their bytes ``rows``.

    ``rows``: ``(world, packed_bytes(n))`` uint8, each rank's :func:`encode`.
    ``out``: a 1-D tensor of ``world * n`` to write into (eager only: no temporary).

    Example:
        >>> x = torch.tensor([254.0, -2.0, 5.0])  # the scale: 254 / 127 = 2
        >>> decode(encode(x)[None], 3, torch.float32).tolist()  # 5 / 2 rounds to even
        [254.0, -2.0, 4.0]
    """
    world, whole = rows.shape[0], n // BLOCK  # whole blocks; the rest is one partial block
    q = rows[:, :n].view(torch.int8)
    scales = rows.view(torch.float32)[:, _aligned(n) // 4 :]
    body_scales, tail_scale = scales[:, :whole, None], scales[:, whole : whole + 1]
    if out is not None:  # |q| <= 127: exact in any float dtype; scaled in place
        into = out.view(world, n)
        into.copy_(q)
        into[:, : whole * BLOCK].view(world, whole, BLOCK).mul_(body_scales)
        into[:, whole * BLOCK :].mul_(tail_scale)
        return out
    # Whole blocks and the rest apart (Note [inductor slice of a broadcast product]).
    wide = torch.promote_types(dtype, torch.float32)  # what in-place scaling computes in
    body = q[:, : whole * BLOCK].reshape(world, whole, BLOCK).to(wide) * body_scales
    tail = q[:, whole * BLOCK :].to(wide) * tail_scale
    flat = torch.cat([body.reshape(world, whole * BLOCK), tail], 1).reshape(-1)
    return flat if flat.dtype == dtype else flat.to(dtype)  # Note [no-op casts in traced forwards]


def all_gather(x: torch.Tensor, *, group: ProcessGroup | None, dtype: torch.dtype) -> torch.Tensor:
    """Every rank's 1-D ``x`` through the int8 wire, concatenated in rank order, in ``dtype``."""
    if _mode.traced():
        packed = _raw.all_gather(encode(x), group=group)
        return decode(packed.view(-1, packed_bytes(x.numel())), x.numel(), dtype)
    pending = all_gather_start(x, group=group, dtype=dtype)
    pending.wait()
    return pending.out


class Pending:
    """An int8 all-gather under way; :meth:`wait` decodes it into :attr:`out`."""

    def __init__(
        self, work: Any, part: torch.Tensor, rows: torch.Tensor, n: int, out: torch.Tensor
    ) -> None:
        self.work, self.part, self.rows, self.n, self.out = work, part, rows, n, out

    def wait(self) -> None:
        if self.work is None:
            return
        work, self.work = self.work, None
        work.wait()
        with torch.no_grad(), _compat.functorch_disabled():
            decode(self.rows, self.n, self.out.dtype, out=self.out)
        self.part, self.rows = self.part[:0], self.rows[:0]  # the bytes: no longer needed


def all_gather_start(
    x: torch.Tensor,
    *,
    group: ProcessGroup | None,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> Pending:
    """Starts the int8 all-gather of the 1-D ``x``; eager only.

    ``out`` (new if ``None``): ``world * x.numel()`` values of ``dtype``,
    holding the result once the returned :class:`Pending`'s ``wait()`` returns.
    """
    with torch.no_grad(), _compat.functorch_disabled():
        plain = _compat.unwrap_functorch(x).detach().reshape(-1)
        world, n = dist.get_world_size(group), plain.numel()
        part = encode(plain, out=plain.new_empty(packed_bytes(n), dtype=torch.uint8))
        rows = part.new_empty(world, part.numel())
        if out is None:
            out = plain.new_empty(world * n, dtype=dtype)
        work = _compat.all_gather_single(rows.view(-1), part, group)
        return Pending(work, part, rows, n, out)
