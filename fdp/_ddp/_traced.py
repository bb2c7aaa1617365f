"""``DistributedDataParallel`` inside ``torch.compile``: the reduction as part of the graph.

Eager DDP hooks every leaf and reduces from the hooks (``_step.py``). A
compiled function cannot register hooks, and hooks would fire only after the
compiled backward has finished. So while dynamo traces ``ddp(params)``, the
leaves go through one identity :class:`_Average` Function instead. Its
backward packs the gradients into the same buckets as eager DDP (same
layout, same order), all-reduces each bucket with a functional collective
and hands out views of the reduced buckets. AOTAutograd inlines that
backward into the compiled backward graph, where each bucket's pack and
all-reduce depends only on its own gradients (and keeps bucket order, see
:func:`_zero_after`). In graph order they still come after the last
gradient, because autograd runs this node last; inductor's comm/compute
reordering moves each all-reduce up to where its gradients exist and each
wait down to where its result is needed, when the user asks for it
(``torch.compile(..., options=fdp.overlap_options())``; ``tests/test_ddp_traced.py``
checks the order in the generated code). Dynamo does not trace the Function:
it writes one call of :func:`_reduce` into its graph (:class:`Plan` says
why and how), and AOTAutograd traces the Function as plain Python.

Why one Function over every leaf, not one per bucket: a bucket none of whose
leaves this rank used would not run its backward, while the other ranks issue
its all-reduce (a hang). One node runs whenever any leaf is used, and its
backward sees zeros for the unused leaves, so every rank issues the same
collectives in the same order. The price, documented: a leaf that no rank
used gets a zero gradient instead of ``None`` (which leaves were used is data
the compiled graph cannot branch on).

Under ``no_sync()`` nothing is reduced and ``.grad`` accumulates locally, as
in eager; the next synchronised step passes the accumulated ``.grad`` into
the Function, reduces ``new + accumulated`` and returns ``reduced -
accumulated`` for autograd to add back, so ``.grad`` ends up the average of
the total (DDP's semantics).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from fdp import _bucket, _compat, _mode
from fdp._comm import _comm_hooks, _groups

F = TypeVar("F", bound=Callable[..., Any])


# Hooks that have a traced equivalent: the dtype they reduce in (None: the
# bucket's own). Any other hook cannot run inside a compiled graph.
_TRACEABLE: dict[Callable[..., Any], torch.dtype | None] = {
    _comm_hooks.allreduce_hook: None,
    _comm_hooks.fp16_compress_hook: torch.float16,
    _comm_hooks.bf16_compress_hook: torch.bfloat16,
    default_hooks.allreduce_hook: None,
    default_hooks.fp16_compress_hook: torch.float16,
    default_hooks.bf16_compress_hook: torch.bfloat16,
}


class TracedReduction(NamedTuple):
    """How a DDP's comm hook reduces inside compiled code.

    ``dtype``: the dtype buckets travel in (None: their own); ``refusal``: why
    the hook cannot run there (None: it can), raised when compiled code needs it.
    """

    dtype: torch.dtype | None
    refusal: str | None = None


def traced_hook(
    hook: Callable[..., Any] | None, state: Any, group: ProcessGroup | None
) -> TracedReduction:
    """How ``hook(state, ...)`` reduces while compiling.

    Decided eagerly, at registration: dynamo reads a function's name wrongly.
    """
    if hook is None:
        return TracedReduction(None)
    if hook in _TRACEABLE and (state is None or state is group):
        return TracedReduction(_TRACEABLE[hook])
    name = getattr(hook, "__qualname__", None) or repr(hook)
    refusal = (
        f"fdp.DistributedDataParallel: `comm_hook` {name} cannot run inside torch.compile: "
        "a hook returns a torch.futures.Future, which dynamo cannot trace. Inside compiled "
        "code fdp reduces with the default hook, or with fdp's or torch's allreduce_hook, "
        "fp16_compress_hook or bf16_compress_hook whose state is the DDP's process group "
        "(or None). To keep this hook, call ddp(params) outside the compiled function and "
        "pass its result in: its hooks then run eagerly after the compiled backward"
    )
    return TracedReduction(None, refusal=refusal)


@torch.library.custom_op("fdp::zero_after", mutates_args=())
def _zero_after(deps: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """A scalar zero on ``device`` that a graph computes only after every tensor of ``deps``.

    Added to each bucket before its all-reduce, it pins the collectives to
    the backward graph, in bucket order, on every rank. Without it, a bucket
    this rank did not use holds only zeros made from nothing, and the
    min-cut partitioner (aot_eager, inductor) moves its all-reduce into the
    forward graph: issued in forward here and in backward elsewhere, the
    collectives pair up wrongly (measured: zero gradients, or a hang).

    This op has no effect: its ``deps`` always hold a real gradient
    (:func:`_anchors`), which only backward computes, and inductor's
    on-disk cache keeps a backward graph that holds it. An opaque op,
    because inductor's joint-graph constant folding saw through every
    arithmetic zero tried; it reads nothing, so it is NaN-safe.
    """
    return torch.zeros((), device=device)


@torch.library.custom_op("fdp::zero_after_ordered", mutates_args=())
def _zero_after_ordered(deps: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """:func:`_zero_after` with an ordered effect (:func:`_compat.order_effects`).

    Its token, a backward input, keeps it in backward whatever ``deps``
    are: the fallback where no gradient reaching the reduction is real
    (every one of them None), so that nothing else can pin the buckets.
    torch 2.13's FX graph cache does not keep a graph with an effect token
    (``with_effects``): such a backward is compiled anew in every process.
    """
    return torch.zeros((), device=device)


# Whether this torch can order effects (else, with no real gradient, a plain zero).
_ORDERED = _compat.order_effects(_zero_after_ordered)


@_zero_after.register_fake
def _(deps: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    return torch.empty((), device=device)


@_zero_after_ordered.register_fake
def _(deps: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    return torch.empty((), device=device)


# What _Average's backward reduces with: the world size, the dtype buckets
# travel in (None: their own), the group, and whether each bucket's
# all-reduce may go as soon as its own gradients exist (else after the last).
How = tuple[int, torch.dtype | None, ProcessGroup, bool]


def _pack(
    bucket: _bucket.Bucket,
    grads: Sequence[torch.Tensor | None],
    anchor: torch.Tensor,
    how: How,
) -> torch.Tensor:
    """The bucket's flat buffer, scaled for the average, functionally: one ``cat``.

    :meth:`fdp._bucket.Bucket.pieces` converts (``hook``'s dtype) and
    scales each piece, which inductor fuses into the copy that packs the
    bucket, in the bucket's one element order (each leaf's memory order:
    docs/performance.md has what that costs against logical order).
    ``anchor`` (see :func:`_zero_after`) is added to the first piece,
    fused the same way.
    """
    world, dtype = how[0], how[1]
    dtype = bucket.dtype if dtype is None else dtype
    pieces = bucket.pieces(grads, dtype=dtype, scale=1.0 / world)
    pieces[0] = pieces[0] + anchor.to(dtype)
    return torch.cat(pieces)


class _Average(torch.autograd.Function):
    """Identity forward; backward averages the gradients across ranks, bucket by bucket.


    Inputs: the reduction's constants, then the ``n`` leaves, then the
    ``.grad`` accumulated under ``no_sync`` for the leaves in ``folded``.
    """

    @staticmethod
    def forward(
        buckets: tuple[tuple[_bucket.Bucket, tuple[int, ...]], ...],
        folded: tuple[int, ...],
        how: How,
        n: int,
        *tensors: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        # Not tensors[:n]: under a compiled jvp dynamo traces n as a symbol.
        # The inputs themselves, not t.view_as(t): autograd hands out a view
        # of each either way, and dynamo traces this form faster (400 leaves:
        # 29 s against 43 s, benchmarks/bench_trace_time.py).
        return tuple(tensors[: len(tensors) - len(folded)])

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        buckets, folded, how, n, *tensors = inputs
        ctx.buckets, ctx.folded, ctx.how, ctx.n = buckets, folded, how, n
        ctx.save_for_backward(*tensors[n:])
        # None for a leaf that got no gradient: which gradients are real is
        # what pins each bucket's all-reduce to backward (_anchors).
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        old = dict(zip(ctx.folded, ctx.saved_tensors, strict=True))
        totals = [_plus(g, old.get(s)) for s, g in enumerate(grads)]
        live = [(b, slots) for b, slots in ctx.buckets if any(s >= 0 for s in slots)]
        zero_after, waits_for = _anchors(live, grads, ctx.how[3])
        issued: list[torch.Tensor] = []
        for (bucket, slots), deps in zip(live, waits_for, strict=True):
            # Issued after the previous bucket was issued, not after it ended:
            # compilers keep data order, not the order collectives were
            # traced in (measured: inductor's overlap passes issued the last
            # bucket first), and waiting here would stall a GPU's compute
            # stream on every bucket. All waits follow all issues, so that a
            # compiler is free to place each wait as late as it likes.
            anchor = zero_after(deps + issued[-1:], bucket.device)
            # A slot of -1 is a leaf that needs no gradient: it reduces zeros.
            flat = _pack(bucket, [totals[s] if s >= 0 else None for s in slots], anchor, ctx.how)
            issued.append(_compat.all_reduce_issue(flat, "sum", ctx.how[2]))
        out: list[torch.Tensor | None] = [None] * ctx.n
        for (bucket, slots), pending in zip(live, issued, strict=True):
            reduced = _compat.wait(pending).to(bucket.dtype)
            for s, view in zip(slots, bucket.unpack(reduced), strict=True):
                if s >= 0:
                    out[s] = view - old[s] if s in old else view
        return (None, None, None, None, *out, *(None for _ in ctx.folded))


def _plus(grad: torch.Tensor | None, accumulated: torch.Tensor | None) -> torch.Tensor | None:
    """A leaf's gradient plus the ``.grad`` accumulated under ``no_sync`` (either may be None)."""
    if grad is None or accumulated is None:
        return accumulated if grad is None else grad
    return grad + accumulated


def _anchors(
    live: Sequence[tuple[_bucket.Bucket, tuple[int, ...]]],
    grads: Sequence[torch.Tensor | None],
    overlap: bool,
) -> tuple[Any, list[list[torch.Tensor]]]:
    """The op that makes each bucket's zero (:func:`_zero_after`), and what each waits for.

    A bucket's all-reduce must stay in backward on every rank, also where
    this rank gave none of its leaves a gradient (its pieces are then zeros
    made from nothing, which a partitioner may hoist into the forward
    graph). A real gradient pins it. With ``overlap`` a bucket waits for its
    own real gradients and the previous bucket's issue, a chain whose first
    bucket, if it got no gradient here, waits for the first real ones;
    without, every bucket waits for every real gradient. Only where no
    gradient is real does an ordered effect hold the buckets in backward
    (:func:`_zero_after_ordered`, whose token inductor's cache refuses).
    """
    real = [[g for s in slots if s >= 0 and (g := grads[s]) is not None] for _, slots in live]
    first = next((r for r in real if r), [])
    if not first:
        return (_zero_after_ordered if _ORDERED else _zero_after), [[] for _ in live]
    if not overlap:
        every = [g for r in real for g in r]
        return _zero_after, [every for _ in live]
    return _zero_after, [real[0] or first, *real[1:]]


UNDER_TRANSFORM = (
    "fdp.DistributedDataParallel: ddp(params) cannot be compiled inside this torch.func "
    "transform: torch 2.13 drops a custom autograd.Function's backward when it compiles a "
    "transform of the parameters, a nest of transforms, a vmap, or a buffer sync under a "
    "transform (pytorch/pytorch#193279), so the gradients would not be reduced. Compiled, "
    "ddp(params) works inside one jvp over other inputs (the MeanFlow pattern). Without "
    "fullgraph=True, fdp runs ddp(params) and the transform eagerly here (a graph break) and "
    "the result is right; or compile the loss and call .backward() on its result"
)
IN_JOIN = (
    "fdp.DistributedDataParallel.join: ddp(params) is not compiled in a join block (the "
    "joined ranks' mirrored step is eager). Without fullgraph=True, fdp runs it eagerly here "
    "(a graph break); or call ddp(params) outside the compiled function"
)


def eager_only(leaves: Sequence[Any], *, buffers: bool) -> bool:
    """Whether ``ddp(params)``, being traced, must run eagerly to be right.

    Compiling a transform that differentiates the parameters drops a custom
    ``autograd.Function``'s backward (pytorch/pytorch#193279): the reduction
    would be lost. One ``jvp`` over *other* inputs (the MeanFlow pattern)
    compiles right: the reduction runs in the ordinary ``.backward()``. A
    compiled ``vmap`` fails in dynamo on any ``autograd.Function`` (torch
    2.13), and a buffer sync would mutate a captured tensor.
    """
    if not _mode.transform_running():  # called while dynamo traces
        return False
    return buffers or not _compat.one_jvp() or _mode.dual(leaves)


class Plan:
    """What one DDP's compiled reduction needs, registered under a number a graph can hold.

    While dynamo traces ``ddp(params)``, the reduction goes into the graph as
    one call of :func:`_reduce` that dynamo does not trace (``allow_in_graph``):
    AOTAutograd traces its ``autograd.Function`` later, as plain Python. Dynamo
    traces an ``autograd.Function`` line by line, with a helper that compares
    each output with each input, quadratic in the leaves (docs/compile.md).
    A graph holds constants only, so it names this plan by ``key``; the DDP
    holds the plan, and the registry holds it weakly.
    """

    def __init__(
        self,
        layout: _bucket.Layout,
        *,
        ties: dict[int, int],
        group: ProcessGroup | None,
        overlap: bool,
        hook: TracedReduction,
    ) -> None:
        self.layout, self.ties, self.group, self.overlap = layout, ties, group, overlap
        self.hook = hook  # replaced by register_comm_hook, before the first call
        self.where = tuple(sorted(layout.where))
        # A string: dynamo makes an int it saw change between two compiles of one
        # function (two DDPs through one factory's loss) a symbol, which the
        # registry cannot look up; a string it keeps a constant.
        self.key = f"fdp-ddp-plan-{next(_KEYS)}"
        _PLANS[self.key] = self

    def how(self) -> How:
        world = dist.get_world_size(self.group)
        return (world, self.hook.dtype, _groups.resolve(self.group), self.overlap)


_KEYS = itertools.count()
_PLANS: weakref.WeakValueDictionary[str, Plan] = weakref.WeakValueDictionary()


def _reduce(key: tuple[str, tuple[int, ...], tuple[int, ...]], *tensors: torch.Tensor) -> Any:
    """:class:`_Average` of ``tensors`` for the plan named ``key[0]``.

    ``key[1]`` gives each leaf its tensor's input slot (-1: none, or a tied
    leaf's second name); ``key[2]`` the slots whose accumulated ``.grad``
    follows the tensors.
    """
    name, slots, folded = key
    plan = _PLANS[name]
    buckets = tuple((b, tuple(slots[i] for i in b.indices)) for b in plan.layout.buckets)
    n = len(tensors) - len(folded)
    return _Average.apply(buckets, folded, plan.how(), n, *tensors)  # type: ignore[no-untyped-call]


_allow_reduce = _compat.graph_call(_reduce)


def average(leaves: Sequence[Any], plan: Plan) -> list[Any]:
    """``leaves`` with the bucketed cross-rank average in their backward (while compiling).

    ``plan.ties`` maps a leaf to the first leaf holding the same tensor;
    ``plan.overlap``: each bucket's all-reduce may go as soon as its own
    gradients exist, else after the last gradient (:func:`_anchors`).
    """
    if plan.hook.refusal is not None:
        raise NotImplementedError(plan.hook.refusal)
    _allow_reduce()
    tensors: list[torch.Tensor] = []  # each distinct tensor once (tied weights)
    slots = [-1] * len(leaves)  # leaf -> its tensor's input slot, for its first leaf only
    uses: dict[int, int] = {}  # every synced leaf -> its tensor's input slot
    for i in plan.where:
        if not leaves[i].requires_grad:
            continue
        # Ties are known from construction (found by id() there: here dynamo
        # would guard on the ids and recompile for new tensors every step).
        tied_to = plan.ties.get(i)
        if tied_to is not None and tied_to in uses and leaves[i] is leaves[tied_to]:
            uses[i] = uses[tied_to]
        else:
            uses[i] = slots[i] = len(tensors)
            tensors.append(leaves[i])
    # A tied tensor's other leaves reduce zeros and get the same gradient, as eagerly.
    folded = tuple(s for s, t in enumerate(tensors) if t.grad is not None)
    olds: list[Any] = [tensors[s].grad for s in folded]  # not None: folded says so
    outputs = _reduce((plan.key, tuple(slots), folded), *tensors, *olds)
    result = list(leaves)
    for i, s in uses.items():
        result[i] = outputs[s]
    return result


def overlap_options() -> dict[str, Any]:
    """Inductor options that overlap DDP's all-reduces with the rest of backward.

    Inside a compiled loss, ``ddp(params)`` puts one all-reduce per bucket in
    the compiled backward, each depending only on its own bucket's
    gradients. Autograd still records them after the last gradient; these
    options let inductor's scheduler issue each one as soon as its
    gradients exist and wait for it as late as possible. They are options
    of ``torch.compile``, for the user to pass (fdp sets no global config).

    Returns:
        A new dict for ``torch.compile(..., options=...)`` with the
        inductor backend: ``reorder_for_compute_comm_overlap`` and the passes
        this torch provides; on torch 2.12 also its check that every rank
        compiled the same graph turned off (ranks that use different leaves
        compile different graphs, and the check's collective hung them).

    Example:
        >>> import fdp, torch
        >>> loss = torch.compile(lambda x: x.sum(), fullgraph=True, options=fdp.overlap_options())
        >>> fdp.overlap_options()["reorder_for_compute_comm_overlap"]
        True
    """
    return {
        "reorder_for_compute_comm_overlap": True,
        "reorder_for_compute_comm_overlap_passes": _compat.inductor_overlap_passes(),
        **_compat.inductor_spmd_check_off(),
    }
