"""``torch.func``'s internals: which transforms run, functorch's wrappers, forward-mode tangents.

Part of :mod:`fdp._compat` (its docstring says how each function degrades).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch


def functorch_active() -> bool:
    """Whether a ``torch.func`` transform (grad, vmap, ...) is running on this thread.

    If ``peek_interpreter_stack`` goes: functorch's ``maybe_current_level``
    answers the same; returning True is the safe fallback (replicas loop).
    """
    # While dynamo traces, ``peek_interpreter_stack() is not None`` is always
    # True (torch 2.13 wraps even a None result in a variable, and the
    # variable is not None); the result's class is traced correctly.
    top: object = torch._C._functorch.peek_interpreter_stack()
    return top.__class__ is not type(None)


def one_jvp() -> bool:
    """Whether exactly one ``torch.func`` transform runs, and it is ``jvp``.

    Call only while :func:`functorch_active`. Traceable by dynamo (its
    interpreter variable answers ``level`` and ``key``); if
    ``retrieve_current_functorch_interpreter`` goes, answer False (fdp then
    refuses every compiled transform, as before).
    """
    from torch._functorch.pyfunctorch import retrieve_current_functorch_interpreter

    top = retrieve_current_functorch_interpreter()
    jvp = torch._C._functorch.TransformType.Jvp
    return bool(top.level() == 1 and top.key() == jvp)


def unwrap_functorch(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor under functorch's grad wrappers.

    If ``is_gradtrackingtensor``/``get_unwrapped`` go, the DDP tests under
    ``torch.func.grad`` fail loudly; torch.func's public API has no equivalent.
    """
    functorch = torch._C._functorch
    while functorch.is_gradtrackingtensor(t):
        t = functorch.get_unwrapped(t)
    return t


def unwrap_all_functorch(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor under functorch's grad and vmap wrappers (batch dims included).

    For reading values every slice shares; if the predicates go, the
    collectives' flag under ``vmap`` fails loudly (tested).
    """
    functorch = torch._C._functorch
    while functorch.is_gradtrackingtensor(t) or functorch.is_batchedtensor(t):
        t = functorch.get_unwrapped(t)
    return t


def is_transformed(t: torch.Tensor) -> bool:
    """Whether ``t`` is a ``torch.func`` wrapper (grad tracking or batched) at some level.

    If ``is_functorch_wrapped_tensor`` goes, ``is_gradtrackingtensor`` or
    ``is_batchedtensor`` answer the same; fdp then picks its transform path.
    """
    functorch = torch._C._functorch
    return bool(functorch.is_functorch_wrapped_tensor(t))


def any_transformed(tensors: Iterable[torch.Tensor]) -> bool:
    """:func:`is_transformed` of any of ``tensors`` (tensors only), in C calls."""
    return any(map(torch._C._functorch.is_functorch_wrapped_tensor, tensors))


def innermost_is_grad() -> bool:
    """Whether the innermost running ``torch.func`` transform is reverse mode (grad, vjp).

    There a wrapped tensor that does not require grad is not differentiated
    at that level (an argument outside ``argnums``). If
    ``retrieve_current_functorch_interpreter`` goes, False (the safe answer).
    """
    from torch._functorch.pyfunctorch import retrieve_current_functorch_interpreter

    try:
        top = retrieve_current_functorch_interpreter()
    except (RuntimeError, AssertionError):  # no transform running
        return False
    return bool(top.key() == torch._C._functorch.TransformType.Grad)


def traced_transform_keeps_backward(inputs: Sequence[torch.Tensor]) -> bool:
    """Whether dynamo, tracing inside a ``torch.func`` transform, keeps a custom Function's
    backward for these inputs (call only while it traces one).

    Dynamo keeps the backward only where it sees an input that requires grad.
    Up to torch 2.14 a tensor of ``torch.func.grad`` reports
    ``requires_grad=False`` while traced, so dynamo inlines the forward and
    drops the backward (pytorch/pytorch#193279); torch 2.15 reports True and
    keeps it. Only one reverse-mode transform (``grad``, ``vjp``) is
    answered for, and only when every input reports ``requires_grad`` (one
    that does not would be copied without autograd). Traceable as
    :func:`one_jvp` is; if the interpreter API goes, False (refuse).
    """
    from torch._functorch.pyfunctorch import retrieve_current_functorch_interpreter

    top = retrieve_current_functorch_interpreter()
    grad = torch._C._functorch.TransformType.Grad
    if not (top.level() == 1 and top.key() == grad):
        return False
    return all(t.requires_grad for t in inputs)


def has_tangent(t: torch.Tensor) -> bool:
    """Whether ``t`` carries a tangent of ``torch.autograd.forward_ad`` (a dual tensor).

    Public API, kept here beside :func:`is_transformed` so that the
    single-process modules need no distributed one to ask.
    """
    import torch.autograd.forward_ad as fwAD

    if not dual_level_active():
        return False
    return fwAD.unpack_dual(t).tangent is not None  # type: ignore[no-untyped-call]


def dual_level_active() -> bool:
    """Whether a ``torch.autograd.forward_ad`` level is open (``torch.func.jvp`` opens one).

    Outside every dual level no tensor has a tangent; asking each costs
    1.5 us a leaf, 0.3 ms for a 200-leaf tree. If ``_current_level`` goes,
    the answer is always True (ask each tensor).
    """
    import torch.autograd.forward_ad as fwAD

    return bool(getattr(fwAD, "_current_level", 0) >= 0)


def functorch_disabled() -> Any:
    """A context in which functorch does not intercept ops (collectives in backward hooks).

    If ``_DisableFuncTorch`` goes, DDP under ``torch.func.grad`` raises in
    the collectives (tested); look for its successor in torch._functorch.
    """
    return torch._C._DisableFuncTorch()


def only_reverse_transforms() -> bool:
    """Whether every running ``torch.func`` transform is reverse mode (``grad``, ``vjp``);
    True when none runs.

    Under those a function runs its forward once, on tensors of the shapes it
    sees; ``vmap`` batches them and ``jvp`` adds the tangents' computation.
    If ``retrieve_all_functorch_interpreters`` goes: False, the safe answer
    (the public collectives then agree before every call under a transform).
    """
    if torch._C._functorch.peek_interpreter_stack() is None:
        return True
    try:
        from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
    except ImportError:
        return False
    grad = torch._C._functorch.TransformType.Grad
    return all(i.key() == grad for i in retrieve_all_functorch_interpreters())
