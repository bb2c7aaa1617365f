"""``grad`` and ``grad_and_value``: a loss's first-order gradient at ``.backward()``'s cost.

``torch.func.grad`` wraps every tensor its function touches in a
grad-tracking wrapper and dispatches each op through it; on a model of many
small ops that costs 1.4x what ``loss.backward()`` costs for the same
gradient. Where no other transform runs, the same pure gradient (a tree
returned, no ``.grad`` touched, nothing connected to the caller's graph)
comes from ``torch.autograd.grad`` on detached copies of the arguments'
leaves. Anywhere else (inside ``vmap``, ``jvp``, ``grad``, an open
forward-mode level, or while ``torch.compile`` traces) these are
``torch.func.grad`` and ``grad_and_value`` themselves: the same results and
the same refusals.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from fdp import _compat, _mode, _tree

__all__ = ["grad", "grad_and_value"]


def grad(
    func: Callable[..., Any], *, argnums: int | tuple[int, ...] = 0, has_aux: bool = False
) -> Callable[..., Any]:
    """``torch.func.grad``'s gradient, at ``torch.autograd.grad``'s cost outside other transforms.

    The gradient of ``func``'s scalar output with respect to the positional
    arguments ``argnums`` (a tree each), as a tree of the same structure: a
    zero where the output does not depend on a leaf, as ``torch.func.grad``
    gives. First order: the result carries no derivative of its own, as
    ``loss.backward()``'s ``.grad`` does not; for a derivative through it
    (second-order MAML, Hessian-vector products) nest it in a
    ``torch.func`` transform, where it is ``torch.func.grad``, or use that.

    Works with ``fdp.DistributedDataParallel`` and
    ``FullyShardedDataParallel`` called inside ``func``: the gradients
    returned are the reduced ones.

    Args:
        func: returns a scalar tensor, or ``(scalar, aux)`` with ``has_aux``.
        argnums: the positional argument(s) to differentiate.
        has_aux: whether ``func`` returns auxiliary outputs beside the loss.

    Returns:
        A function of ``func``'s arguments returning the gradient (a tuple of
        gradients for a tuple ``argnums``), and ``aux`` with ``has_aux``.

    Example:
        >>> import torch, fdp
        >>> params = {"w": torch.tensor([1.0, 2.0])}
        >>> fdp.grad(lambda p, x: (p["w"] * x).sum())(params, torch.tensor([3.0, 4.0]))
        {'w': tensor([3., 4.])}
    """
    value_and_grad = grad_and_value(func, argnums=argnums, has_aux=has_aux)

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        grads, value = value_and_grad(*args, **kwargs)
        return (grads, value[1]) if has_aux else grads

    return wrapper


def grad_and_value(
    func: Callable[..., Any], *, argnums: int | tuple[int, ...] = 0, has_aux: bool = False
) -> Callable[..., Any]:
    """:func:`grad` and the loss: ``(grads, loss)``, or ``(grads, (loss, aux))`` with ``has_aux``.

    ``torch.func.grad_and_value`` inside other transforms and while compiling.

    Example:
        >>> import torch, fdp
        >>> grads, loss = fdp.grad_and_value(lambda w: (w**2).sum())(torch.tensor([1.0, 2.0]))
        >>> grads, loss
        (tensor([2., 4.]), tensor(5.))
    """
    _check_options(argnums, has_aux)

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _eager_first_order(args, argnums):
            if torch.is_inference_mode_enabled():
                # Autograd records nothing there, even under enable_grad (the gradient
                # would be zeros; torch.func.grad's too before torch 2.13): left for the call.
                with torch.inference_mode(False):
                    return _autograd(func, argnums, has_aux, args, kwargs)
            return _autograd(func, argnums, has_aux, args, kwargs)
        return torch.func.grad_and_value(func, argnums, has_aux)(*args, **kwargs)

    return wrapper


def _check_options(argnums: Any, has_aux: Any) -> None:
    nums = argnums if isinstance(argnums, tuple) else (argnums,)
    if not nums or not all(isinstance(n, int) and not isinstance(n, bool) for n in nums):
        raise TypeError(
            f"fdp.grad: `argnums` expected an int or a non-empty tuple of ints; got {argnums!r}"
        )
    if not isinstance(has_aux, bool):
        raise TypeError(f"fdp.grad: `has_aux` expected a bool; got {has_aux!r}")


def _eager_first_order(args: tuple[Any, ...], argnums: int | tuple[int, ...]) -> bool:
    """Whether ``torch.autograd.grad`` gives what ``torch.func.grad`` would, here.

    Not while dynamo traces or a transform or forward-mode level is open, and
    only when every leaf to differentiate is a floating or complex tensor
    (``torch.func.grad`` says what is wrong with any other, and with argnums
    out of range).
    """
    if _mode.traced() or _mode.transform_running() or _compat.dual_level_active():
        return False
    if call_depth():  # inside another fdp.grad's function: a derivative through this one
        return False
    nums = argnums if isinstance(argnums, tuple) else (argnums,)
    if any(not -len(args) <= n < len(args) for n in nums) or len(set(nums)) < len(nums):
        return False
    for n in nums:
        for t in _tree.flatten(args[n])[0]:  # None too: torch.func.grad refuses it
            if not isinstance(t, torch.Tensor) or not (t.is_floating_point() or t.is_complex()):
                return False
    return True


def _autograd(
    func: Callable[..., Any],
    argnums: int | tuple[int, ...],
    has_aux: bool,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[Any, Any]:
    nums = argnums if isinstance(argnums, tuple) else (argnums,)
    call = list(args)
    inputs: list[torch.Tensor] = []
    specs = []
    for n in nums:
        leaves, spec = _tree.flatten(call[n])
        # An inference tensor (made under inference_mode) cannot require grad: a copy can.
        fresh = [(t.clone() if t.is_inference() else t.detach()).requires_grad_() for t in leaves]
        inputs += fresh
        specs.append((spec, fresh))
        call[n] = _tree.unflatten(spec, fresh)
    with torch.enable_grad(), returning_unused(inputs) as reduced:
        with calling():
            loss, aux = _split(func(*call, **kwargs), has_aux)
        found: tuple[torch.Tensor | None, ...] = (None,) * len(inputs)
        if loss.requires_grad:
            with _differentiating():
                found = torch.autograd.grad(loss, inputs, allow_unused=True)
    # A leaf the loss did not reach: DDP's average where this rank did not use
    # it (the other ranks' contributions), else torch.func.grad's zeros.
    grads = iter(
        g if g is not None else r[0] if r[0] is not None else torch.zeros_like(t)
        for g, r, t in zip(found, reduced, inputs, strict=True)
    )
    trees = tuple(_tree.unflatten(spec, [next(grads) for _ in fresh]) for spec, fresh in specs)
    value = loss.detach()
    if has_aux:  # first order: unlike torch.func.grad's, not connected to outer leaves
        aux = _tree.unflatten(*_detached(_tree.flatten(aux)))
    return (trees if isinstance(argnums, tuple) else trees[0]), ((value, aux) if has_aux else value)


def _detached(flat: tuple[list[Any], Any]) -> tuple[Any, list[Any]]:
    leaves, spec = flat
    return spec, [t.detach() if isinstance(t, torch.Tensor) else t for t in leaves]


def _split(out: Any, has_aux: bool) -> tuple[torch.Tensor, Any]:
    """The loss (and aux) of ``func``'s output, checked as ``torch.func.grad`` checks it."""
    aux = None
    if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise RuntimeError(
                "fdp.grad(f, has_aux=True)(*args): expected f(*args) to return a tuple "
                f"(loss, aux); got {_tree.describe(out)}"
            )
        out, aux = out
    if not isinstance(out, torch.Tensor) or out.dim() != 0:
        raise RuntimeError(
            "fdp.grad(f)(*args): expected f(*args) to return a scalar tensor (the loss); got "
            f"{_tree.describe(out)}"
        )
    return out, aux


# How many fdp.grad calls of this thread run their function now. An fdp.grad
# called inside one is differentiated by it (a gradient penalty, a nested
# derivative): it must be torch.func.grad, whose result carries that
# derivative, as it is inside a transform (the first-order path gave zeros).
_CALLING = threading.local()


def call_depth() -> int:
    """How many :func:`grad` calls of this thread are running their function now."""
    depth: int = getattr(_CALLING, "depth", 0)
    return depth


@contextmanager
def calling(depth: int = 1) -> Iterator[None]:
    """Counts ``depth`` more running :func:`grad` functions on this thread (replica threads too)."""
    _CALLING.depth = call_depth() + depth
    try:
        yield
    finally:
        _CALLING.depth -= depth


# While fdp.grad's torch.autograd.grad runs: id(leaf) -> [its reduced gradient].
# A leaf this rank did not use comes back None from autograd.grad, though the
# other ranks' average reached its bucket; torch.func.grad gives that average.
_ASKED: dict[int, list[torch.Tensor | None]] = {}
_ASKED_LOCK = threading.Lock()


@contextmanager
def returning_unused(leaves: Sequence[torch.Tensor]) -> Iterator[list[list[torch.Tensor | None]]]:
    """The reduced gradients of ``leaves`` this rank did not use, from DDP's finish.

    ``fdp/_ddp/_step.py`` hands them out. Scoped to one call: nothing is
    kept after it. The finish may run on another thread (a device's backward
    thread): hence ids under a lock, not a thread-local.
    """
    slots: list[list[torch.Tensor | None]] = [[None] for _ in leaves]
    with _ASKED_LOCK:
        _ASKED.update({id(t): slot for t, slot in zip(leaves, slots, strict=True)})
    try:
        yield slots
    finally:
        with _ASKED_LOCK:
            for t in leaves:
                _ASKED.pop(id(t), None)


def hand_unused(leaf: torch.Tensor, reduced: torch.Tensor) -> None:
    """Gives :func:`returning_unused` the reduced gradient of a leaf this rank did not use."""
    with _ASKED_LOCK:
        slot = _ASKED.get(id(leaf))
    if slot is not None:
        slot[0] = reduced


def asked() -> bool:
    return bool(_ASKED)


def returns(leaf: torch.Tensor) -> bool:
    """Whether ``leaf`` is one a running :func:`grad` call returns the gradient of.

    Its leaves are that call's own fresh tensors, registered while it runs
    (on any thread): a gradient kept for a later backward (``no_sync``)
    would be missing from what the call returns.
    """
    with _ASKED_LOCK:
        return id(leaf) in _ASKED


# How many of fdp.grad's own torch.autograd.grad calls run now (any thread).
_DIFFERENTIATING = [0]


@contextmanager
def _differentiating() -> Iterator[None]:
    with _ASKED_LOCK:
        _DIFFERENTIATING[0] += 1
    try:
        yield
    finally:
        with _ASKED_LOCK:
            _DIFFERENTIATING[0] -= 1


def differentiating() -> bool:
    """Whether the backward running is :func:`grad`'s own, as far as one can tell.

    Its inputs are fresh leaves, never a tensor made inside ``func`` (a
    ``ddp(params)`` alias): every alias node on the way runs. Read by DDP's
    first hook of a backward (``fdp/_ddp/_step.py``), where a backward that
    returns gradients is either this one or, while it runs in another
    thread, another.
    """
    return _DIFFERENTIATING[0] > 0
