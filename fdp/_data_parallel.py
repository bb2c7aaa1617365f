"""``data_parallel`` for pure functions over parameter pytrees, and ``make_functional``."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from fdp import _sync_batch_norm
from fdp._device import DeviceLike, as_device, as_devices
from fdp._parallel_apply import _parallel_apply
from fdp._replicate import _replicate
from fdp._scatter_gather import _gather, _scatter_kwargs

__all__ = ["data_parallel", "make_functional"]

T = TypeVar("T")


def data_parallel(
    fn: Callable[..., T],
    params: Any,
    inputs: Any,
    *,
    devices: Sequence[DeviceLike] | None = None,
    output_device: DeviceLike | None = None,
    dim: int = 0,
    kwargs: Mapping[str, Any] | None = None,
) -> T:
    """Evaluates ``fn(params, *inputs, **kwargs)`` data-parallel over ``devices``.

    The batch (every tensor leaf of ``inputs`` and ``kwargs``) is split along
    ``dim``, ``params`` is replicated to each device, ``fn`` runs once per
    device (concurrently; see :func:`fdp.parallel_apply`), and the outputs are
    gathered on ``output_device``.
    The result equals one call on the whole batch when ``fn`` treats examples
    independently; gradients of every ``params`` leaf that requires grad are
    summed over replicas onto that leaf's own device. Leaves that do not
    require grad (buffers) are state: each replica updates a private copy
    and replica 0's in-place updates are written to the leaf, so a
    train-mode BatchNorm takes exactly one update per call, from the first
    chunk, whatever the devices and threads (DataParallel's semantics).

    Args:
        fn: ``fn(params, *args, **kwargs)``, a pure function of its arguments
            (see :func:`make_functional` for an ``nn.Module``).
        params: a pytree of tensors (or ``None``) passed as ``fn``'s first
            argument.
        inputs: a tensor, or a plain tuple of positional arguments.
        devices: one replica per entry; repeats allowed (``["cpu", "cpu"]``).
            Default: every CUDA device, else one CPU replica.
        output_device: where outputs are gathered; ``-1`` is the CPU.
            Default: ``devices[0]``.
        dim: the batch dimension of inputs and outputs.
        kwargs: keyword arguments for ``fn``, split like ``inputs``.

    Returns:
        ``fn``'s output pytree with tensor leaves concatenated along ``dim``
        (0-dim outputs become one entry per replica).

    Example:
        >>> import torch, fdp
        >>> params = {"w": torch.randn(3, 2, requires_grad=True)}
        >>> x = torch.randn(8, 3)
        >>> y = fdp.data_parallel(lambda p, x: x @ p["w"], params, x, devices=["cpu", "cpu"])
        >>> torch.allclose(y, x @ params["w"])
        True
    """
    call = "fdp.data_parallel"
    devs = as_devices(devices, call=call)
    target = (
        devs[0]
        if output_device is None
        else as_device(output_device, call=call, arg="output_device")
    )
    chunks, kw_chunks = _scatter_kwargs(inputs, kwargs, devs, dim=dim, chunk_sizes=None, call=call)
    used = devs[: len(chunks)]
    copied_state: list[tuple[torch.Tensor, torch.Tensor]] = []
    replicas = _replicate(params, used, call=call, copied_state=copied_state)
    outputs = _parallel_apply(fn, replicas, chunks, kw_chunks, used)
    _write_back(copied_state)
    gathered: T = _gather(outputs, target, dim=dim, call=call)
    return gathered


def _write_back(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Replica 0's in-place state updates reach the leaves, wherever replica 0 ran.

    Unconditional: kernels such as batch norm update their running
    statistics without bumping the tensor's version, so a change cannot be
    detected. It costs one copy per such leaf when replica 0 is not on the
    leaf's device (keep ``params`` on ``devices[0]`` to avoid it).
    """
    with torch.no_grad():
        for leaf, copy in pairs:
            leaf.copy_(copy)


_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def _shell(module: nn.Module, *, sync_batch_norm: bool = False, group: Any = None) -> nn.Module:
    """A copy of the module tree, as it is now, that shares every tensor but owns its dicts.

    ``functional_call`` swaps tensors in and out of module attributes; on a
    shell of its own, each call swaps without disturbing other threads or the
    original module. Built afresh for every call from each module's current
    ``__dict__``, so whatever ``forward`` reads (``training``, a Dropout's
    ``p``, a user's flag) is live. Built without closures, so no reference
    cycle is left for the garbage collector.
    """
    modules = list(module.modules())
    shells: dict[int, nn.Module] = {}
    for m in modules:
        shell = object.__new__(type(m))
        shell.__dict__.update(m.__dict__)
        if sync_batch_norm and isinstance(m, _BATCH_NORMS):
            _sync_batch_norm.synced(shell, group)
        shells[id(m)] = shell
    for m in modules:
        attrs = shells[id(m)].__dict__
        attrs["_parameters"] = dict(m._parameters)
        attrs["_buffers"] = dict(m._buffers)
        attrs["_modules"] = {
            name: None if child is None else shells[id(child)] for name, child in m._modules.items()
        }
    return shells[id(module)]


def _refuse_lazy(state: Mapping[str, torch.Tensor], module: nn.Module) -> None:
    for name, tensor in state.items():
        if is_lazy(tensor):
            raise ValueError(
                f"fdp.make_functional: `module` has an uninitialized lazy tensor {name!r} "
                f"({type(module.get_submodule(name.rpartition('.')[0])).__name__}); expected "
                "initialized parameters and buffers, got an Uninitialized tensor. Run the module "
                "once on a sample batch first: replicas must not initialize the shared module"
            )


def make_functional(
    module: nn.Module, *, sync_batch_norm: bool = False, group: Any = None
) -> tuple[Callable[..., Any], dict[str, torch.Tensor]]:
    """Splits a module into a pure function and its state.

    ``state`` maps each name of ``module.named_parameters()`` and
    ``module.named_buffers()`` to the module's own tensor (so gradients and
    in-place buffer updates land on the module). ``fn(state, *args,
    **kwargs)`` runs the module's forward with the tensors in ``state``
    (missing names fall back to the module's own); it is safe to call from
    several threads at once because each call works on a private shell of
    the module rather than swapping attributes on the shared one. The shell
    is made from the module as it is at the call, so ``module.eval()``,
    ``module.train()`` and any attribute ``forward`` reads take effect on the
    next call, in every thread. Plain attributes that ``forward`` assigns
    land on the shell and are dropped, as on DataParallel's replicas; tensors
    updated in place (BatchNorm statistics) land on the module.

    With ``sync_batch_norm=True`` the module's ``BatchNorm1d/2d/3d`` layers
    normalise with :func:`fdp.sync_batch_norm` over the batches of every rank
    of ``group`` (what ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``
    does, without touching the module; and it runs under ``torch.func``).
    Not inside ``torch.compile``: there call ``fdp.sync_batch_norm``.

    Args:
        module: the module to split.
        sync_batch_norm: batch statistics over every rank (see above).
        group: the process group for ``sync_batch_norm`` (default: the world).

    Returns:
        ``(fn, state)``.

    Raises:
        ValueError: ``module`` has uninitialized lazy parameters
            (``nn.LazyLinear`` before its first call).

    Example:
        >>> import torch, fdp
        >>> net = torch.nn.Linear(3, 2)
        >>> fn, state = fdp.make_functional(net)
        >>> x = torch.randn(4, 3)
        >>> torch.allclose(fn(state, x), net(x))
        True
    """
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"fdp.make_functional: `module` expected a torch.nn.Module; got {type(module).__name__}"
        )
    state: dict[str, torch.Tensor] = dict(module.named_parameters())
    state.update(module.named_buffers())
    _refuse_lazy(state, module)

    def fn(state: Mapping[str, torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        # Compiled code runs on one thread; dynamo traces the real module.
        if torch.compiler.is_compiling():
            if sync_batch_norm:
                raise NotImplementedError(
                    "fdp.make_functional: `sync_batch_norm=True` does not run inside "
                    "torch.compile (it swaps the class of a per-call copy of the module); call "
                    "fdp.sync_batch_norm in the compiled function instead"
                )
            target = module
        else:
            target = _shell(module, sync_batch_norm=sync_batch_norm, group=group)
        return torch.func.functional_call(target, dict(state), args, kwargs)

    return fn, state
