"""Comm hooks: how ``DistributedDataParallel`` reduces one bucket.

The protocol is torch's (``DistributedDataParallel.register_comm_hook``):
``hook(state, bucket) -> Future[Tensor]``, where ``bucket`` is a
:class:`GradBucket` and the future resolves to the *average* of the bucket
over the ranks. So torch's own hooks run unmodified
(``torch.distributed.algorithms.ddp_comm_hooks``: ``default_hooks``,
``powerSGD_hook`` with its ``PowerSGDState``, the fp16/bf16 wrappers), and
fdp's hooks below follow the same protocol, with the process group (or
``None``: the world) as ``state``, as torch's default hooks do.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from fdp import _compat

__all__ = [
    "CommHook",
    "GradBucket",
    "allreduce_hook",
    "bf16_compress_hook",
    "bf16_wire_hook",
    "fp16_compress_hook",
]


class GradBucket:
    """One bucket of gradients, as a comm hook sees it (torch's ``dist.GradBucket`` API).

    ``buffer()`` is the flat 1-D tensor of this rank's gradients for the
    bucket (full precision; ``gradients()`` are views into it, shaped like
    ``parameters()``). ``index()`` counts buckets in reduction order, and
    ``is_last()`` marks the last of a step (PowerSGD counts steps on it).
    ``set_buffer(t)`` replaces the buffer the hook works on, e.g. by a
    compressed copy; the reduced result is copied back into the bucket.
    """

    def __init__(
        self,
        buffer: torch.Tensor,
        *,
        index: int,
        is_last: bool,
        gradients: Sequence[torch.Tensor],
        parameters: Sequence[torch.Tensor],
    ) -> None:
        self._buffer = buffer
        self._index = index
        self._is_last = is_last
        self._gradients = list(gradients)
        self._parameters = list(parameters)

    def buffer(self) -> torch.Tensor:
        """The flat bucket of gradients this step reduces."""
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        """Replaces the flat bucket (hooks that reduce into a new tensor)."""
        self._buffer = buffer

    def index(self) -> int:
        """The bucket's position; bucket 0 is reduced first."""
        return self._index

    def is_last(self) -> bool:
        """Whether this is the step's last bucket."""
        return self._is_last

    def gradients(self) -> list[torch.Tensor]:
        """The bucket's gradients, views of :meth:`buffer` in leaf order."""
        return self._gradients

    def parameters(self) -> list[torch.Tensor]:
        """The parameters whose gradients the bucket holds, in the same order."""
        return self._parameters

    def __repr__(self) -> str:
        n = self._buffer.numel()
        return f"GradBucket(index={self._index}, numel={n}, is_last={self._is_last})"


CommHook = Callable[[Any, GradBucket], "torch.futures.Future[Any]"]
"""``hook(state, bucket) -> Future[Tensor]``, called once per bucket and step.

``state`` is what was registered with the hook (fdp's and torch's default
hooks take the process group, ``None`` meaning the world). The future must
resolve to the *average* over the ranks of ``bucket.buffer()``, with the
buffer's shape and device (any floating dtype: it is copied into the
bucket); it may be the buffer itself, reduced in place, or a list of that
one tensor (a collective's own ``work.get_future()``, as torch's DDP
accepts). Every rank must issue the same collectives.
"""


Reduced = torch.futures.Future[torch.Tensor] | torch.futures.Future[list[torch.Tensor]]
"""What a comm hook returns: a future of the reduced bucket, or of a list of it."""


def resolved(future: Any) -> Any:
    """What a comm hook's future resolves to, a collective's one-tensor list unwrapped."""
    out = future.wait()
    if isinstance(out, list) and len(out) == 1:
        return out[0]
    return out


def allreduce_hook(
    state: ProcessGroup | None, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """The default: averages the bucket in place with one asynchronous all-reduce.

    Example::

        ddp = fdp.DistributedDataParallel(params, comm_hook=fdp.allreduce_hook)
    """
    return _into(bucket.buffer(), _allreduce(state, bucket))


def _allreduce(state: ProcessGroup | None, bucket: GradBucket) -> Reduced:
    return _average(state, bucket.buffer())


def _average(group: ProcessGroup | None, flat: torch.Tensor) -> Reduced:
    # Divide first, as torch's DDP does: one pass, and no overflow in the sum.
    flat.div_(dist.get_world_size(group))
    return sum_hook(flat, group)


def sum_hook(flat: torch.Tensor, group: ProcessGroup | None) -> Reduced:
    """DDP's reduction without a comm hook: the sum (packing already divided).

    The collective's own future (of ``[flat]``), not a ``.then`` of it: a
    Python callback runs on the communication thread, which must take the
    GIL from the thread running backward (measured: 2.5 ms a step of a
    4-layer Llama at one rank, most of what fdp's DDP cost over torch's).
    """
    future: torch.futures.Future[list[torch.Tensor]]
    future = _compat.all_reduce_sum(flat, group).get_future()
    return future


def _into(flat: torch.Tensor, future: Reduced) -> torch.futures.Future[torch.Tensor]:
    """A future of ``flat`` holding the result: what torch's DDP takes from a Python hook."""

    def copy(done: Reduced) -> torch.Tensor:
        out = resolved(done)
        return flat if out is flat else flat.copy_(out)

    return future.then(copy)


def _compressed(group: ProcessGroup | None, flat: torch.Tensor, dtype: torch.dtype) -> Reduced:
    """``flat`` averaged over the ranks in ``dtype``: a future of ``[result]``, no callback."""
    if flat.dtype == dtype:
        return _average(group, flat)
    return sum_hook(flat.to(dtype).div_(dist.get_world_size(group)), group)


def fp16_compress_hook(
    state: ProcessGroup | None, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Reduces each bucket in float16 (half the bytes) and hands back full precision.

    Example::

        ddp = fdp.DistributedDataParallel(params, comm_hook=fdp.fp16_compress_hook)
    """
    return _into(bucket.buffer(), _fp16(state, bucket))


def _fp16(state: ProcessGroup | None, bucket: GradBucket) -> Reduced:
    return _compressed(state, bucket.buffer(), torch.float16)


def bf16_compress_hook(
    state: ProcessGroup | None, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Reduces each bucket in bfloat16 (half the bytes, float32's range).

    Example::

        ddp = fdp.DistributedDataParallel(params, comm_hook=fdp.bf16_compress_hook)
    """
    return _into(bucket.buffer(), _bf16(state, bucket))


def _bf16(state: ProcessGroup | None, bucket: GradBucket) -> Reduced:
    return _compressed(state, bucket.buffer(), torch.bfloat16)


def direct(hook: CommHook) -> CommHook:
    """The form of ``hook`` fdp's DDP runs: fdp's own hooks without their callback.

    The same collectives; the future resolves to the collective's
    ``[result]``, which the reduction copies into the bucket (see
    :func:`sum_hook` for why). Any other hook is run as it is.
    """
    return _DIRECT.get(hook, hook)


# Each public hook is ``_into(bucket.buffer(), its direct form(state, bucket))``.
_DIRECT: dict[Any, CommHook] = {
    allreduce_hook: _allreduce,
    fp16_compress_hook: _fp16,
    bf16_compress_hook: _bf16,
}


def check_future(future: object) -> None:
    """Raises unless a comm hook returned something to wait on."""
    if not callable(getattr(future, "wait", None)):
        raise TypeError(
            f"fdp.DistributedDataParallel: `comm_hook` expected to return a "
            f"torch.futures.Future of the reduced bucket; got {type(future).__name__} "
            f"{future!r:.80}"
        )


def check_result(result: object, flat: torch.Tensor) -> None:
    """Raises unless a comm hook's future resolved to a tensor of the bucket's shape."""
    if not isinstance(result, torch.Tensor) or result.shape != flat.shape:
        raise TypeError(
            "fdp.DistributedDataParallel: `comm_hook` expected to resolve each bucket to a "
            f"tensor of the bucket's shape {tuple(flat.shape)} (or a list of one); got "
            f"{type(result).__name__} {tuple(getattr(result, 'shape', ()))}"
        )


def bf16_wire_hook(
    state: ProcessGroup | None, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """bfloat16 bytes on the wire, float32 sums: half the bytes, an error that does not grow.

    :func:`bf16_compress_hook` all-reduces in bfloat16, so every partial sum
    on the way is rounded and the error grows with the number of ranks. This
    hook sends each rank's bfloat16 chunk of the bucket to the rank that sums
    it (an all-to-all, started when the bucket is full), adds the chunks in
    float32, and all-gathers the sums in bfloat16 when backward ends: the
    same bytes as bf16's all-reduce, and two roundings at any world size
    (docs/performance.md has the errors measured at 2, 4 and 8 ranks). For
    ``fdp.DistributedDataParallel`` (its result is computed when waited for,
    in bucket order on every rank), eagerly.

    Example::

        ddp = fdp.DistributedDataParallel(params, comm_hook=fdp.bf16_wire_hook)
    """
    return _WireSum(bucket.buffer(), state)  # type: ignore[return-value]


class _WireSum:
    """:func:`bf16_wire_hook`'s reduction: the all-to-all in flight, the rest at ``wait``."""

    def __init__(self, flat: torch.Tensor, group: ProcessGroup | None) -> None:
        self.flat, self.group = flat, group
        world = dist.get_world_size(group)
        n = flat.numel()
        chunks = flat.new_zeros(n + -n % world, dtype=torch.bfloat16)
        torch.div(flat, world, out=chunks[:n])  # divided in float32, rounded once
        self.rows = torch.empty_like(chunks).view(world, -1)
        self.work = dist.all_to_all_single(self.rows, chunks, group=group, async_op=True)
        self.result: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self.result is None:
            self.work.wait()
            mine = self.rows[0].float()
            for row in self.rows[1:]:  # this rank's chunk of the sum, in float32, in rank order
                mine += row
            whole = torch.empty_like(self.rows)
            dist.all_gather(list(whole.unbind()), mine.to(torch.bfloat16), group=self.group)
            self.result = self.flat.copy_(whole.view(-1)[: self.flat.numel()])
        return self.result

    def value(self) -> torch.Tensor:
        return self.wait()

    def done(self) -> bool:
        return self.result is not None


def one_collective(hook: object) -> bool:
    """Whether ``hook`` issues its one collective when called (none from callbacks).

    Buckets reduced with such a hook may be in flight together. A hook of
    another layer says so with ``hook.fdp_one_collective = True``.
    """
    return hook in ONE_COLLECTIVE or getattr(hook, "fdp_one_collective", False) is True


ONE_COLLECTIVE = frozenset(
    [
        allreduce_hook,
        fp16_compress_hook,
        bf16_compress_hook,
        default_hooks.allreduce_hook,
        default_hooks.fp16_compress_hook,
        default_hooks.bf16_compress_hook,
        # Its all-to-all starts when called; its all-gather when waited for, which
        # fdp's DDP does in bucket order on every rank.
        bf16_wire_hook,
    ]
)


def _annotation_ok(annotation: Any, allowed: tuple[Any, ...], suffix: str) -> bool:
    if annotation is inspect.Parameter.empty or annotation in allowed:
        return True
    # An annotation left a string (``from __future__ import annotations`` in a
    # module whose names cannot be resolved here) is judged by its text.
    return isinstance(annotation, str) and annotation.replace(" ", "").endswith(suffix)


def check_hook(hook: object, *, call: str, arg: str = "hook") -> None:
    """Refuses what torch's ``_check_comm_hook`` refuses: not callable, or wrong annotations.

    Annotations are evaluated when they can be (torch compares the raw
    ones, so it refuses a correct hook written under postponed annotations).
    """
    if not callable(hook):
        raise TypeError(f"{call}: `{arg}` expected a callable hook(state, bucket); got {hook!r}")
    try:
        sig = inspect.signature(hook, eval_str=True)
    except (NameError, SyntaxError, TypeError, AttributeError):
        sig = inspect.signature(hook)
    except ValueError:  # no signature to read (some builtins): nothing to check
        return
    try:
        sig.bind(None, None)
    except TypeError:
        raise TypeError(
            f"{call}: `{arg}` expected a callable hook(state, bucket) taking two positional "
            f"arguments; got the signature {sig}"
        ) from None
    params = [p for p in sig.parameters.values() if p.kind != p.VAR_KEYWORD]
    bucket = sig.parameters.get("bucket", params[1] if len(params) > 1 else None)
    if bucket is not None and not _annotation_ok(
        bucket.annotation, (GradBucket, getattr(dist, "GradBucket", GradBucket)), "GradBucket"
    ):
        raise ValueError(
            f"{call}: `{arg}`'s bucket annotation expected GradBucket (fdp's or torch's "
            f"dist.GradBucket); got {inspect.formatannotation(bucket.annotation)!r}"
        )
    futures = (torch.futures.Future[torch.Tensor], torch.futures.Future)
    if not _annotation_ok(sig.return_annotation, futures, "Future[torch.Tensor]"):
        raise ValueError(
            f"{call}: `{arg}`'s return annotation expected torch.futures.Future[torch.Tensor]; "
            f"got {inspect.formatannotation(sig.return_annotation)!r}"
        )
