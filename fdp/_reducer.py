"""The per-step gradient reduction behind ``DistributedDataParallel``.

One :class:`Step` lives from ``ddp(params)`` to the end of the backward that
follows. Its leaf hooks pack gradients into bucket buffers and launch full
buckets in order; the engine callback it queues launches the rest, waits and
hands the reduced gradients out. ``fdp/distributed.py`` explains the design.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

if TYPE_CHECKING:
    from fdp.distributed import DistributedDataParallel


def _unwrap(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor under functorch's grad wrappers."""
    functorch = torch._C._functorch
    while functorch.is_gradtrackingtensor(t):
        t = functorch.get_unwrapped(t)
    return t


class Step:
    """The reduction state of one synchronised forward/backward."""

    def __init__(self, ddp: DistributedDataParallel, leaves: list[Any], *, capture: bool) -> None:
        self.ddp = ddp
        self.leaves = leaves
        n = len(ddp._buckets)
        self.flats: list[torch.Tensor | None] = [None] * n
        self.filled: list[set[int]] = [set() for _ in range(n)]
        self.expected: list[int] = [0] * n
        self.futures: list[torch.futures.Future[Any] | None] = [None] * n
        self.hooked: list[int] = []
        self.next_launch = 0
        # None until the first hook decides: True = grads are captured and
        # returned (autograd.grad, torch.func.grad), False = accumulated in .grad.
        self.capture: bool | None = True if capture else None
        self.queued = False
        self.handles: list[RemovableHandle] = []
        self.lock = threading.Lock()

    def register(self) -> None:
        seen: set[int] = set()
        for k, bucket in enumerate(self.ddp._buckets):
            for i in bucket.indices:
                leaf = self.leaves[i]
                # A tensor at several leaves (tied weights) is hooked once; its
                # other leaves reduce zeros and get the same .grad.
                if not leaf.requires_grad or id(leaf) in seen:
                    continue
                seen.add(id(leaf))
                self.expected[k] += 1
                self.hooked.append(i)
                self.handles.append(leaf.register_hook(self._hook(i)))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _hook(self, i: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def hook(grad: torch.Tensor) -> torch.Tensor:
            return self.on_grad(i, grad)

        return hook

    def _flat(self, k: int) -> torch.Tensor:
        flat = self.flats[k]
        if flat is None:
            flat = self.flats[k] = self.ddp._buffer(k)
        return flat

    def _view(self, i: int) -> torch.Tensor:
        k, j = self.ddp._where[i]
        bucket = self.ddp._buckets[k]
        start, shape = bucket.offsets[j], bucket.shapes[j]
        return self._flat(k)[start : start + shape.numel()].view(shape)

    def on_grad(self, i: int, grad: torch.Tensor) -> torch.Tensor:
        with self.lock, torch.no_grad(), torch._C._DisableFuncTorch():
            leaf = self.leaves[i]
            if self.capture is None:
                self.capture = _engine_captures(leaf)
            if not self.queued:
                torch.autograd.Variable._execution_engine.queue_callback(self.finish)
                self.queued = True
            view = self._view(i)
            old = None if self.capture else leaf.grad
            scale = self.ddp._prescale
            if old is None:
                torch.mul(_unwrap(grad), scale, out=view)
            else:  # fold what earlier backwards (under no_sync) accumulated
                torch.add(_unwrap(grad), old, out=view).mul_(scale)
            k = self.ddp._where[i][0]
            self.filled[k].add(i)
            while (
                self.next_launch < len(self.flats)
                and len(self.filled[self.next_launch]) == self.expected[self.next_launch]
            ):
                self._launch(self.next_launch)
        return view if self.capture else grad

    def _launch(self, k: int) -> None:
        flat = self._flat(k)
        bucket = self.ddp._buckets[k]
        for j, i in enumerate(bucket.indices):
            if i in self.filled[k]:
                continue
            start, shape = bucket.offsets[j], bucket.shapes[j]
            view = flat[start : start + shape.numel()]
            leaf = self.leaves[i]
            old = None if self.capture or not leaf.requires_grad else leaf.grad
            if old is None:
                view.zero_()  # unused this step (or frozen): counts as zero
            else:
                torch.mul(old.reshape(-1), self.ddp._prescale, out=view)
        self.futures[k] = self.ddp._reduce(flat, self.ddp._group)
        self.next_launch = k + 1

    def finish(self) -> None:
        with self.lock, torch.no_grad(), torch._C._DisableFuncTorch():
            try:
                while self.next_launch < len(self.flats):
                    self._launch(self.next_launch)
                for k, fut in enumerate(self.futures):
                    flat = self.flats[k]
                    if fut is None or flat is None:
                        raise RuntimeError("fdp internal error: a bucket was never launched")
                    result = fut.wait()
                    if result is not flat:
                        flat.copy_(result)
                if not self.capture:
                    for i in self.hooked:
                        self.leaves[i].grad = self._view(i)
            finally:
                self.remove()
                if self.ddp._step is self:
                    self.ddp._step = None


def sum_hook(bucket: torch.Tensor, group: dist.ProcessGroup | None) -> torch.futures.Future[Any]:
    work = dist.all_reduce(bucket, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])  # type: ignore[no-any-return]


def storage_users(t: torch.Tensor) -> int:
    """How many tensors share ``t``'s storage (``t`` included)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:  # private API gone: never reuse
        return 1 << 30
    # The temporary Storage object made by untyped_storage() holds one more.
    return int(use_count(t.untyped_storage()._cdata)) - 1


def _engine_captures(leaf: torch.Tensor) -> bool:
    """Whether the running backward returns grads (autograd.grad) instead of accumulating."""
    node = torch.autograd.graph.get_gradient_edge(leaf).node
    try:
        torch._C._will_engine_execute_node(node)
    except RuntimeError:
        # torch refuses this query for leaves exactly when autograd.grad runs.
        return True
    return False
