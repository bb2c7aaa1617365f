"""``make_functional``: a module as a pure function of its parameters and buffers.

Each eager call runs on *shells* of the module (:mod:`fdp._shells`): a copy
of the module tree made at the call, that holds the call's tensors, for as
long as autograd needs them, and of which what the forward changes of the
module's Python state is written back. Inside ``torch.compile`` the call
puts the state in the module's own dicts instead, or, where dynamo cannot
trace the module whole, runs on shells there too
(:mod:`fdp._functional_traced`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from fdp import _compat, _functional_traced, _mode, _shells

__all__ = ["make_functional"]

_CALL = "fdp.make_functional"
_BUFFER = "_fdp_module_buffer"


def _call_traced(
    module: nn.Module,
    state: Mapping[str, Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    sync_batch_norm: bool,
    group: Any,
    planned: Callable[[tuple[str, ...]], _functional_traced.Plan],
    prepare: Callable[[list[tuple[nn.Module, nn.Module]]], None] | None = None,
) -> Any:
    """Compiled code runs on one thread: :func:`fdp._functional_traced.call`."""
    if sync_batch_norm:
        raise NotImplementedError(
            f"{_CALL}: `sync_batch_norm=True` does not run inside torch.compile (it swaps "
            "the class of a per-call copy of the module); call fdp.sync_batch_norm in the "
            "compiled function instead"
        )
    return _functional_traced.call(module, state, args, kwargs, planned=planned, prepare=prepare)


@_mode.traced_as(_call_traced)
def _call(
    module: nn.Module,
    state: Mapping[str, Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    sync_batch_norm: bool,
    group: Any,
    planned: Callable[[tuple[str, ...]], _functional_traced.Plan],
    prepare: Callable[[list[tuple[nn.Module, nn.Module]]], None] | None = None,
) -> Any:
    call = _shells.enter(
        module, state, sync_batch_norm=sync_batch_norm, group=group, prepare=prepare
    )
    try:
        out = call.shell(*args, **kwargs)
    except BaseException:
        _shells.leave(call, failed=True)
        raise
    _shells.leave(call, failed=False)
    return out


def _refuse_lazy(state: Mapping[str, torch.Tensor], module: nn.Module) -> None:
    for name, tensor in state.items():
        if is_lazy(tensor):
            raise ValueError(
                f"{_CALL}: `module` has an uninitialized lazy tensor {name!r} "
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
    (missing names fall back to the module's own; a tensor the module holds
    under two names is replaced under both). It is safe to call from several
    threads at once: each call runs on a private shell of the module, made
    from the module as it is at the call, so ``module.eval()``,
    ``module.train()`` and any attribute ``forward`` reads take effect on the
    next call, in every thread. The call's tensors stay in its shell, so
    non-reentrant activation checkpointing recomputes with them.

    What the forward (or a forward hook) changes of the module's Python
    state, plain attributes and buffers it registers, reaches the module when
    the call returns, as after ``module(x)``; tensors updated in place
    (BatchNorm statistics) land on the module directly. Under
    :func:`fdp.data_parallel` or :func:`fdp.parallel_apply` only replica 0's
    changes are kept, once every replica has finished, so one call on N
    replicas changes the module as one call on the whole batch does, and a
    call that raises changes nothing; a direct call that raises leaves what
    its forward changed before the error, as ``module(x)`` does. Hooks
    registered on the module run, with the call's shell as their ``module``
    argument (outside ``data_parallel``, a submodule without parameters or
    buffers in its subtree runs as itself, as in a module call); a hook the
    forward registers lands on the module (replica 0's, under
    ``data_parallel``).

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
            (``nn.LazyLinear`` before its first call); from ``fn``: a name
            of ``state`` the module does not have, or two tensors for one
            tied tensor.
        TypeError: from ``fn``: a ``state`` leaf that is not a tensor.

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
            f"{_CALL}: `module` expected a torch.nn.Module; got {type(module).__name__}"
        )
    state: dict[str, torch.Tensor] = dict(module.named_parameters())
    state.update(module.named_buffers())
    _refuse_lazy(state, module)
    for buffer in module.buffers():
        # Read by fdp.save_checkpoint (rank 0's buffers, as torch's DDP users
        # save) and fdp.load_checkpoint (loaded in place, into the module).
        setattr(buffer, _BUFFER, True)

    def planned(names: tuple[str, ...]) -> _functional_traced.Plan:
        return _functional_traced.plan(module, names)

    # Compiled, dynamo runs `planned` as Python (fdp/_functional_traced.py).
    options = {"sync_batch_norm": sync_batch_norm, "group": group}
    options["planned"] = _compat.traced_constant(planned)

    def fn(state: Mapping[str, torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        if not isinstance(state, Mapping):
            raise TypeError(
                f"{_CALL}: `state` expected a mapping of names to tensors (as make_functional "
                f"returned); got {type(state).__name__}"
            )
        return _call(module, state, args, kwargs, **options)

    fn._fdp_module = module  # type: ignore[attr-defined]  # read by module_call
    fn._fdp_options = options  # type: ignore[attr-defined]
    return fn, state


def module_tensor(t: Any) -> bool:
    """Whether ``t`` is a module's own tensor: an ``nn.Parameter``, or a buffer of a module
    :func:`make_functional` split (``nn.Buffer`` too)."""
    return isinstance(t, nn.Parameter | nn.Buffer) or getattr(t, _BUFFER, False) is True


def module_of(fn: Any) -> nn.Module | None:
    """The module behind a ``make_functional`` function, or None for any other callable."""
    module = getattr(fn, "_fdp_module", None)
    return module if isinstance(module, nn.Module) else None


def module_call(
    fn: Any,
    state: Mapping[str, Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    prepare: Callable[[list[tuple[nn.Module, nn.Module]]], None],
) -> Any:
    """``fn(state, *args, **kwargs)``, with ``prepare(pairs)`` run on the call's shells first.

    ``pairs`` are ``(module, shell)`` for every module, the root first: the
    caller may replace a shell's tensors or its ``forward`` for this call.
    """
    module = module_of(fn)
    if module is None:
        raise TypeError(f"{_CALL}: expected a function make_functional returned")
    options = fn._fdp_options
    return _call(module, state, args, kwargs, prepare=prepare, **options)
