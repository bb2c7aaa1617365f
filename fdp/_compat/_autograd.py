"""The autograd engine's internals: the node running, callbacks at the end of backward,
when a node runs, hooks without handles, ``Function.apply`` without its wrapper.

Part of :mod:`fdp._compat` (its docstring says how each function degrades).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch


def current_autograd_node() -> Any:
    """The autograd node the engine is running on this thread, or ``None``.

    Inside a final callback of a nested (reentrant) backward this is the outer
    backward's node that started it (``CheckpointFunctionBackward``); in the
    outermost backward's callbacks it is ``None``. If torch drops the API,
    returning ``None`` gives the behaviour fdp had before: finish at once.
    """
    current = getattr(torch._C, "_current_autograd_node", None)
    return None if current is None else current()


def queue_backward_callback(fn: Callable[[], None]) -> None:
    """Runs ``fn`` once the backward that is running now has finished.

    Call it only from inside a backward (a hook). torch has no public API
    for this; DDP's reducer uses the same engine call.
    """
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def leaf_destination(leaf: torch.Tensor) -> str:
    """Where the running backward puts ``leaf``'s gradient: "accumulated", "returned" or "none".

    Call from a hook on the path to ``leaf``. torch refuses
    ``_will_engine_execute_node`` for a leaf exactly when ``autograd.grad``
    returns its gradient ("returned"), and answers False when the engine
    does not run the leaf's accumulation ("none": ``backward(inputs=...)``
    without it, or ``autograd.grad`` that stops before it); the DDP tests
    cover each mode, so a change in torch shows there.
    """
    node = torch.autograd.graph.get_gradient_edge(leaf).node
    try:
        return "accumulated" if torch._C._will_engine_execute_node(node) else "none"
    except RuntimeError:
        return "returned"


# Just below AccumulateGrad's (UINT64_MAX), which must still run right after.
_EARLY = 2**64 - 2


def run_early(t: torch.Tensor) -> None:
    """Makes the engine run ``t``'s node as soon as it is ready, as it runs a leaf's.

    The engine runs the ready node with the highest sequence number first;
    a node made before the model's forward would otherwise wait for the end
    of backward. Without ``_set_sequence_nr`` results stay right and the
    reduction starts only when backward ends
    (``test_buckets_launch_while_backward_runs`` fails).
    """
    setter = getattr(t.grad_fn, "_set_sequence_nr", None)
    if setter is not None:
        setter(_EARLY)


def add_grad_hooks(tensors: Sequence[torch.Tensor], hooks: Iterable[Callable[..., Any]]) -> None:
    """``t.register_hook(hook)`` for each fresh non-leaf ``t``, without removable handles.

    What ``Tensor.register_hook`` does, less its checks and handle: 2 us
    less per hook, 0.4 ms for the 200 aliases of a 200-leaf ``ddp(params)``.
    Tensors made by one node (consecutive) look its registration up once.
    If the hook dict's registration moves, ``register_hook`` itself.
    """
    node, register = None, None
    for t, hook in zip(tensors, hooks, strict=True):
        if t.grad_fn is not node:
            node = t.grad_fn
            register = getattr(node, "_register_hook_dict", None)
        if register is None or t._backward_hooks is not None:
            t.register_hook(hook)  # type: ignore[no-untyped-call]
            continue
        # An OrderedDict, as torch makes: a user's register_hook on the
        # tensor takes a weak reference to it. Key -1: handle ids count from 0.
        t._backward_hooks = OrderedDict(((-1, hook),))
        register(t)


def early_alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor on ``t``'s memory whose node hands gradients to ``t`` early (:func:`run_early`).

    For use where a custom ``autograd.Function`` cannot run (functorch's
    keys disabled under a transform). Not an autograd view: a view's node is
    made anew (without its hooks) once its base is changed in place, as an
    optimizer step does. ``_unsafe_view`` aliases without view tracking
    (torch's own ``reshape`` uses it); its node reshapes the gradient, which
    a sparse one refuses.
    """
    alias: torch.Tensor = torch.ops.aten._unsafe_view.default(t, t.shape)
    run_early(alias)
    return alias


def plain_apply(fn: type[torch.autograd.Function]) -> Callable[..., Any]:
    """``fn.apply`` for use outside every ``torch.func`` transform, without its Python wrapper.

    The wrapper unwraps dead functorch tensors and dispatches transforms,
    which plain tensors outside a transform do not need; per call it costs
    more than the node itself (3.6 against 2.3 us measured). If the C base
    class moves, ``fn.apply`` gives the same result.
    """
    base = getattr(torch._C, "_FunctionBase", None)
    plain = getattr(super(torch.autograd.Function, fn), "apply", None) if base else None
    return fn.apply if plain is None else plain


def apply_unbound(fn: type[torch.autograd.Function], *args: Any) -> Any:
    """``fn.apply(*args)`` for a ``setup_context`` Function whose forward has no defaults.

    ``Function.apply`` binds the forward's signature with ``inspect`` on
    every call (tens of microseconds, the most of a small collective's
    Python); outside transforms this goes straight to the C apply, as
    ``Function.apply`` then does. Under a transform, ``fn.apply`` itself.
    """
    if torch._C._are_functorch_transforms_active():
        return fn.apply(*args)  # type: ignore[no-untyped-call]
    from torch._functorch.utils import unwrap_dead_wrappers

    base = getattr(super(torch.autograd.Function, fn), "apply", None)
    if base is None:
        return fn.apply(*args)  # type: ignore[no-untyped-call]
    return base(*unwrap_dead_wrappers(args))


def any_requires_grad(*lists: Sequence[torch.Tensor]) -> bool:
    """Whether a tensor in ``lists`` requires grad; lists of tensors only.

    torch's custom ops ask this in C++ (``torch._library.autograd``): 0.06 us
    a tensor against 0.14 us for a Python loop. That call skips a list that
    holds anything but tensors, so callers pass tensors only. Dynamo cannot
    trace it: a compiled caller, or a torch without it, takes the loop.
    """
    fast = getattr(torch._C, "_any_requires_grad", None)
    if fast is not None and not torch.compiler.is_compiling():
        return bool(fast(*(xs if type(xs) is list else list(xs) for xs in lists)))
    for xs in lists:
        for t in xs:
            if t.requires_grad:
                return True
    return False


def in_backward() -> bool:
    """Whether the autograd engine is running a backward on this thread."""
    return int(torch._C._current_graph_task_id()) != -1


def hook_handles_made() -> int | None:
    """How many hook handles torch has made so far (every ``register_*hook`` makes one).

    Unchanged across a call means no module or tensor hook was registered
    during it, in any thread. If the counter goes, None: the caller assumes
    a registration (the cost of a check, never a missed one).
    """
    from torch.utils.hooks import RemovableHandle

    made = getattr(RemovableHandle, "next_id", None)
    return made if isinstance(made, int) else None
