"""Dynamo and inductor: disabling a function, a function traced whole or run eagerly,
compiled modules, ordered effects, the scheduler's overlap passes, checkpointing's
recompute tags.

Part of :mod:`fdp._compat` (its docstring says how each function degrades).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

F = TypeVar("F", bound=Callable[..., Any])


def plain_checkpoint_recomputes() -> bool:
    """Whether compiled plain checkpointing tags its ops "prefer recompute" (torch 2.13;
    2.11 needs a selective-checkpoint policy, for which 2.13 logs a warning)."""
    from torch._higher_order_ops import wrap

    return hasattr(wrap, "_always_prefer_recompute")


def compiler_disable(fn: F, *, reason: str) -> F:
    """``torch.compiler.disable(fn, reason=reason)``: dynamo runs ``fn`` eagerly.

    Made at the first call, not here: ``torch.compiler.disable`` imports
    ``torch._dynamo`` (seconds), and fdp's entry points are decorated at
    import. Until then the wrapper carries the marks ``torch.compiler.disable``
    puts on its own (``_torchdynamo_disable`` and its message), which is
    what dynamo reads when it meets a call: it never inlines the wrapper
    (a graph break, or ``fullgraph=True``'s error with ``reason``), and
    the wrapper runs eagerly. ``reason`` is new in torch 2.7.
    """
    made: list[Callable[..., Any]] = []

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if not made:
            try:
                disabled = torch.compiler.disable(fn, reason=reason)  # type: ignore[no-untyped-call]
            except TypeError:
                disabled = torch.compiler.disable(fn)  # type: ignore[no-untyped-call]
            made.append(disabled)
        return made[0](*args, **kwargs)

    call._torchdynamo_disable = True  # type: ignore[attr-defined]
    call._torchdynamo_disable_msg = reason  # type: ignore[attr-defined]
    return cast(F, call)


def is_compiled_module(obj: object) -> bool:
    """Whether ``obj`` is an ``nn.Module`` wrapped by ``torch.compile``.

    If ``OptimizedModule`` moves, this answers False: ``make_functional`` then
    sees the wrapper's ``_orig_mod`` as a submodule (its test fails).
    """
    optimized = getattr(getattr(torch, "_dynamo", None), "eval_frame", None)
    kind = getattr(optimized, "OptimizedModule", None)
    return kind is not None and isinstance(obj, kind)


def graph_call(fn: Callable[..., Any]) -> Callable[[], bool]:
    """The call that makes dynamo write each call of ``fn`` into its graph as one, untraced.

    ``torch.compiler.allow_in_graph(fn)`` imports dynamo (seconds), which
    ``import fdp`` must not, so it is made by the function returned, to be
    called from code dynamo traces just before ``fn``: it carries the mark
    ``torch.compiler.assume_constant_result`` sets, so dynamo runs it as
    Python while it traces (dynamo is imported by then) and keeps its
    answer as a constant. If torch stops reading the mark,
    dynamo traces that function instead and stops at the registration in
    it (a graph break, an error under ``fullgraph=True``):
    ``tests/test_ddp_traced.py`` fails, and this should then register
    ``fn`` where dynamo is first imported.
    """
    allowed: list[bool] = []

    def allow() -> bool:
        if not allowed:
            torch.compiler.allow_in_graph(fn)  # type: ignore[no-untyped-call]
            allowed.append(True)
        return True

    return traced_constant(allow)


def traced_constant(fn: F) -> F:
    """``fn``, which dynamo then runs as Python while it traces, its answer a constant.

    The mark ``torch.compiler.assume_constant_result`` sets, set here
    without importing dynamo. ``fn``'s arguments must be constants while
    traced (strings, tuples of them) and it answers plain data; nothing
    guards the answer, so it must follow from what the graph's own guards
    check.
    """
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


def traced_whole(eager: F, traced: F) -> F:
    """A function for traced code to call: dynamo traces ``traced`` in its place, whole.

    Where dynamo cannot trace all of ``traced`` (a graph break somewhere
    in what it calls), it stops at this call and runs ``eager`` there
    instead, as Python: ``eager``'s own frame is not compiled, the frames
    it calls are (``torch.compiler.disable(recursive=False)``). Eagerly the
    function is ``eager``. Both must take the same arguments.

    ``torch.compiler.substitute_in_graph`` registers ``traced`` the first
    time dynamo traces a call (dynamo runs the registration as Python, as
    :func:`graph_call`'s): ``import fdp`` does not import dynamo. If the
    mark stops working, dynamo traces the registration and stops there
    (a graph break, an error under ``fullgraph=True``):
    ``tests/test_functional_compiled.py`` fails.
    """
    made: list[Callable[..., Any]] = []

    def register() -> bool:
        if not made:
            untraced = torch.compiler.disable(eager, recursive=False)  # type: ignore[no-untyped-call]
            torch.compiler.substitute_in_graph(untraced)(traced)
            made.append(untraced)
        return True

    registered = traced_constant(register)

    @functools.wraps(eager)
    def call(*args: Any, **kwargs: Any) -> Any:
        # Dynamo's question, not is_compiling(): non-strict torch.export runs
        # Python as it is, where the untraced form refuses to run.
        if torch.compiler.is_dynamo_compiling() and registered():
            return made[0](*args, **kwargs)
        return eager(*args, **kwargs)

    return cast(F, call)


def order_effects(op: Any) -> bool:
    """Give custom op ``op`` an ordered side effect; whether this torch could.

    AOTAutograd threads an effectful op on a token, and in a backward graph
    that token is a backward input: the partitioner keeps the op, and all
    that depends on it, in backward, in program order, even when its tensor
    inputs are constants. DDP's compiled reduction needs it only where no
    gradient reaching it is real (fdp/_ddp/_traced.py); if
    ``register_effect`` or ``EffectType`` goes, this returns False and that
    rare case falls back to the op without an effect.
    """
    try:
        from torch._library.effects import EffectType

        op.register_effect(EffectType.ORDERED)
    except (ImportError, AttributeError):
        return False
    return True


def inductor_spmd_check_off() -> dict[str, bool]:
    """The option that turns off inductor's check that every rank compiled one graph.

    torch 2.12 runs it by default whenever comm/compute reordering is on: an
    ``all_gather_object`` of a hash of each graph while compiling. Ranks
    that use different leaves compile different graphs, and there the check
    hung the ranks (tests/test_ddp_traced.py, the first bucket unused on a
    rank). Empty where the check is off by default (torch 2.13 on) or absent.
    """
    from torch._inductor import config

    if getattr(getattr(config, "aten_distributed_optimizations", None), "spmd_check", False):
        return {"aten_distributed_optimizations.spmd_check": False}
    return {}


def inductor_overlap_passes() -> list[str]:
    """Inductor's scheduler passes that move collectives early and their waits late.

    Named in ``torch._inductor.comms``; the peak-memory-preserving ones
    (torch >= 2.8) are inductor's recommendation, the older pair is the
    fallback. An empty list (no pass known) leaves inductor's order.
    """
    from torch._inductor import comms

    preferred = ["reorder_communication_preserving_peak_memory", "sink_waits_iterative"]
    if all(hasattr(comms, name) for name in preferred):
        return [*preferred, preferred[0]]
    return [name for name in ("sink_waits", "raise_comms") if hasattr(comms, name)]
