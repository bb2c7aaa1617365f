"""``data_parallel`` for pure functions over parameter pytrees."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch

from fdp._device import DeviceLike, as_device, as_devices
from fdp._parallel_apply import parallel_apply_on
from fdp._replicate import replicate_on
from fdp._scatter_gather import as_args, cat_plain, gather_to, scatter_kwargs_to, split_plain

__all__ = ["data_parallel"]

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
    device (concurrently on distinct devices, in a loop on the CPU; see
    :func:`fdp.parallel_apply`), and the outputs are
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
    # Plain tensors split without a tree to walk; anything else, the general path.
    chunks = split_plain(as_args(inputs), devs, dim) if kwargs is None else None
    if chunks is None:
        chunks, kw_chunks = scatter_kwargs_to(
            inputs, kwargs, devs, dim=dim, chunk_sizes=None, call=call
        )
    else:
        kw_chunks = [{}] * len(chunks)
    used = devs[: len(chunks)]
    copied_state: list[tuple[torch.Tensor, torch.Tensor]] = []
    replicas = replicate_on(params, used, call=call, copied_state=copied_state)
    try:
        outputs = parallel_apply_on(fn, replicas, chunks, kw_chunks, used)
    except TypeError as e:
        hint = _habit(fn, inputs)
        if hint is None:
            raise
        raise TypeError(f"{call}: {hint}; the call raised: {e}") from e
    if copied_state:  # the common case has none; entering no_grad costs more than the rest
        _write_back(copied_state)
    joined = cat_plain(outputs, target, dim)
    gathered: T = gather_to(outputs, target, dim=dim, call=call) if joined is None else joined
    return gathered


def _habit(fn: Any, inputs: Any) -> str | None:
    """A torch habit that may explain a TypeError from ``fn``, or None."""
    if isinstance(fn, torch.nn.Module):
        return (
            "`fn` is a torch.nn.Module, which data_parallel calls as fn(params, *inputs): "
            "use fn, state = fdp.make_functional(module) and pass fn and state"
        )
    if type(inputs) is list:
        return (
            "`inputs` is a list, passed to fn as one argument; several positional arguments "
            "are a tuple: pass tuple(inputs)"
        )
    return None


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
