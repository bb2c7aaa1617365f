"""Bucket planning and flat pack/unpack over the tensor leaves of a flattened tree.

A bucket is a run of leaves that share a device and a dtype and travel as one
flat buffer: one collective per bucket instead of one per leaf. Planning
follows ``DistributedDataParallel``: leaves are visited in reverse order (the
order backward produces gradients for parameters used in order), each (device,
dtype) pair keeps one open bucket that closes once it reaches its size cap, the
first bucket of each pair gets a small cap so that communication starts early,
and buckets are ordered by when they close.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from fdp import _compat, _mode, _tree

MB = 1024 * 1024
# Every bucket size fdp picks, in one place. Gradient buckets as torch's DDP
# sizes them: 25 MiB, the first (the last layers' gradients, ready first)
# 1 MiB so communication starts early.
BUCKET_CAP_MB = 25.0
FIRST_BUCKET_CAP_MB = 1.0
# Broadcasts are rare (initial weights, buffers): one per device and dtype.
BROADCAST_CAP_BYTES = 250 * MB
# DDP's aliases: one autograd node for a run of a bucket's leaves up to this
# size together (fdp/_ddp/_reducer.py, Note [one node a run]).
ALIAS_RUN_CAP_BYTES = 1 * MB


@dataclass(frozen=True)
class Bucket:
    """Leaves (indices into the flattened tree) that share one flat buffer.

    A complex leaf is stored as its real view (twice the numel, in the real
    dtype), so collectives and compression hooks only ever see real numbers.
    A leaf whose strides are dense but not contiguous (``channels_last``)
    gets a view with the leaf's own strides, so a ``.grad`` taken from the
    bucket has its parameter's memory layout, as torch's DDP guarantees.
    """

    indices: tuple[int, ...]
    shapes: tuple[torch.Size, ...]
    strides: tuple[tuple[int, ...], ...]  # each leaf's dense strides (in leaf elements)
    complex_: tuple[bool, ...]
    offsets: tuple[int, ...]  # where each leaf starts in the flat buffer (real elements)
    pads: tuple[int, ...]  # unused elements that keep complex leaves at even offsets
    numel: int
    dtype: torch.dtype  # the flat buffer's (real) dtype
    device: torch.device
    # Derived in __post_init__. An init field (with a default), because torch
    # 2.10's dynamo rebuilds a frozen dataclass from all its fields.
    _split_sizes: tuple[int, ...] | None = field(default=None, compare=False, repr=False)
    # Per leaf, its shape as plain ints, or None where the split piece has it already.
    _view_shapes: tuple[tuple[int, ...] | None, ...] = field(default=(), compare=False, repr=False)
    # Per leaf, its dims in memory order, and whether it is real with them in
    # logical order (flattened by a reshape alone). Worked out here, once,
    # because dynamo runs this Python again at every trace, leaf by leaf.
    _orders: tuple[tuple[int, ...], ...] = field(default=(), compare=False, repr=False)
    _plain: tuple[bool, ...] = field(default=(), compare=False, repr=False)
    # For split: the sizes of the gaps and leaves up to the last leaf's end, and per
    # leaf the shape to reshape its piece to, then the permutation (None: none).
    _gaps: tuple[int, ...] = field(default=(), compare=False, repr=False)
    _end: int = field(default=0, compare=False, repr=False)
    _unflats: tuple[tuple[tuple[int, ...], tuple[int, ...] | None], ...] = field(
        default=(), compare=False, repr=False
    )

    def width(self, j: int) -> int:
        """How many real elements leaf ``j`` takes in the flat buffer."""
        return self.shapes[j].numel() * (2 if self.complex_[j] else 1)

    def order(self, j: int) -> tuple[int, ...]:
        """Leaf ``j``'s dims (a complex leaf's real/imaginary one last) in memory order."""
        return self._orders[j]

    def empty(self, tail: int = 0) -> torch.Tensor:
        """An uninitialised flat buffer: the bucket's elements, then ``tail`` more."""
        return torch.empty(self.numel + tail, dtype=self.dtype, device=self.device)

    def view(self, flat: torch.Tensor, j: int) -> torch.Tensor:
        """Leaf ``j``'s view of ``flat``, with the leaf's shape, strides and dtype."""
        shape, stride, start = self.shapes[j], self.strides[j], self.offsets[j]
        part = flat[start : start + self.width(j)]
        if self.complex_[j]:
            real = part.as_strided((*shape, 2), (*(2 * s for s in stride), 1))
            return torch.view_as_complex(real)
        if stride == contiguous_strides(shape):
            return part.view(shape)
        return part.as_strided(shape, stride)

    def zero_pads(self, flat: torch.Tensor) -> None:
        """Zeroes the padding, so a collective never sees uninitialised memory."""
        for p in self.pads:
            flat[p] = 0

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``flat``, one per leaf, shaped like the leaves."""
        sizes = self._split_sizes
        if sizes is None:
            return [self.view(flat, j) for j in range(len(self.indices))]
        # One split: faster than a view per leaf (docs/performance.md).
        # Plain ints, not a torch.Size: view() parses a Size 3x slower (3.4 us vs 1.2 us).
        parts = flat.split_with_sizes(list(sizes))
        return [
            part if sh is None else part.view(*sh) if sh else part.view(())
            for part, sh in zip(parts, self._view_shapes, strict=True)
        ]

    def __post_init__(self) -> None:
        # Computed once here, not in a cached_property: dynamo cannot trace
        # the lock that functools.cached_property takes.
        sizes = [shape.numel() for shape in self.shapes]
        tiled = (
            not any(self.complex_)
            and not self.pads
            and sum(sizes) == self.numel
            and list(self.offsets) == list(itertools.accumulate([0, *sizes[:-1]]))
            and all(
                st == contiguous_strides(sh)
                for sh, st in zip(self.shapes, self.strides, strict=True)
            )
        )
        # Each leaf's numel, if the leaves tile the buffer contiguously and in order.
        object.__setattr__(self, "_split_sizes", tuple(sizes) if tiled else None)
        view_shapes = tuple(None if len(sh) == 1 else tuple(sh) for sh in self.shapes)
        object.__setattr__(self, "_view_shapes", view_shapes)
        orders = tuple(
            _order(st, complex_=c) for st, c in zip(self.strides, self.complex_, strict=True)
        )
        object.__setattr__(self, "_orders", orders)
        plain = tuple(
            not c and o == tuple(range(len(o))) for o, c in zip(orders, self.complex_, strict=True)
        )
        object.__setattr__(self, "_plain", plain)
        gaps, pos = [], 0
        for j in range(len(self.shapes)):
            gaps += [self.offsets[j] - pos, self.width(j)]
            pos = self.offsets[j] + self.width(j)
        object.__setattr__(self, "_gaps", tuple(gaps))
        object.__setattr__(self, "_end", pos)
        unflats = []
        for shape, order, c, p in zip(self.shapes, orders, self.complex_, plain, strict=True):
            full = (*shape, 2) if c else tuple(shape)
            unflats.append(
                (tuple(full), None)
                if p
                else (tuple(full[d] for d in order), tuple(_inverse(order)))
            )
        object.__setattr__(self, "_unflats", tuple(unflats))

    def pack(
        self,
        tensors: Sequence[torch.Tensor | None],
        *,
        scale: float = 1.0,
        out: torch.Tensor | None = None,
        views: Sequence[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """A flat buffer (``out``, or a new one) holding ``tensors`` times ``scale``.

        ``None`` packs zeros. Contiguous real leaves are concatenated, or,
        given ``out``'s leaf ``views`` and a scale, each multiplied into its
        view: one pass where a ``cat`` and a scaling are two (7.2 ms against
        5.2 + 3.3 ms for 25.6 MB in 200 leaves). Any other bucket is filled
        through its leaf views by one foreach copy.
        """
        # A loop, not all() of a generator: torch 2.15's dynamo cannot close a
        # generator made inside a traced autograd.Function's forward (replicate's
        # copies), and fails the compile ("generator already executing").
        contiguous = True
        for t in tensors:
            contiguous = contiguous and t is not None and t.is_contiguous()
        fused = out is not None and views is not None and scale != 1.0
        if fused and contiguous and not any(self.complex_):
            # Eagerly on CPU the scale as a 0-d tensor: 1.7 us less a leaf.
            by = scale if _mode.traced() else _compat.number_as_tensor(tensors, scale)  # type: ignore[arg-type]
            for view, t in zip(views, tensors, strict=True):  # type: ignore[arg-type]
                torch.mul(t, by, out=view)  # type: ignore[arg-type]
            return out  # type: ignore[return-value]
        if contiguous and not any(self.complex_):
            flat_leaves = [t.reshape(-1) for t in tensors if t is not None]
            flat = torch.cat(flat_leaves) if out is None else torch.cat(flat_leaves, out=out)
        else:
            flat = self._fill(tensors, out)
        return flat if scale == 1.0 else flat.mul_(scale)

    def pieces(
        self,
        tensors: Sequence[torch.Tensor | None],
        *,
        dtype: torch.dtype | None = None,
        scale: float = 1.0,
        numel: int | None = None,
    ) -> list[torch.Tensor]:
        """The flat buffer's contents as 1-D pieces, functionally: ``torch.cat`` them to pack.

        In the same element order as :meth:`pack` (each leaf in its memory
        order), so it traces (``torch.compile``) and batches (``vmap``)
        where the in-place :meth:`pack` cannot. ``None`` packs zeros, and
        so do the padding and, up to ``numel``, the tail. Each piece is
        converted to ``dtype`` and multiplied by ``scale`` before the
        ``cat``, where inductor fuses both into the one copy that packs the
        bucket (docs/performance.md has the cost of scaling the ``cat``).
        """
        dtype = self.dtype if dtype is None else dtype
        out: list[torch.Tensor] = []
        pos = 0
        for j, t in enumerate(tensors):
            start, n = self.offsets[j], self.width(j)
            if start > pos:
                out.append(torch.zeros(start - pos, dtype=dtype, device=self.device))
            if t is None:
                out.append(torch.zeros(n, dtype=dtype, device=self.device))
            else:
                flat = t.reshape(-1) if self._plain[j] else memory_flat(t, self._orders[j])
                flat = flat if flat.dtype == dtype else flat.to(dtype)
                out.append(flat if scale == 1.0 else flat * scale)
            pos = start + n
        if numel is not None and numel > pos:
            out.append(torch.zeros(numel - pos, dtype=dtype, device=self.device))
        return out

    def unpack(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each leaf's view of ``flat`` (from :meth:`pieces`), with the leaf's shape and strides.

        The functional counterpart of :meth:`views`: built from ``view`` and
        ``permute``, which trace and batch, where :meth:`views` uses
        ``as_strided``.
        """
        out = []
        for j, shape in enumerate(self.shapes):
            part = flat[self.offsets[j] : self.offsets[j] + self.width(j)]
            out.append(memory_unflat(part, shape, self.order(j), complex_=self.complex_[j]))
        return out

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """What :meth:`unpack` gives, through one ``split_with_sizes`` of ``flat`` (any length
        from ``numel`` on: padding after it is one more, unused, piece).

        Its backward writes every leaf's gradient into one new buffer (a
        ``cat``, zeros where a leaf has none), where slicing gives each leaf
        a zero-filled buffer the size of ``flat`` that autograd then adds
        up: one buffer at a time instead of up to three. Multi-output views
        cannot be modified in place, so this is for leaves that are read.
        """
        # Read off __post_init__'s plan: dynamo runs this at every trace, leaf by leaf.
        parts = flat.split_with_sizes([*self._gaps, flat.shape[0] - self._end])
        out = []
        for part, (shape, inverse), c in zip(
            parts[1::2], self._unflats, self.complex_, strict=True
        ):
            view = part.reshape(shape) if inverse is None else part.reshape(shape).permute(inverse)
            out.append(torch.view_as_complex(view) if c else view)
        return out

    def _fill(
        self, tensors: Sequence[torch.Tensor | None], out: torch.Tensor | None
    ) -> torch.Tensor:
        if out is None:
            # new_empty keeps a tensor subclass (and its device) that torch.empty would drop
            like = next((t for t in tensors if t is not None), None)
            flat = self.empty() if like is None else like.new_empty(self.numel, dtype=self.dtype)
        else:
            flat = out
        self.zero_pads(flat)
        views, sources = [], []
        for view, t in zip(self.views(flat), tensors, strict=True):
            if t is None:
                view.zero_()
            else:
                views.append(view)
                sources.append(t)
        _compat.foreach_copy_(views, sources)
        return flat


def real_numel(t: torch.Tensor) -> int:
    """How many real elements ``t`` holds (a complex element is two)."""
    return t.numel() * (2 if t.is_complex() else 1)


def memory_order(t: torch.Tensor) -> tuple[int, ...]:
    """``t``'s dims from the largest planned stride down (ties keep logical order).

    A complex tensor's real/imaginary dim comes last, as in its memory.
    """
    return _order(dense_strides(t), complex_=t.is_complex())


def _order(strides: tuple[int, ...], *, complex_: bool) -> tuple[int, ...]:
    real = [2 * s for s in strides] + [1] if complex_ else list(strides)
    return tuple(sorted(range(len(real)), key=lambda d: -real[d]))


def memory_flat(t: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """``t``'s elements (complex as real pairs) in the memory order ``order``, 1-D.

    A view when ``t`` is laid out as planned; a copy otherwise, same values.
    """
    real = torch.view_as_real(t) if t.is_complex() else t
    return real.permute(order).reshape(-1)


def memory_unflat(
    part: torch.Tensor, shape: torch.Size, order: tuple[int, ...], *, complex_: bool
) -> torch.Tensor:
    """The inverse of :func:`memory_flat`: a view of ``part`` shaped like the leaf, its strides."""
    full = (*shape, 2) if complex_ else tuple(shape)
    # reshape: a view of a slice of a flat buffer, also of a batched one under vmap
    view = part.reshape([full[d] for d in order]).permute(_inverse(order))
    return torch.view_as_complex(view) if complex_ else view


def memory_unflat_rows(
    rows: torch.Tensor, shape: torch.Size, order: tuple[int, ...]
) -> torch.Tensor:
    """Rows of real leaves in memory order ``order`` as a stack ``(k, *shape)``, viewed."""
    view = rows.reshape([rows.shape[0], *(shape[d] for d in order)])
    return view.permute([0, *(1 + d for d in _inverse(order))])


def _inverse(order: tuple[int, ...]) -> list[int]:
    out = [0] * len(order)
    for pos, d in enumerate(order):
        out[d] = pos
    return out


def contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def dense_strides(t: torch.Tensor) -> tuple[int, ...]:
    """The strides ``torch.empty_like(t)`` gives: ``t``'s own if dense, else inferred dense ones."""
    if t.layout != torch.strided:
        return contiguous_strides(t.shape)
    stride = tuple(t.stride())
    if _is_dense(t.shape, stride):  # in Python: no dispatch, no tensor-subclass call
        return stride
    return tuple(torch.empty_like(t, device="meta").stride())


def _is_dense(shape: torch.Size, stride: tuple[int, ...]) -> bool:
    """Non-overlapping and dense, as torch decides it (size-1 dims never stepped over)."""
    if shape.numel() == 0:
        return False
    step = 1
    for d in sorted(range(len(shape)), key=lambda d: stride[d]):
        if shape[d] == 1:
            continue
        if stride[d] != step:
            return False
        step *= shape[d]
    return True


def plan(
    tensors: Sequence[torch.Tensor | None],
    *,
    cap_bytes: int,
    first_cap_bytes: int | None = None,
    order: Sequence[int] | None = None,
) -> list[Bucket]:
    """Groups the non-None ``tensors`` (leaves of one flattened tree) into buckets.

    Args:
        tensors: one entry per leaf; ``None`` marks a leaf that is not bucketed.
        cap_bytes: a bucket closes once it holds at least this many bytes.
        first_cap_bytes: the cap of the first bucket of each (device, dtype);
            ``cap_bytes`` when None.
        order: the leaves in the order they are used (their gradients arrive
            in reverse); the flattened order when None.
    """
    first = cap_bytes if first_cap_bytes is None else first_cap_bytes
    open_: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    sizes: dict[tuple[torch.device, torch.dtype], int] = {}
    closed_count: dict[tuple[torch.device, torch.dtype], int] = {}
    done: list[list[int]] = []
    used = range(len(tensors)) if order is None else order
    for i in reversed(used):
        t = tensors[i]
        if t is None:
            continue
        key = (t.device, _real_dtype(t.dtype))
        open_.setdefault(key, []).append(i)
        sizes[key] = sizes.get(key, 0) + t.numel() * t.element_size()
        cap = first if closed_count.get(key, 0) == 0 else cap_bytes
        if sizes[key] >= cap:
            done.append(open_.pop(key))
            sizes[key] = 0
            closed_count[key] = closed_count.get(key, 0) + 1
    done.extend(open_.values())
    return [_bucket(indices, tensors) for indices in done]


def _real_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype.to_real() if dtype.is_complex else dtype


def _bucket(indices: list[int], tensors: Sequence[torch.Tensor | None]) -> Bucket:
    shapes, strides, complex_, offsets, pads, numel = [], [], [], [], [], 0
    for i in indices:
        t = tensors[i]
        if t is None:  # plan() never puts a None in a bucket
            raise RuntimeError("fdp internal error: a None leaf in a bucket")
        if t.is_complex() and numel % 2:  # view_as_complex needs an even offset
            pads.append(numel)
            numel += 1
        shapes.append(t.shape)
        strides.append(dense_strides(t))
        complex_.append(t.is_complex())
        offsets.append(numel)
        numel += real_numel(t)
    head = tensors[indices[0]]
    if head is None:
        raise RuntimeError("fdp internal error: a None leaf in a bucket")
    return Bucket(
        indices=tuple(indices),
        shapes=tuple(shapes),
        strides=tuple(strides),
        complex_=tuple(complex_),
        offsets=tuple(offsets),
        pads=tuple(pads),
        numel=numel,
        dtype=_real_dtype(head.dtype),
        device=head.device,
    )


class Layout:
    """The buckets of one tree, where each leaf sits in them, and their reusable buffers.

    The one bucket layout behind ``all_reduce_grads``, ``DistributedDataParallel``
    and the per-step reducer: leaf ``i`` lives at ``where[i] = (bucket, slot)``.
    Buffers are reused from call to call while nothing else holds a view of
    them (gradients handed out last step, results a caller kept); a fresh
    buffer of tens of MB costs page faults on every step (docs/performance.md).
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor | None],
        *,
        cap_bytes: int,
        first_cap_bytes: int | None = None,
        order: Sequence[int] | None = None,
    ) -> None:
        self.buckets = plan(
            tensors, cap_bytes=cap_bytes, first_cap_bytes=first_cap_bytes, order=order
        )
        self.where = {
            i: (k, j) for k, b in enumerate(self.buckets) for j, i in enumerate(b.indices)
        }
        self.order = tuple(self.where)  # the bucketed leaves, bucket by bucket
        # A tree's bucketed leaves, in that order, picked in one C call.
        self.bucketed = _tree.picker(self.order)
        self._buffers: list[torch.Tensor | None] = [None] * len(self.buckets)
        self._views: list[list[torch.Tensor] | None] = [None] * len(self.buckets)
        self._lock = threading.Lock()

    def buffer(self, k: int, *, tail: int = 0) -> torch.Tensor:
        """A flat buffer for bucket ``k`` that nobody else uses, ``tail`` elements longer.

        Atomic across threads: the view handed out counts as a user, so a
        second caller (another thread, another step) gets a new buffer.
        """
        with self._lock:
            return self._take(k, tail)[0]

    def buffer_views(self, k: int, *, tail: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """:meth:`buffer`, and its bucket's views of it (``Bucket.views``), made once per buffer.

        Made anew each step they cost a view per leaf (52 for a GPT-2, about
        0.1 ms, more inside a backward). The views stay with the buffer and
        count among its users; they are the caller's own: what it hands out
        (``.grad``, returned gradients) is a ``detach()`` of one, so a user's
        ``set_`` or ``.data =`` on that cannot reach them.
        """
        with self._lock:
            flat, buf = self._take(k, tail)
            views = self._views[k]
            if views is None:
                bucket = self.buckets[k]
                views = self._views[k] = bucket.views(buf.view(-1)[: bucket.numel])
            return flat, views

    def _take(self, k: int, tail: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the flat buffer handed out, the kept buffer it is a view of), under the lock."""
        size = self.buckets[k].numel + tail
        buf, views = self._buffers[k], self._views[k]
        kept = 1 + (0 if views is None else len(views))  # the buffer and its kept views
        # A result still alive, or too short: a new one (a longer one serves both).
        if buf is None or buf.numel() < size or _compat.storage_users(buf) > kept:
            buf = self._buffers[k] = self.buckets[k].empty(tail)
            self._views[k] = None
        return buf.view(-1)[:size], buf

    def view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Leaf ``i``'s view of its bucket's flat buffer ``flat``."""
        k, j = self.where[i]
        return self.buckets[k].view(flat, j)

    def release(self) -> None:
        """Drops the kept buffers (they are freed once no result views them)."""
        with self._lock:
            self._buffers = [None] * len(self.buckets)
            self._views = [None] * len(self.buckets)
