"""Private torch APIs fdp relies on, each behind a named function.

Every function says what it needs and what to do when torch changes: most
degrade to the safe answer (run replicas in a loop, never reuse a buffer)
rather than fail, and pick by capability (``getattr`` on the API), never by
version number. All are present in every release of the supported range,
torch 2.11 to 2.15, which ``nox -s torch_range`` runs the whole suite on. A
torch upgrade is checked here and by that session.
"""

from __future__ import annotations

import datetime
import functools
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar, cast

import torch

F = TypeVar("F", bound=Callable[..., Any])


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


# --- thread-local state that a worker thread does not inherit ---------------


def _dispatch_key_sets() -> tuple[str, str]:
    # If these go, return a value unlike a fresh thread's: replicas then loop.
    return (
        repr(torch._C._dispatch_tls_local_include_set()),
        repr(torch._C._dispatch_tls_local_exclude_set()),
    )


_fresh_sets: list[tuple[str, str]] = []


def _fresh_thread_key_sets() -> tuple[str, str]:
    """The dispatch key sets of a new thread (measured once, on a new thread)."""
    if not _fresh_sets:
        thread = threading.Thread(target=lambda: _fresh_sets.append(_dispatch_key_sets()))
        thread.start()
        thread.join()
    return _fresh_sets[0]


def default_device_modes() -> list[torch.device] | None:
    """The devices of the active ``torch.device`` contexts, outermost first.

    ``None`` when any other torch function mode is active: such modes (and
    every dispatch mode) hold state a worker thread cannot share safely.
    If ``_get_current_function_mode_stack`` goes, return ``None`` (loop).
    """
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._device import DeviceContext

    devices: list[torch.device] = []
    for mode in _get_current_function_mode_stack():  # type: ignore[no-untyped-call]
        if not isinstance(mode, DeviceContext):
            return None
        devices.append(mode.device)
    return devices


def uncarried_thread_state(*, carried: bool) -> str | None:
    """Why replicas cannot run on worker threads, or ``None`` if they can.

    A new thread starts with torch's defaults. fdp carries grad mode,
    inference mode, autocast, ``torch.device`` contexts and the CUDA device
    and stream; anything else thread-local (dispatch modes such as
    ``FlopCounterMode``, other function modes, saved-tensor hooks such as
    ``save_on_cpu``, forward-mode AD switched off, any dispatch key set a
    guard changed) would reach replica 0 only, so replicas then run in a loop
    on the calling thread. ``carried``: grad/inference/autocast state differs
    from a new thread's and will be carried (the key-set comparison, which
    those states change, is skipped then). If a probe below goes, answer
    with a reason (loop): wrong threads are worse than a slower loop.
    """
    if torch._C._len_torch_dispatch_stack() > 0:
        return "a torch dispatch mode is active"
    if default_device_modes() is None:
        return "a torch function mode is active"
    if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        return "saved-tensor hooks are active"
    if not carried:
        if not torch._C._is_fwd_grad_enabled():
            return "forward-mode AD is disabled"
        if _dispatch_key_sets() != _fresh_thread_key_sets():
            return "the dispatch key sets differ from a new thread's"
    return None


def storage_users(t: torch.Tensor) -> int:
    """How many tensors share ``t``'s storage (``t`` included); huge if unknown."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:  # private API gone: never reuse
        return 1 << 30
    # The temporary Storage object made by untyped_storage() holds one more.
    return int(use_count(t.untyped_storage()._cdata)) - 1


def foreach_copy_(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for all i in one call (one kernel per group on CUDA).

    ``torch._foreach_copy_`` is private (torch >= 2.1). If it disappears, the
    loop below is the exact fallback.
    """
    foreach = getattr(torch, "_foreach_copy_", None)
    if foreach is None:
        for d, s in zip(dst, src, strict=True):
            d.copy_(s)
    elif dst:
        foreach(dst, src)


# --- pytree nodes registered by users ----------------------------------------

Flatten = Any  # obj -> (children, context)
Unflatten = Any  # (context, children) -> obj


def registered_node(kind: type) -> tuple[Flatten, Unflatten] | None:
    """How a user-registered pytree node type flattens, whichever registry it is in.

    Looks in optree's registry under every namespace (optree has no public
    listing of namespaces: ``_NODETYPE_REGISTRY``, checked on optree 0.20) and
    in ``torch.utils._pytree``'s ``SUPPORTED_NODES``. Without them, a user's
    node type is not split and, holding tensors, is refused with an error.
    """
    import optree
    import torch.utils._pytree as torch_pytree

    registry: dict[Any, Any] = getattr(optree.registry, "_NODETYPE_REGISTRY", {})
    for key, entry in registry.items():
        if key is kind or (isinstance(key, tuple) and key[1] is kind):

            def flatten(obj: Any, entry: Any = entry) -> tuple[list[Any], Any]:
                out = entry.flatten_func(obj)
                return list(out[0]), out[1]

            return flatten, lambda context, children, e=entry: e.unflatten_func(context, children)
    node = torch_pytree.SUPPORTED_NODES.get(kind)
    if node is not None:
        return (
            lambda obj: (lambda out: (list(out[0]), out[1]))(node.flatten_fn(obj)),
            lambda context, children: node.unflatten_fn(children, context),
        )
    return None


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


def is_transformed(t: torch.Tensor) -> bool:
    """Whether ``t`` is a ``torch.func`` wrapper (grad tracking or batched) at some level.

    If ``is_functorch_wrapped_tensor`` goes, ``is_gradtrackingtensor`` or
    ``is_batchedtensor`` answer the same; fdp then picks its transform path.
    """
    functorch = torch._C._functorch
    return bool(functorch.is_functorch_wrapped_tensor(t))


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
        t._backward_hooks = {0: hook}
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


def profiling() -> bool:
    """Whether the autograd profiler records now (``record_function`` labels show)."""
    # If the flag goes, label always (the cost of a label, never a missing one).
    return bool(getattr(torch.autograd.profiler, "_is_profiler_enabled", True))


def in_backward() -> bool:
    """Whether the autograd engine is running a backward on this thread."""
    return int(torch._C._current_graph_task_id()) != -1


def is_compiled_module(obj: object) -> bool:
    """Whether ``obj`` is an ``nn.Module`` wrapped by ``torch.compile``.

    If ``OptimizedModule`` moves, this answers False: ``make_functional`` then
    sees the wrapper's ``_orig_mod`` as a submodule (its test fails).
    """
    optimized = getattr(getattr(torch, "_dynamo", None), "eval_frame", None)
    kind = getattr(optimized, "OptimizedModule", None)
    return kind is not None and isinstance(obj, kind)


def order_effects(op: Any) -> bool:
    """Give custom op ``op`` an ordered side effect; whether this torch could.

    AOTAutograd threads an effectful op on a token, and in a backward graph
    that token is a backward input: the partitioner keeps the op, and all
    that depends on it, in backward, in program order, even when its tensor
    inputs are constants. If ``register_effect`` or ``EffectType`` goes,
    this returns False and ``_ddp_traced`` ties every bucket to all gradients
    instead (correct, without overlap).
    """
    try:
        from torch._library.effects import EffectType

        op.register_effect(EffectType.ORDERED)
    except (ImportError, AttributeError):
        return False
    return True


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


def all_reduce_issue(t: torch.Tensor, op: str, group: Any) -> torch.Tensor:
    """Start a traceable all-reduce of ``t``; its result is valid after :func:`wait`.

    ``funcol.all_reduce`` waits at the result's first use, and while tracing
    it records the wait right after the collective: nothing could then
    depend on the collective having been *issued* without depending on its
    end. If the ``_c10d_functional`` ops go: the public ``funcol.all_reduce``
    (issue and wait together), with :func:`wait` a no-op on it.
    """
    import torch.distributed._functional_collectives as funcol

    ops = getattr(torch.ops, "_c10d_functional", None)
    if ops is None or not hasattr(ops, "all_reduce"):
        summed: torch.Tensor = funcol.all_reduce(t, op, group)
        return summed
    out: torch.Tensor = ops.all_reduce(t, op, funcol._resolve_group_name(group))
    return out


def wait(t: torch.Tensor) -> torch.Tensor:
    """The finished result of :func:`all_reduce_issue`."""
    ops = getattr(torch.ops, "_c10d_functional", None)
    if ops is None or not hasattr(ops, "wait_tensor"):
        return t
    out: torch.Tensor = ops.wait_tensor(t)
    return out


def group_timeout(group: Any) -> datetime.timedelta | None:
    """The collective timeout of ``group`` (the default group for None), or None if unknown.

    A subgroup made with ``dist.new_group`` gets torch's default timeout
    (30 minutes for gloo), not its parent's. If backends stop exposing
    ``options._timeout``: None, and subgroups wait torch's default.
    """
    import torch.distributed as dist

    pg: Any = group if group is not None else dist.group.WORLD
    try:
        for device in pg._device_types:
            timeout = pg._get_backend(device).options._timeout
            return timeout if isinstance(timeout, datetime.timedelta) else None
    except (AttributeError, RuntimeError):
        return None
    return None


def reduce_scatter_single(out: torch.Tensor, flat: torch.Tensor, group: Any) -> Any:
    """Starts a sum reduce-scatter of ``flat`` into ``out`` (this rank's part); returns the work.

    torch 2.13 renamed ``reduce_scatter_tensor`` to ``reduce_scatter_single``
    and deprecates the old name; before 2.13 only the old one exists.
    """
    fn = _renamed("reduce_scatter_single", "reduce_scatter_tensor")
    return fn(out, flat, group=group, async_op=True)


def all_gather_single(out: torch.Tensor, part: torch.Tensor, group: Any) -> Any:
    """Starts an all-gather of every rank's ``part`` into ``out``; returns the work.

    A plain real tensor goes straight to the process group's
    ``_allgather_base``, which ``all_gather_into_tensor`` calls after checks
    that a plain tensor passes (a few microseconds of Python: the small
    public all-gather's cost is its latency). Otherwise, and if
    ``_allgather_base`` or ``_get_default_group`` go, the public call: the
    2.13 name of ``all_gather_into_tensor`` (deprecated there).
    """
    if type(part) is torch.Tensor and type(out) is torch.Tensor and not part.is_complex():
        base = _default_group() if group is None else group
        direct = getattr(base, "_allgather_base", None)
        if direct is not None:
            return direct(out, part)
    fn = _renamed("all_gather_single", "all_gather_into_tensor")
    return fn(out, part, group=group, async_op=True)


def _default_group() -> Any:
    import torch.distributed as dist

    c10d = dist.distributed_c10d
    get = getattr(c10d, "_get_default_group", None)
    return get() if get is not None else None


@functools.cache
def _renamed(new: str, old: str) -> Any:
    """``torch.distributed``'s function ``new``, or ``old`` before it (looked up once:
    the public collectives' per-call cost)."""
    import torch.distributed as dist

    return getattr(dist, new, None) or getattr(dist, old)


def sharded_tensor(
    local: list[tuple[torch.Tensor, int]],
    placements: list[tuple[int, int, int]],
    numel: int,
    dtype: torch.dtype,
    group: Any,
) -> torch.Tensor:
    """A 1-D ``ShardedTensor`` of ``numel`` elements, for ``torch.distributed.checkpoint``.

    ``placements`` lists every rank's pieces as ``(rank in group, start, length)``;
    ``local`` this rank's tensors with their starts. DCP writes and reads a
    ShardedTensor's pieces on the ranks that hold them and reshards on load
    (any pieces on any world size), which DTensor's even chunks cannot
    describe. Built from global metadata known on every rank, so no
    collective. ShardedTensor is torch's older sharded type (experimental,
    kept for DCP); if it goes, a DCP planner with the same chunk metadata.
    """
    import torch.distributed as dist
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor.api import ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import (
        ShardedTensorMetadata,
        TensorProperties,
    )
    from torch.distributed._shard.sharded_tensor.shard import Shard

    device = local[0][0].device if local else torch.device("cpu")
    # Placements name global ranks, whatever the group.
    metas = [
        ShardMetadata([start], [length], f"rank:{_global(group, rank)}/{device}")
        for rank, start, length in placements
    ]
    me = _global(group, dist.get_rank(group))
    shards = [
        Shard(t, ShardMetadata([start], [t.numel()], f"rank:{me}/{t.device}")) for t, start in local
    ]
    meta = ShardedTensorMetadata(metas, torch.Size([numel]), TensorProperties(dtype=dtype))
    st: torch.Tensor = ShardedTensor._init_from_local_shards_and_global_metadata(
        shards, meta, process_group=group
    )
    return st


def _global(group: Any, rank: int) -> int:
    import torch.distributed as dist

    return rank if group is None else dist.get_global_rank(group, rank)


def storage_free(
    cls: type[torch.Tensor], like: torch.Tensor, *, requires_grad: bool, device: Any = None
) -> torch.Tensor:
    """A ``cls`` instance with ``like``'s shape and dtype, on ``device`` (default ``like``'s),
    and no storage at all.

    A wrapper subclass (its ``__torch_dispatch__`` decides what any op does):
    what stands in for a fully sharded parameter whose unit is not gathered.
    """
    make: Any = torch.Tensor._make_wrapper_subclass
    out: torch.Tensor = make(
        cls,
        like.shape,
        dtype=like.dtype,
        device=like.device if device is None else device,
        requires_grad=requires_grad,
    )
    return out
