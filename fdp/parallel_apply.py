"""Running one function per replica concurrently.

Eager calls use a persistent thread pool: torch releases the GIL inside its
kernels, so replicas on several devices (or several CPU replicas) overlap.
The calling thread runs replica 0 itself, which saves one hand-off per call.
Worker threads start with torch's default thread-local state, so grad mode,
inference mode, autocast and the current CUDA device and stream are carried
over explicitly. Threads cannot be traced by dynamo and ``torch.func``
transforms keep their state per thread, so under either a plain loop runs
the replicas instead (GPU launches are asynchronous, so a loop still overlaps
devices).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import ExitStack
from typing import Any, NoReturn

import torch

from fdp import _tree
from fdp._device import DeviceLike, as_device

__all__ = ["parallel_apply"]

_AUTOCAST_TYPES = ("cpu", "cuda")

_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_pool_lock = threading.Lock()
_worker = threading.local()


def _mark_worker() -> None:
    _worker.active = True


def _get_pool(size: int) -> ThreadPoolExecutor:
    global _pool, _pool_size
    with _pool_lock:
        if _pool is None or _pool_size < size:
            old = _pool
            _pool = ThreadPoolExecutor(
                max_workers=size, thread_name_prefix="fdp-replica", initializer=_mark_worker
            )
            _pool_size = size
            if old is not None:
                old.shutdown(wait=False)
        return _pool


def _run_inline() -> bool:
    """Whether replicas must run in a loop on the calling thread."""
    return (
        torch.compiler.is_compiling()
        # A torch.func transform (grad, vmap, ...) is active on this thread.
        or torch._C._functorch.peek_interpreter_stack() is not None
        # A replica calling data_parallel again must not wait on its own pool.
        or getattr(_worker, "active", False)
    )


class _State:
    """The caller's thread-local torch state that a worker must reproduce."""

    def __init__(self, devices: list[torch.device]) -> None:
        self.grad = torch.is_grad_enabled()
        self.inference = torch.is_inference_mode_enabled()
        self.autocast = [
            (t, torch.get_autocast_dtype(t))
            for t in _AUTOCAST_TYPES
            if torch.is_autocast_enabled(t)
        ]
        self.autocast_cache = torch.is_autocast_cache_enabled()
        self.streams = {d: torch.cuda.current_stream(d) for d in set(devices) if d.type == "cuda"}

    def enter(self, stack: ExitStack, device: torch.device) -> None:
        stack.enter_context(torch.inference_mode(self.inference))
        stack.enter_context(torch.set_grad_enabled(self.grad))
        for device_type, dtype in self.autocast:
            stack.enter_context(
                torch.autocast(device_type, dtype=dtype, cache_enabled=self.autocast_cache)
            )
        if device.type == "cuda":
            stack.enter_context(torch.cuda.stream(self.streams[device]))


def _call(
    fn: Callable[..., Any],
    replica: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    device: torch.device,
    state: _State | None,
) -> Any:
    if state is None and device.type != "cuda":
        return fn(replica, *args, **kwargs)
    with ExitStack() as stack:
        if device.type == "cuda":
            stack.enter_context(torch.cuda.device(device))
        if state is not None:
            state.enter(stack, device)
        return fn(replica, *args, **kwargs)


def _reraise(index: int, device: torch.device, err: BaseException) -> NoReturn:
    msg = (
        f"fdp.parallel_apply: replica {index} on device {device} raised {type(err).__name__}: {err}"
    )
    try:
        wrapped = type(err)(msg)
    except Exception:  # exception types whose constructor wants other arguments
        wrapped = RuntimeError(msg)
    raise wrapped from err


def _infer_device(*trees: Any) -> torch.device:
    for tree in trees:
        for leaf in _tree.flatten(tree)[0]:
            if isinstance(leaf, torch.Tensor):
                return leaf.device
    return torch.device("cpu")


def parallel_apply(
    fn: Callable[..., Any],
    replicas: Sequence[Any],
    inputs: Sequence[Any],
    kwargs: Sequence[dict[str, Any]] | None = None,
    devices: Sequence[DeviceLike] | None = None,
) -> list[Any]:
    """Calls ``fn(replicas[i], *inputs[i], **kwargs[i])`` for every ``i`` concurrently.

    Every call finishes before this returns; if any raised, the exception of
    the lowest replica index is re-raised (same type when possible), naming
    the replica and its device, chained to the original.

    Args:
        fn: the function to run, ``fn(params, *args, **kwargs)``.
        replicas: one parameter pytree per replica.
        inputs: per replica, a tuple of positional arguments (anything else
            is the single positional argument).
        kwargs: per replica, a dict of keyword arguments. Default: none.
        devices: per replica, the device it runs on (sets the current CUDA
            device and stream in the worker). Default: the device of the
            first tensor found in the replica or its inputs.

    Returns:
        The outputs, in replica order.

    Example:
        >>> import torch, fdp
        >>> fdp.parallel_apply(lambda p, x: p * x, [2.0, 3.0], [(torch.ones(1),), (torch.ones(1),)])
        [tensor([2.]), tensor([3.])]
    """
    call = "fdp.parallel_apply"
    n = len(replicas)
    if len(inputs) != n:
        raise ValueError(
            f"{call}: `inputs` expected one entry per replica ({n}); got {len(inputs)}"
        )
    kws: Sequence[dict[str, Any]] = [{}] * n if kwargs is None else kwargs
    if len(kws) != n:
        raise ValueError(f"{call}: `kwargs` expected one dict per replica ({n}); got {len(kws)}")
    if devices is None:
        devs = [_infer_device(r, a) for r, a in zip(replicas, inputs, strict=True)]
    else:
        if len(devices) != n:
            raise ValueError(
                f"{call}: `devices` expected one device per replica ({n}); got {len(devices)}"
            )
        devs = [as_device(d, call=call, arg=f"devices[{i}]") for i, d in enumerate(devices)]
    args = [a if type(a) is tuple else (a,) for a in inputs]

    if n == 1 or _run_inline():
        compiling = torch.compiler.is_compiling()
        outputs = []
        for i in range(n):
            if compiling:
                outputs.append(fn(replicas[i], *args[i], **kws[i]))
                continue
            try:
                outputs.append(_call(fn, replicas[i], args[i], kws[i], devs[i], None))
            except Exception as err:
                _reraise(i, devs[i], err)
        return outputs

    state = _State(devs)
    pool = _get_pool(n - 1)
    futures: list[Future[Any]] = [
        pool.submit(_call, fn, replicas[i], args[i], kws[i], devs[i], state) for i in range(1, n)
    ]
    first: tuple[Any, BaseException | None]
    try:
        # The calling thread already has the caller's state.
        first = (_call(fn, replicas[0], args[0], kws[0], devs[0], None), None)
    except Exception as err:
        first = (None, err)
    wait(futures)
    if first[1] is not None:
        _reraise(0, devs[0], first[1])
    outputs = [first[0]]
    for i, future in enumerate(futures, start=1):
        failure = future.exception()
        if failure is not None:
            _reraise(i, devs[i], failure)
        outputs.append(future.result())
    return outputs
