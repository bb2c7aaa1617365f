"""Eager or traced: where fdp asks whether dynamo is tracing.

Most of fdp runs the same code eagerly and under ``torch.compile``. Where
the two must differ (hooks, threads and context variables dynamo cannot
trace, values that cannot be read while tracing, a ``torch.func``
transform whose custom backward compiling would drop), the module writes
both forms side by side: the eager one is a ``def`` decorated with
:func:`traced_as`, naming its traced twin, and one of them runs at each call. The
question itself is asked here and in the few modules that docs/design.md
lists: how trees are flattened (``_tree``), how a collective is issued
(``_comm/_raw``) and the compiled fallback (``_comm/_transforms``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar, cast

import torch

from fdp import _compat

F = TypeVar("F", bound=Callable[..., Any])


def traced() -> bool:
    """Whether dynamo is tracing the calling code (``torch.compile``)."""
    return torch.compiler.is_compiling()


def by_mode(eager: F, traced_form: F) -> F:
    """One callable: ``traced_form`` while dynamo traces, ``eager`` otherwise.

    Dynamo answers the question while it traces, so a compiled graph holds
    only the traced form; eagerly it costs one call.

    Example:
        >>> double = by_mode(lambda x: 2 * x, lambda x: x + x)
        >>> double(3)
        6
    """

    @functools.wraps(eager)
    def call(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return traced_form(*args, **kwargs)
        return eager(*args, **kwargs)

    return cast(F, call)


def traced_as(traced_form: F) -> Callable[[F], F]:
    """Decorates a function's eager form with its traced form: one callable, as :func:`by_mode`.

    The one naming scheme: the decorated ``def`` is the name callers use
    (go-to-definition lands on its eager code), its twin is ``_<name>_traced``,
    defined just above it.

    Example:
        >>> def _double_traced(x):
        ...     return x + x
        >>> @traced_as(_double_traced)
        ... def double(x):
        ...     return 2 * x
        >>> double(3)
        6
    """

    def decorate(eager: F) -> F:
        return by_mode(eager, traced_form)

    return decorate


def transform_running() -> bool:
    """Whether a ``torch.func`` transform (grad, vjp, jvp, vmap, ...) runs on this thread."""
    return _compat.functorch_active()


def dual(tensors: Iterable[Any]) -> bool:
    """Whether a tensor among ``tensors`` carries a forward-mode tangent (a dual tensor)."""
    if not _compat.dual_level_active():  # no tangents outside a level: skip the leaves
        return False
    # Loops, not any(genexpr): dynamo 2.15 fails on a generator inside a traced Function.
    for t in tensors:  # noqa: SIM110
        if isinstance(t, torch.Tensor) and _compat.has_tangent(t):
            return True
    return False


def shapes_say_the_payload() -> bool:
    """Whether a collective's payload is what its arguments' shapes say, on this thread.

    Not under ``vmap`` (it batches the payload) nor under ``jvp`` or in an
    open forward-mode level (a tangent adds a collective of its own): there
    a rank whose arguments changed cannot send a stand-in that pairs with
    the other ranks' collectives, so the public collectives agree first.
    """
    return not _compat.dual_level_active() and _compat.only_reverse_transforms()


def wrapped(tensors: Iterable[Any]) -> bool:
    """Whether a tensor among ``tensors`` is a ``torch.func`` wrapper (grad tracking, batched)."""
    for t in tensors:  # noqa: SIM110
        if isinstance(t, torch.Tensor) and _compat.is_transformed(t):
            return True
    return False


def transformed(tensors: Iterable[Any] = ()) -> bool:
    """The second question: is a ``torch.func`` transform or a dual tensor involved?

    True while a transform runs, or when a tensor among ``tensors`` carries
    a forward-mode tangent. Where it is, a collective must carry its rules
    and fdp's hooks and threads step aside.
    """
    return transform_running() or dual(tensors)


def needs_rules(tensors: Sequence[Any]) -> bool:
    """Whether a collective over ``tensors`` must carry derivative or batching rules.

    :func:`transformed`, or grad mode is on and a tensor requires grad.
    """
    if transformed(tensors):
        return True
    if torch.is_grad_enabled():
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                return True
    return False


def compiling_a_transform() -> bool:
    """Whether dynamo is tracing inside a ``torch.func`` transform.

    There torch 2.11 to 2.14 drop a custom ``autograd.Function``'s backward
    (pytorch/pytorch#193279): callers that rely on one refuse
    (:func:`refuse_compiled_transform`) or run eagerly. ``nox -s torch_range``
    runs their tests on each release.
    """
    return torch.compiler.is_compiling() and transform_running()


def refuse_compiled_transform(
    call: str, doing: str, *, lost: str, inputs: Sequence[torch.Tensor] | None = None
) -> None:
    """Raises where compiling a transform would silently lose ``lost`` (see above).

    ``doing`` names what ``call`` was doing; the message says what to do
    instead. ``inputs``: the tensors the Function is applied to, when known;
    where torch keeps the Function's backward for them
    (:func:`fdp._compat.traced_transform_keeps_backward`) nothing is refused.
    """
    if not compiling_a_transform():
        return
    if inputs is not None and _compat.traced_transform_keeps_backward(inputs):
        return
    raise NotImplementedError(
        f"{call}: {doing} inside torch.compile of a torch.func transform would lose {lost} "
        "(torch drops a custom autograd.Function's backward there, pytorch/pytorch#193279); "
        "compile the loss and call .backward() or torch.autograd.grad on its result "
        "instead, or run the transform without torch.compile"
    )
