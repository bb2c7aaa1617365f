"""Running one function per replica concurrently.

Eager calls on several devices use persistent worker threads (see
``fdp/_workers.py``): torch releases the GIL inside its kernels, so the devices
overlap. Replicas that all live on the CPU run in a loop: they share the
same cores, which torch's intra-op parallelism already uses (see
:func:`_all_cpu`).
Worker threads start with torch's default thread-local state, so grad mode,
inference mode, autocast and the current CUDA device and stream are carried
over explicitly. Threads cannot be traced by dynamo and ``torch.func``
transforms keep their state per thread, so under either a plain loop runs
the replicas instead (GPU launches are asynchronous, so a loop still overlaps
devices).
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from typing import Any, NoReturn, TypeVar

import torch

from fdp import _caches, _compat, _grad, _mode, _replica, _tree, _workers
from fdp._device import DeviceLike, all_cpu, as_device

__all__ = ["parallel_apply"]

T = TypeVar("T")

_AUTOCAST_TYPES = ("cpu", "cuda")


def _all_cpu(devices: list[torch.device]) -> bool:
    """Whether every replica is on the CPU: then they run in a loop, whatever the thread count.

    With several intra-op threads, concurrent replicas only compete for the
    same cores (two OpenMP teams spinning on two cores). With one, a worker's
    wake-up and the GIL cost more than small replicas gain, most of all on a
    loaded machine, and a user who asked torch for one thread asked for one
    core (docs/performance.md, "Measurements behind design choices").
    """
    return all_cpu(devices)


def _run_inline() -> bool:
    """Whether replicas must run in a loop on the calling thread."""
    return (
        # A torch.func transform (grad, vmap, ...) is active on this thread.
        _mode.transform_running()
        # A replica calling data_parallel again must not wait on its own pool.
        or _workers.inside_worker()
    )


class _State:
    """What a replica's thread must reproduce of the caller's torch state."""

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
        self.default_devices = _compat.default_device_modes() or []
        self.grad_depth = _grad.call_depth()  # an fdp.grad's function calls the replicas
        # A new thread starts with grad on, inference mode off, no autocast,
        # no default device.
        changed = not self.grad or self.inference or bool(self.autocast)
        self.carry = changed or bool(self.default_devices) or bool(self.grad_depth)
        self.uncarried = _compat.uncarried_thread_state(carried=changed)

    def needed(self, device: torch.device, *, on_caller: bool) -> bool:
        return device.type == "cuda" or (self.carry and not on_caller)

    def enter(self, stack: ExitStack, device: torch.device, *, on_caller: bool) -> None:
        if not on_caller:
            for default in self.default_devices:
                stack.enter_context(torch.device(default))
            if self.grad_depth:
                stack.enter_context(_grad.calling(self.grad_depth))
            if self.inference:
                stack.enter_context(torch.inference_mode())
            if not self.grad:
                stack.enter_context(torch.no_grad())
            for device_type, dtype in self.autocast:
                stack.enter_context(
                    torch.autocast(device_type, dtype=dtype, cache_enabled=self.autocast_cache)
                )
        if device.type == "cuda":
            stack.enter_context(torch.cuda.device(device))
            stack.enter_context(torch.cuda.stream(self.streams[device]))


def _call(
    fn: Callable[..., Any],
    replica: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    device: torch.device,
    state: _State | None,
    which: tuple[int, _replica.Deferred],
    *,
    on_caller: bool = False,
) -> Any:
    token = _replica.enter(which)
    try:
        return _call_on_device(fn, replica, args, kwargs, device, state, on_caller=on_caller)
    finally:
        _replica.leave(token)


def _call_on_device(
    fn: Callable[..., Any],
    replica: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    device: torch.device,
    state: _State | None,
    *,
    on_caller: bool = False,
) -> Any:
    if state is None:
        if device.type != "cuda":
            return fn(replica, *args, **kwargs)
        with torch.cuda.device(device):
            return fn(replica, *args, **kwargs)
    if not state.needed(device, on_caller=on_caller):
        return fn(replica, *args, **kwargs)
    with ExitStack() as stack:
        state.enter(stack, device, on_caller=on_caller)
        return fn(replica, *args, **kwargs)


def _hint_key(fn: Callable[..., Any]) -> Any:
    # A bound method is a new object on every attribute access; its function is not.
    return getattr(fn, "__func__", fn)


# Compiled functions (torch.compile) not yet called through parallel_apply.
# Two threads making the first call of a compiled function at once compile it
# twice, so the first call runs the replicas in a loop on the calling thread:
# it compiles once, for every chunk shape, and later calls find it warm.
_warm: weakref.WeakSet[Any] = weakref.WeakSet()


@_caches.register
def forget_compiled() -> None:
    """Forgets which compiled functions were called (see :func:`fdp.clear_caches`)."""
    _warm.clear()


def _cold_compiled(fn: Callable[..., Any]) -> bool:
    key = _hint_key(fn)
    compiled = hasattr(key, "_torchdynamo_orig_callable") or _compat.is_compiled_module(key)
    if not compiled:
        return False
    try:
        if key in _warm:
            return False
        _warm.add(key)
    except TypeError:  # not weak-referenceable: always take the safe path
        pass
    return True


def _reraise(index: int, device: torch.device, err: BaseException) -> NoReturn:
    """Raises the replica's own exception object, with a note naming the replica (PEP 678)."""
    note = f"fdp.parallel_apply: raised by replica {index} on device {device}"
    if sys.version_info >= (3, 11):
        err.add_note(note)
    else:  # pragma: no cover (3.10 keeps notes but does not print them)
        err.__notes__ = [*getattr(err, "__notes__", []), note]  # type: ignore[attr-defined]
    raise err


def _infer_device(*trees: Any) -> torch.device:
    for tree in trees:
        for leaf in _tree.flatten(tree)[0]:
            if isinstance(leaf, torch.Tensor):
                return leaf.device
    return torch.device("cpu")


def parallel_apply(
    fn: Callable[..., T],
    replicas: Sequence[Any],
    inputs: Sequence[Any],
    kwargs: Sequence[dict[str, Any]] | None = None,
    devices: Sequence[DeviceLike] | None = None,
) -> list[T]:
    """Calls ``fn(replicas[i], *inputs[i], **kwargs[i])`` for every ``i``.

    Replicas on distinct devices run concurrently on persistent worker
    threads. They run in a loop on the calling thread inside ``torch.func``
    transforms and while compiling (threads cannot be traced), when all
    replicas are on the CPU (they share its cores, which torch's intra-op
    threads already use, whatever their number), and on the first call of a
    compiled function (it compiles once, on the caller). The choice depends
    only on the arguments and that state, never on timings.

    They also run in a loop when the caller has thread-local state a worker
    cannot reproduce (a dispatch mode such as ``FlopCounterMode``,
    saved-tensor hooks such as ``save_on_cpu``): grad mode, inference mode,
    autocast, ``torch.device`` contexts and the CUDA device and stream are
    carried to the workers. Either way the results are the same.

    Every call finishes before this returns; if any raised, the exception
    object of the lowest replica index is re-raised as it is (type, args and
    attributes intact), with a note (PEP 678) naming the replica and device.

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
    _, kws, devs = _check_arguments(replicas, inputs, kwargs, devices, call=call)
    return parallel_apply_on(fn, replicas, inputs, kws, devs)


def parallel_apply_on(
    fn: Callable[..., Any],
    replicas: Sequence[Any],
    inputs: Sequence[Any],
    kws: Sequence[dict[str, Any]],
    devs: list[torch.device],
) -> list[Any]:
    """:func:`parallel_apply` on checked arguments and normalised devices."""
    args: Sequence[tuple[Any, ...]] = inputs
    for a in inputs:  # scatter's chunks are tuples already: no new list for them
        if type(a) is not tuple:
            args = [a if type(a) is tuple else (a,) for a in inputs]
            break
    return _run(fn, replicas, args, kws, devs)


def _run_traced(
    fn: Callable[..., Any],
    replicas: Sequence[Any],
    args: Sequence[tuple[Any, ...]],
    kws: Sequence[dict[str, Any]],
    devs: list[torch.device],
) -> list[Any]:
    """One after another: compiled code runs on one thread, without the replica context."""
    return [fn(r, *a, **k) for r, a, k in zip(replicas, args, kws, strict=True)]


@_mode.traced_as(_run_traced)
def _run(
    fn: Callable[..., Any],
    replicas: Sequence[Any],
    args: Sequence[tuple[Any, ...]],
    kws: Sequence[dict[str, Any]],
    devs: list[torch.device],
) -> list[Any]:
    """The replicas on worker threads, or in a loop where threads cannot help."""
    deferred: _replica.Deferred = []
    state = None
    on_cpu = _all_cpu(devs)
    if not (len(replicas) == 1 or on_cpu or _run_inline() or _cold_compiled(fn)):
        state = _State(devs)
    if state is None or state.uncarried is not None:
        outputs = _loop(fn, replicas, args, kws, devs, deferred, on_cpu=on_cpu)
    else:
        outputs = _threaded(fn, replicas, args, kws, devs, state, deferred)
    # Only now, so that no replica saw another's changes (see fdp._replica).
    if deferred:
        _replica.run(deferred)
    return outputs


def _check_sequence(value: object, name: str, n: int | None, *, call: str) -> int:
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise TypeError(
            f"{call}: `{name}` expected a sequence with one entry per replica; "
            f"got {type(value).__name__}"
        )
    if n is not None and len(value) != n:
        what = {"kwargs": "one dict", "devices": "one device"}.get(name, "one entry")
        raise ValueError(f"{call}: `{name}` expected {what} per replica ({n}); got {len(value)}")
    return len(value)


def _check_arguments(
    replicas: object, inputs: object, kwargs: object, devices: object, *, call: str
) -> tuple[int, Sequence[dict[str, Any]], list[torch.device]]:
    n = _check_sequence(replicas, "replicas", None, call=call)
    if n == 0:
        raise ValueError(f"{call}: `replicas` expected at least one replica; got none")
    _check_sequence(inputs, "inputs", n, call=call)
    kws: Sequence[dict[str, Any]] = [{}] * n
    if kwargs is not None:
        _check_sequence(kwargs, "kwargs", n, call=call)
        kws = kwargs  # type: ignore[assignment]
        for i, kw in enumerate(kws):
            if not isinstance(kw, Mapping):
                raise TypeError(
                    f"{call}: `kwargs[{i}]` expected a dict of keyword arguments; "
                    f"got {type(kw).__name__}"
                )
    if devices is None:
        pairs: Any = zip(replicas, inputs, strict=True)  # type: ignore[call-overload]
        devs = [_infer_device(r, a) for r, a in pairs]
    else:
        _check_sequence(devices, "devices", n, call=call)
        listed: Sequence[Any] = devices  # type: ignore[assignment]
        devs = [as_device(d, call=call, arg=f"devices[{i}]") for i, d in enumerate(listed)]
    return n, kws, devs


def _threaded(
    fn: Callable[..., Any],
    replicas: Sequence[Any],
    args: Sequence[tuple[Any, ...]],
    kws: Sequence[dict[str, Any]],
    devs: list[torch.device],
    state: _State,
    deferred: _replica.Deferred,
) -> list[Any]:
    """Replica 0 on the caller, the others on workers (or the caller, if it gets there first)."""
    n = len(replicas)
    dfr = deferred
    jobs = [
        _workers.Job(
            functools.partial(_call, fn, replicas[i], args[i], kws[i], devs[i], state, (i, dfr))
        )
        for i in range(1, n)
    ]
    _workers.start(jobs)
    first: Any = None
    error: BaseException | None = None
    try:
        first = _call(
            fn, replicas[0], args[0], kws[0], devs[0], state, (0, deferred), on_caller=True
        )
    except BaseException as err:  # KeyboardInterrupt too: the others finish first
        error = err
    for job in jobs:
        job.run_if_unclaimed()
    # Every replica finishes before anything is raised.
    for job in jobs:
        job.wait()
    if error is not None:
        _reraise(0, devs[0], error)
    for i, job in enumerate(jobs, start=1):
        if job.error is not None:
            _reraise(i, devs[i], job.error)
    return [first, *(job.result for job in jobs)]


def _loop(
    fn: Callable[..., Any],
    replicas: Sequence[Any],
    args: Sequence[tuple[Any, ...]],
    kws: Sequence[dict[str, Any]],
    devs: list[torch.device],
    deferred: _replica.Deferred,
    *,
    on_cpu: bool,
) -> list[Any]:
    """The replicas one after another on the calling thread."""
    outputs = []
    errors: list[tuple[int, BaseException]] = []
    for i in range(len(replicas)):
        token = _replica.enter((i, deferred))
        try:
            if on_cpu:  # the call itself: the loop is the hot path of CPU replicas
                kw = kws[i]
                outputs.append(fn(replicas[i], *args[i], **kw) if kw else fn(replicas[i], *args[i]))
            else:
                outputs.append(_call_on_device(fn, replicas[i], args[i], kws[i], devs[i], None))
        except Exception as err:
            # As with threads: every replica runs before the first error is raised.
            errors.append((i, err))
            outputs.append(None)
        except BaseException as err:  # KeyboardInterrupt, SystemExit: nothing else runs
            _reraise(i, devs[i], err)
        finally:
            _replica.leave(token)
    if errors:
        _reraise(errors[0][0], devs[errors[0][0]], errors[0][1])
    return outputs
