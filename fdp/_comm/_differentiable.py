"""fdp's differentiable collectives, each defined once by its rules (JAX's lax/parallel.py).

The middle rung of the collective ladder: :mod:`fdp._comm._raw` moves the
bytes, this module gives each collective its derivatives, and the public
calls (:mod:`fdp._comm._tensor_collectives`, :mod:`fdp._comm._tree_collectives`)
check arguments and make the ranks agree.

Every collective here is linear in its input, so its derivatives are
collectives too, as with JAX's ``psum``: the vjp is the transposed
collective on the cotangent (all-reduce for all-reduce, reduce-scatter for
all-gather and back), the jvp is the same collective on the tangent, and
under ``vmap`` each batched slice travels in one collective. A
:class:`Collective` is those rules: its raw forward, its transpose and its
batching rule; it builds the eager form (an ``autograd.Function`` with
``backward``, ``jvp`` and ``vmap`` whose rules call the collectives again,
so they hold at any nesting depth: ``grad(grad)``, ``jvp(grad)``,
``vmap(grad)``, ``jacrev``, ``jacfwd``, ``hessian``, forward AD) and the
traced form (a Function with forward and backward only, the transpose's raw
forward: dynamo cannot trace a Function with a custom ``jvp`` or ``vmap``).

- :func:`psum`: the all-reduce; :func:`broadcast`, the stacked
  :func:`all_gather` and :func:`reduce_scatter` are built from it (a masked
  or zero-padded all-reduce, exact because adding zeros is).
- :func:`pmax`: the elementwise max or min, piecewise linear (the holder's
  derivatives), from a constant extreme and :func:`psum`.
- :func:`all_gather_flat` and :func:`reduce_scatter_flat`: a flat 1-D
  all-gather and its transpose, with a dtype :class:`Policy`; fully
  sharded units, ZeRO and the public ``fdp.all_gather``/``fdp.reduce_scatter``
  use them.
- :func:`all_to_all_rows`: row ``j`` to rank ``j``, its own transpose.
- :func:`replicated`: a value each rank holds a copy of, the identity
  forward; its transpose is the data-parallel mean (a fully sharded shard).

Besides this module, only DDP's compiled reduction (``fdp/_ddp/_traced.py``)
puts a collective inside an ``autograd.Function`` of its own: its issue/wait
split lets the compiler overlap the buckets with backward. ``ddp(params)``
under a transform, ``sync_batch_norm``'s statistics and fully sharded units
use the collectives here.

A new collective is a raw forward in :mod:`fdp._comm._raw`, one
:class:`Collective` line here and its ``def``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from fdp import _compat, _mode
from fdp._comm import _quantized, _raw

Rule = Callable[..., torch.Tensor]


def _no_explanation(what: str) -> AbstractContextManager[None]:
    return contextlib.nullcontext()


class Collective:
    """A differentiable collective, from its rules; call it as ``c(x, *consts)``.

    Args:
        name: what it is called in errors (``"all-gather"``).
        forward: the raw collective ``(x, *consts) -> Tensor``, no derivatives.
        batch: ``(x, *consts) -> Tensor`` with the batch in ``x``'s dim 0 on
            every rank (every rank runs the same program and batches alike),
            built from differentiable collectives; returns the batch in dim 0.
        linear: ``False``: the result is a constant (no derivatives).
        explain: ``consts -> context``, wrapped around each eager forward
            (names what failed when ranks are out of step).

    :attr:`transpose` is the collective itself until :func:`transposes` pairs it;
    :attr:`tangent`, the collective the jvp applies to a tangent, is itself
    unless set (an int8 gather's tangent travels exact). :attr:`eager` is the
    eager form alone, for callers that know dynamo is not tracing.

    Example:
        >>> double = Collective("double", lambda x: 2 * x, batch=lambda x: 2 * x)
        >>> double(torch.ones(2)).tolist()
        [2.0, 2.0]
    """

    def __init__(
        self,
        name: str,
        forward: Rule,
        *,
        batch: Rule,
        linear: bool = True,
        explain: Callable[..., AbstractContextManager[None]] | None = None,
    ) -> None:
        self.name, self.forward, self.batch, self.linear = name, forward, batch, linear
        self.explain = explain
        self.transpose: Collective = self
        self.tangent: Collective = self
        self.eager = _eager_form(self)
        self._call = _mode.by_mode(self.eager, _traced_form(self))

    def __call__(self, x: torch.Tensor, *consts: Any, done: torch.Tensor | None = None) -> Any:
        """The collective of ``x``; ``done``: its result, issued before (eagerly only)."""
        return self._call(x, *consts, done=done)

    def batched(self, in_dim: int | None, x: torch.Tensor, *consts: Any) -> tuple[Any, int | None]:
        """The ``vmap`` rule: ``x`` batched along ``in_dim``; the result batched along dim 0."""
        if in_dim is None:
            return self(x, *consts), None
        return self.batch(x.movedim(in_dim, 0), *consts), 0


def transposes(a: Collective, b: Collective) -> None:
    """Makes ``a`` and ``b`` each other's transpose (an all-gather and its reduce-scatter)."""
    a.transpose, b.transpose = b, a


def _eager_form(c: Collective) -> Rule:
    """``c`` as an ``autograd.Function`` with every rule, applied to ``x`` (or ``done``)."""

    def forward(x: torch.Tensor, done: torch.Tensor | None, *consts: Any) -> torch.Tensor:
        if done is not None:
            # Not ``done`` itself: an input returned as-is would be a view of it,
            # and its buffer may still be filling (fdp.all_gather writes it after).
            return done.detach()
        explain = contextlib.nullcontext() if c.explain is None else c.explain(*consts)
        with explain, _compat.label(f"fdp::{c.name}"):  # eager only: a profiler trace shows it
            return c.forward(x, *consts)

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.consts = inputs[2:]
        if not c.linear:
            ctx.mark_non_differentiable(output)

    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        nothing = (None for _ in range(len(ctx.consts) + 1))
        return (c.transpose(grad, *ctx.consts) if c.linear else None, *nothing)

    def jvp(ctx: Any, tangent: torch.Tensor, *_: Any) -> Any:
        return c.tangent(tangent, *ctx.consts)

    def vmap(info: Any, in_dims: tuple[Any, ...], x: torch.Tensor, done: Any, *consts: Any) -> Any:
        return c.batched(in_dims[0], x, *consts)

    rules = {"forward": forward, "setup_context": setup_context, "backward": backward}
    rules |= {"vmap": vmap} | ({"jvp": jvp} if c.linear else {})
    function = _function(f"_{c.name.title().replace('-', '')}", rules)

    def call(x: torch.Tensor, *consts: Any, done: torch.Tensor | None = None) -> torch.Tensor:
        out: torch.Tensor = _compat.apply_unbound(
            function, x if c.linear else x.detach(), done, *consts
        )
        return out

    return call


def _traced_form(c: Collective) -> Rule:
    """``c`` while dynamo traces: forward and backward only, the transpose's raw forward."""

    def forward(x: torch.Tensor, *consts: Any) -> torch.Tensor:
        return c.forward(x, *consts)

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.consts = inputs[1:]

    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return (c.transpose.forward(grad, *ctx.consts), *(None for _ in ctx.consts))

    rules = {"forward": forward, "setup_context": setup_context, "backward": backward}
    function = _function(f"_Traced{c.name.title().replace('-', '')}", rules)

    def call(x: torch.Tensor, *consts: Any, done: torch.Tensor | None = None) -> torch.Tensor:
        if not c.linear:  # a constant: no Function to trace
            return c.forward(x.detach(), *consts)
        if not (x.requires_grad and torch.is_grad_enabled()) and not _mode.transform_running():
            # Nothing to differentiate: no Function. (Dynamo would inline its
            # forward passing a ctx, as it does where the parameters do not
            # match the arguments one for one; a rule's *consts do not.)
            return c.forward(x, *consts)
        out: torch.Tensor = function.apply(x, *consts)
        return out

    return call


def _function(name: str, rules: dict[str, Any]) -> Any:
    """An ``autograd.Function`` subclass named ``name`` with ``rules`` as its static methods."""
    methods = {k: staticmethod(v) for k, v in rules.items()}
    return type(name, (torch.autograd.Function,), methods | {"__module__": __name__})


# ---------------------------------------------------------------------------
# The all-reduce, and what is built from it.

_all_reduce = Collective(
    "all-reduce",
    lambda t, scale, group: _raw.all_reduce(t, group=group, scale=scale),
    batch=lambda t, scale, group: psum(t, scale=scale, group=group),
)


def psum(t: torch.Tensor, *, scale: float = 1.0, group: ProcessGroup | None = None) -> torch.Tensor:
    """``scale`` times the sum of ``t`` over the ranks of ``group``, differentiable at any depth."""
    out: torch.Tensor = _all_reduce(t, scale, group)
    return out


def psum_flagged(
    flat: torch.Tensor, flag: torch.Tensor, *, scale: float, group: ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`psum` of 1-D ``flat`` with its one-element ``flag`` appended: the sum and flags.

    The sum is differentiable as :func:`psum`'s, the flags (scaled too) a
    constant. Eagerly outside a transform the payload is reduced outside
    autograd and the sum enters it through one Function given its buffer
    while the bytes are in flight (as :func:`all_gather_flagged`).
    """
    if _mode.traced() or _mode.transformed([flat]):
        out = psum(torch.cat([flat, flag]), scale=scale, group=group)
        return out[:-1], out[-1:]
    n = flat.numel()
    payload = torch.cat([flat.detach(), flag])
    work = _raw.all_reduce_start(payload, group=group)
    out = payload[:n]
    if flat.requires_grad and torch.is_grad_enabled():
        # Its output aliases ``payload`` (reduced below, before anything can save it).
        out = _all_reduce.eager(flat, scale, group, done=out)
    work.wait()
    if scale != 1.0:
        payload.mul_(scale)
    return out, payload[n:]


_extreme: Collective = Collective(
    "extreme",
    lambda t, op, group: _raw.all_reduce(t, group=group, op=op),
    batch=lambda t, op, group: _extreme(t, op, group),
    linear=False,
)


def pmax(t: torch.Tensor, op: str, group: ProcessGroup | None) -> torch.Tensor:
    """The elementwise ``op`` (``"max"`` or ``"min"``) over ranks, piecewise linear.

    Each element's value is its holder's: the lowest rank holding the
    extreme (ties go to the lowest rank). So the derivatives are that rank's:
    its tangent forward; the cotangent summed over ranks, to it alone,
    backward (a :func:`psum` of ``t`` where this rank holds the extreme, else
    zeros, which gives the extreme exactly). Three collectives: the extreme,
    the holder, the psum.
    """
    extreme = _extreme(t, op, group)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    held = t.detach() == extreme
    claim = torch.where(held, rank, world).to(torch.int32)
    holder = _extreme(claim, "min", group)
    return psum(torch.where(holder == rank, t, torch.zeros_like(t)), group=group)


def broadcast(t: torch.Tensor, src: int, group: ProcessGroup | None) -> torch.Tensor:
    """Rank ``src``'s ``t`` (a group rank) on every rank; the transpose sums onto ``src``."""
    return psum(sent(t, src, group), group=group)


def sent(t: torch.Tensor, src: int, group: ProcessGroup | None) -> torch.Tensor:
    """What this rank adds to :func:`broadcast`'s psum: ``t`` on ``src``, zeros elsewhere."""
    # Zeros that depend on ``t``: every rank's psum then has the same
    # derivatives to run (zeros_like would give the other ranks none: a hang).
    mine = dist.get_rank(group) == src
    return t if mine else torch.where(torch.tensor(False), t, 0)


def all_gather(t: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """``t`` from every rank stacked along a new dim 0; the transpose is a reduce-scatter."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    rows = [t if r == rank else torch.where(torch.tensor(False), t, 0) for r in range(world)]
    return psum(torch.stack(rows), group=group)


def reduce_scatter(t: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Row ``rank`` of the sum over ranks of ``t`` (shape ``(world, ...)``)."""
    return psum(t, group=group)[dist.get_rank(group)]


# ---------------------------------------------------------------------------
# The flat all-gather and its transpose, the reduce-scatter.


class Policy(NamedTuple):
    """How a flat all-gather and its transpose travel; a dtype of ``None`` casts nothing.

    The one dtype policy of fdp's sharded collectives: fully sharded units
    (one per unit, resolved per bucket by ``fdp/_sharding/_fsdp_gather.py``),
    ZeRO and the public calls.
    """

    group: ProcessGroup | None
    world: int  # the group's size
    param_dtype: torch.dtype | None = None  # what the all-gather carries
    reduce_dtype: torch.dtype | None = None  # what the reduce-scatter carries
    grad_dtype: torch.dtype | None = None  # what the reduce-scatter returns
    replicas: ProcessGroup | None = None  # HSDP: the group across which shards are replicated
    total: int = 0  # the ranks whose losses a gradient averages: world times the replicas
    # Wraps each eager collective, given its name: says what failed (ranks out of step).
    explain: Callable[[str], AbstractContextManager[None]] = _no_explanation
    # What the reduce-scatter adds in: None, on the wire in reduce_dtype (a ring of
    # rounded partial sums); else reduce_dtype's bytes, added in sum_dtype where they land.
    sum_dtype: torch.dtype | None = None
    # What the all-gather of parameters sends, if not param_dtype: torch.int8, blocks
    # with a scale each (fdp/_comm/_quantized.py), decoded to param_dtype where they land.
    gather_dtype: torch.dtype | None = None


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``t`` in ``dtype``: ``t`` itself when it has it already, or for ``None``.

    Note [no-op casts in traced forwards]: on torch 2.11, a compiled
    ``autograd.Function`` whose forward returns the result of an op that
    hands back its own input (``.to`` to the same dtype or device,
    ``.contiguous()`` of a contiguous tensor, ``.type_as``) made from a
    tensor computed inside that forward gets a zero gradient, silently
    (measured right on 2.13 and 2.15). Never calling the op keeps every version right.
    """
    return t if dtype is None or t.dtype == dtype else t.to(dtype)


def _gather_now(x: torch.Tensor, policy: Policy) -> torch.Tensor:
    return _raw.all_gather(_cast(x, policy.param_dtype), group=policy.group)


def _scatter_now(y: torch.Tensor, policy: Policy) -> torch.Tensor:
    wire, wide = policy.reduce_dtype, policy.sum_dtype
    if wide is not None and wire is not None and wide != wire:
        out = _raw.reduce_scatter_wide(_cast(y, wide), wire=wire, group=policy.group)
    else:
        out = _raw.reduce_scatter(_cast(y, wire), group=policy.group)
    return _cast(out, policy.grad_dtype)  # Note [no-op casts in traced forwards]


def _gather_batch(rows: torch.Tensor, policy: Policy) -> torch.Tensor:
    # The batch goes into the flat buffer, rank-major, and back to the front after.
    batch, n = rows.shape
    out = all_gather_flat(rows.reshape(-1), policy)
    return out.view(policy.world, batch, n).transpose(0, 1).reshape(batch, -1)


def _scatter_batch(rows: torch.Tensor, policy: Policy) -> torch.Tensor:
    batch = rows.shape[0]
    rank_major = rows.reshape(batch, policy.world, -1).transpose(0, 1).reshape(-1)
    return reduce_scatter_flat(rank_major, policy).view(batch, -1)


_all_gather_flat = Collective(
    "all-gather", _gather_now, batch=_gather_batch, explain=lambda p: p.explain("all-gather")
)
_reduce_scatter_flat = Collective(
    "reduce-scatter",
    _scatter_now,
    batch=_scatter_batch,
    explain=lambda p: p.explain("reduce-scatter"),
)
transposes(_all_gather_flat, _reduce_scatter_flat)


def _gather_int8_now(x: torch.Tensor, policy: Policy) -> torch.Tensor:
    dtype = x.dtype if policy.param_dtype is None else policy.param_dtype
    return _quantized.all_gather(x, group=policy.group, dtype=dtype)


def _gather_int8_batch(rows: torch.Tensor, policy: Policy) -> torch.Tensor:
    # Each row in blocks of its own, as it would be alone: one gather per row.
    return torch.stack([all_gather_flat(row, policy) for row in rows.unbind(0)])


# The weights are rounded, not their derivatives: the vjp is the reduce-scatter of the
# gradient with respect to the decoded weights (exact w.r.t. them), the jvp the exact
# gather of the tangent, and the reduce-scatter's own transpose stays the exact gather.
_all_gather_int8 = Collective(
    "int8-all-gather",
    _gather_int8_now,
    batch=_gather_int8_batch,
    explain=lambda p: p.explain("all-gather"),
)
_all_gather_int8.transpose, _all_gather_int8.tangent = _reduce_scatter_flat, _all_gather_flat


def all_gather_flat(
    x: torch.Tensor, policy: Policy, *, done: torch.Tensor | None = None
) -> torch.Tensor:
    """Every rank's ``x`` (1-D, the same size everywhere) concatenated in rank order.

    In ``policy.param_dtype``; the derivative (vjp) is :func:`reduce_scatter_flat`,
    in ``policy.reduce_dtype``, returned in ``policy.grad_dtype``. ``done``:
    the result, gathered before (eagerly only: a prefetch). With
    ``policy.gather_dtype`` ``torch.int8``, ``x`` travels block-wise quantized
    and the result is its decoded values (only ``x``: tangents travel exact).
    """
    gather = _all_gather_flat if policy.gather_dtype is None else _all_gather_int8
    out: torch.Tensor = gather(x, policy, done=done)
    return out


def all_gather_flagged(
    flat: torch.Tensor, flag: torch.Tensor, policy: Policy
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's 1-D ``flat`` with its one-element ``flag``: the rows ``(world, n)`` and flags.

    One all-gather of ``flat`` with ``flag`` appended; the rows are
    differentiable as :func:`all_gather_flat`'s result, the flags a constant.
    Eagerly outside a transform the payload travels outside autograd, and
    the rows enter it through one Function given their buffer while the
    bytes are in flight: the public all-gather's latency (Python that runs
    before the wait, with its peers waiting, costs the most).
    """
    world, n = policy.world, flat.numel()
    if _mode.traced() or _mode.transformed([flat]):
        grid = all_gather_flat(torch.cat([flat, flag]), policy).view(world, n + 1)
        return grid[:, :n], grid[:, n]
    payload = _cast(torch.cat([flat.detach(), flag]), policy.param_dtype)
    grid, work = _raw.all_gather_start(
        payload, group=policy.group, out=payload.new_empty(world * (n + 1))
    )
    table = grid.view(world, n + 1)
    rows = grid.new_empty(world * n)
    out = rows
    if flat.requires_grad and torch.is_grad_enabled():
        # Its output aliases ``rows`` (filled below, before anything can save it).
        out = _all_gather_flat.eager(flat, policy, done=rows)
    work.wait()
    rows.view(world, n).copy_(table[:, :n])
    return out.view(world, n), table[:, n]


def reduce_scatter_flat(y: torch.Tensor, policy: Policy) -> torch.Tensor:
    """This rank's part (1/world of ``y``, rank-major) of the sum over ranks of ``y``."""
    out: torch.Tensor = _reduce_scatter_flat(y, policy)
    return out


# ---------------------------------------------------------------------------
# The all-to-all: row j to rank j. Its own transpose, as psum is.


def _all_to_all_batch(rows: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    batch, world, m = rows.shape  # each rank's rows by batch
    out = all_to_all_rows(rows.transpose(0, 1).reshape(world, batch * m), group)
    return out.view(world, batch, m).transpose(0, 1)


# What rank i got from me, row i, was my row i: its cotangent goes back the same way.
_all_to_all = Collective(
    "all-to-all", lambda rows, group: _raw.all_to_all(rows, group=group), batch=_all_to_all_batch
)


def all_to_all_rows(rows: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Row ``j`` of ``rows`` (``(world, m)``) to rank ``j``; row ``i`` of the result from ``i``."""
    out: torch.Tensor = _all_to_all(rows, group)
    return out


# ---------------------------------------------------------------------------
# A replicated value and the data-parallel mean, its transpose.


def _mean_now(g: torch.Tensor, replicas: ProcessGroup | None, total: int) -> torch.Tensor:
    summed = g if replicas is None else _raw.all_reduce(g, group=replicas)
    return summed / total


_mean: Collective = Collective(
    "mean", _mean_now, batch=lambda g, replicas, total: _mean(g, replicas, total)
)
_replicated: Collective = Collective(
    "replicate",
    lambda x, replicas, total: x.view_as(x),  # a view: what the jvp returns must be one too
    batch=lambda x, replicas, total: _replicated(x, replicas, total),
)
_replicated.transpose = _mean  # and the mean is its own transpose (a scaled psum)


def replicated(x: torch.Tensor, *, replicas: ProcessGroup | None, total: int) -> torch.Tensor:
    """``x``, as each rank's copy of one value: its gradient is the mean over ranks.

    The identity forward (a view); backward the cotangent summed over
    ``replicas`` (HSDP's replica group; ``None``: no collective) and divided
    by ``total``, the ranks whose losses count: a fully sharded shard's
    gradient is then the gradient of the mean of the ranks' losses.
    """
    out: torch.Tensor = _replicated(x, replicas, total)
    return out
