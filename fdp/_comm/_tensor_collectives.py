"""Collectives on any tensor, for users: ``fdp.all_reduce`` and its siblings.

``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all`` and
``broadcast`` each check their arguments, make the ranks agree on what
must match (one tiny all-reduce of a fingerprint, eagerly: a rank's mistake
becomes every rank's error, never a hang or a collective paired wrongly),
then run ``fdp/_comm/_differentiable.py``'s collective, whose rules give the
derivatives under autograd and every ``torch.func`` transform. Ranks
(``src``, the order of a gather) are ranks of ``group``.
docs/collectives.md has the semantics and a worked example.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from fdp import _compat, _mode, _tree
from fdp._comm import _agreement, _call_sites, _differentiable, _transforms

__all__ = ["all_gather", "all_reduce", "all_to_all", "broadcast", "reduce_scatter"]

OPS = ("sum", "mean", "max", "min")


@_transforms.eager_under_transforms("fdp.all_reduce")
def all_reduce(
    x: torch.Tensor, op: str = "sum", *, group: ProcessGroup | None = None
) -> torch.Tensor:
    """The elementwise reduction of ``x`` over the ranks of ``group``, on every rank.

    Args:
        x: a tensor of the same shape and dtype on every rank.
        op: ``"sum"``, ``"mean"``, ``"max"`` or ``"min"``.
        group: the process group; ``None`` is the world.

    Differentiable under autograd and every ``torch.func`` transform: the
    cotangents of ``"sum"``/``"mean"`` are summed (and divided) over ranks;
    ``"max"``/``"min"`` are piecewise linear, the derivative going to the
    lowest rank holding the extreme (its tangent forward, the summed
    cotangent backward).

    Example::

        total = fdp.all_reduce(loss.detach(), "mean")  # the global batch's mean loss
    """
    call = "fdp.all_reduce"

    def check() -> str:
        _check_op(call, op, x)
        return op

    # ``how``: the checked options, every rank's alike (a rank whose own
    # differ runs the agreed ones, fdp/_comm/_call_sites.py).
    def run(t: torch.Tensor, how: str, flag: torch.Tensor | None) -> Folded:
        if how in ("max", "min"):
            flat = _with(t.reshape(-1), flag, sign=-1 if how == "min" else 1)
            return _without(_differentiable.pmax(flat, how, group), flag, t.shape)
        scale = 1.0 / dist.get_world_size(group) if how == "mean" else 1.0
        if flag is None:
            return _differentiable.psum(t, scale=scale, group=group), None
        out, flags = _differentiable.psum_flagged(t.reshape(-1), flag, scale=scale, group=group)
        return out.view(t.shape), flags

    # A sum's payload is copied into its result anyway (psum_flagged): a flag
    # rides along at any size. A max or min copies it again.
    copied = isinstance(op, str) and op in ("sum", "mean")
    payload = _call_sites.Payload.COPIED if copied else _call_sites.Payload.REDUCED
    return _collective(call, group, x, {"op": op}, check, run, payload=payload)


@_transforms.eager_under_transforms("fdp.all_gather")
def all_gather(x: torch.Tensor, *, dim: int = 0, group: ProcessGroup | None = None) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in rank order, on every rank.

    Args:
        x: a tensor of the same shape and dtype on every rank (at least 1-D).
        dim: the dimension to concatenate along.
        group: the process group; ``None`` is the world.

    The vjp is the summing reduce-scatter: each rank gets the sum over
    ranks of the cotangent's part for its own rows.

    Example::

        keys = fdp.all_gather(encoder(views))  # every rank's embeddings: global negatives
    """
    call = "fdp.all_gather"

    def check() -> tuple[int, _differentiable.Policy]:
        # The policy too: a remembered site's calls reuse it (fdp/_comm/_call_sites.py).
        d = _dim(call, "dim", dim, x)
        return d, _differentiable.Policy(group, dist.get_world_size(group))

    def run(t: torch.Tensor, how: tuple[int, Any], flag: torch.Tensor | None) -> Folded:
        d, policy = how
        world = policy.world
        moved = t.movedim(d, 0) if d else t
        flags = None
        if flag is None:
            rows = _differentiable.all_gather_flat(moved.reshape(-1), policy)
        else:
            rows, flags = _differentiable.all_gather_flagged(moved.reshape(-1), flag, policy)
        out = rows.reshape(world * moved.shape[0], *moved.shape[1:])
        return (out.movedim(0, d) if d else out), flags

    return _collective(call, group, x, {"dim": dim}, check, run, payload=_call_sites.Payload.MOVED)


@_transforms.eager_under_transforms("fdp.reduce_scatter")
def reduce_scatter(
    x: torch.Tensor, op: str = "sum", *, dim: int = 0, group: ProcessGroup | None = None
) -> torch.Tensor:
    """This rank's chunk along ``dim`` of the reduction of ``x`` over the ranks of ``group``.

    Args:
        x: a tensor of the same shape and dtype on every rank, whose size
            along ``dim`` the group's size divides.
        op: ``"sum"``, ``"mean"``, ``"max"`` or ``"min"``.
        dim: the dimension cut into one chunk per rank (chunk ``r`` for rank ``r``).
        group: the process group; ``None`` is the world.

    The vjp of ``"sum"`` is the all-gather of the cotangents.

    Example::

        mine = fdp.reduce_scatter(torch.ones(4, 3), dim=0)  # 2 ranks: rows 2r, 2r+1 of 2 * ones
    """
    call = "fdp.reduce_scatter"

    def check() -> tuple[str, int]:
        _check_op(call, op, x)
        return op, _divisible(call, "dim", _dim(call, "dim", dim, x), x, group)

    def run(t: torch.Tensor, how: tuple[str, int], flag: torch.Tensor | None) -> Folded:
        how_op, d = how
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        chunk = t.shape[d] // world
        moved = t.movedim(d, 0)
        if how_op in ("max", "min"):
            flat = _with(moved.reshape(-1), flag, sign=-1 if how_op == "min" else 1)
            out, flags = _without(_differentiable.pmax(flat, how_op, group), flag, moved.shape)
            return out.narrow(0, rank * chunk, chunk).movedim(0, d), flags
        rows = _columns(moved.reshape(world, -1), flag)
        policy = _differentiable.Policy(group, world)
        mine = _differentiable.reduce_scatter_flat(rows.reshape(-1), policy)
        out, flags = _without(mine, flag, (chunk, *moved.shape[1:]))
        out = out.movedim(0, d)
        return (out / world if how_op == "mean" else out), flags

    return _collective(call, group, x, {"op": op, "dim": dim}, check, run)


@_transforms.eager_under_transforms("fdp.all_to_all")
def all_to_all(
    x: torch.Tensor,
    *,
    split_dim: int = 0,
    concat_dim: int = 0,
    group: ProcessGroup | None = None,
) -> torch.Tensor:
    """Chunk ``j`` of ``x`` along ``split_dim`` to rank ``j``; what arrives, along ``concat_dim``.

    Args:
        x: a tensor of the same shape and dtype on every rank, whose size
            along ``split_dim`` the group's size divides.
        split_dim: the dimension cut into one chunk per rank.
        concat_dim: the dimension the received chunks are concatenated
            along, in rank order.
        group: the process group; ``None`` is the world.

    Its own transpose: the vjp sends each cotangent chunk back where its
    value came from (the inverse all-to-all).

    Example::

        routed = fdp.all_to_all(tokens_by_expert, split_dim=0, concat_dim=0)
    """
    call = "fdp.all_to_all"

    def check() -> tuple[int, int]:
        s = _divisible(call, "split_dim", _dim(call, "split_dim", split_dim, x), x, group)
        return s, _dim(call, "concat_dim", concat_dim, x)

    def run(t: torch.Tensor, dims: tuple[int, int], flag: torch.Tensor | None) -> Folded:
        s, c = dims
        world = dist.get_world_size(group)
        moved = t.movedim(s, 0)
        chunk = moved.shape[0] // world
        got = _differentiable.all_to_all_rows(_columns(moved.reshape(world, -1), flag), group)
        rows, flags = _rows(got, flag)
        chunks = rows.reshape(world, chunk, *moved.shape[1:]).movedim(1, s + 1)
        return chunks.movedim(0, c).flatten(c, c + 1), flags

    options = {"split_dim": split_dim, "concat_dim": concat_dim}
    return _collective(call, group, x, options, check, run, payload=_call_sites.Payload.MOVED)


@_transforms.eager_under_transforms("fdp.broadcast")
def broadcast(x: torch.Tensor, src: int = 0, *, group: ProcessGroup | None = None) -> torch.Tensor:
    """Rank ``src``'s ``x`` on every rank of ``group``.

    Args:
        x: a tensor of the same shape and dtype on every rank (the values
            of ranks other than ``src`` are not used).
        src: a rank of ``group`` (0 .. size - 1), not a global rank.
        group: the process group; ``None`` is the world.

    The vjp sums the cotangents of every rank onto ``src``; the other ranks'
    inputs get zeros.

    Example::

        noise = fdp.broadcast(torch.randn(shape))  # rank 0's draw on every rank
    """
    call = "fdp.broadcast"

    def check() -> int:
        _src(call, src, group)
        return src

    def run(t: torch.Tensor, root: int, flag: torch.Tensor | None) -> Folded:
        if flag is None:
            return _differentiable.broadcast(t, root, group), None
        sent = _differentiable.sent(t, root, group).reshape(-1)
        return _without(_differentiable.psum(_with(sent, flag), group=group), flag, t.shape)

    return _collective(call, group, x, {"src": src}, check, run)


# ---------------------------------------------------------------------------
# Agreement: once per call site for small tensors (a flag folded into the
# payload, fdp/_comm/_call_sites.py), else one tiny all-reduce first.

# A collective's result and, where a flag travelled with it, the flags it came back as.
Folded = tuple[torch.Tensor, "torch.Tensor | None"]


def _with(flat: torch.Tensor, flag: torch.Tensor | None, *, sign: int = 1) -> torch.Tensor:
    """``flat`` with the flag appended (negated for a min: the extreme of the flags shows it)."""
    return flat if flag is None else torch.cat([flat, flag if sign > 0 else -flag])


def _without(out: torch.Tensor, flag: torch.Tensor | None, shape: Any) -> Folded:
    """A flat result's payload, shaped, and its last element, the flags' reduction."""
    if flag is None:
        return out.view(shape), None
    return out[:-1].view(shape), out[-1:]


def _columns(rows: torch.Tensor, flag: torch.Tensor | None) -> torch.Tensor:
    """Each rank's row with the flag appended (every rank receives every flag)."""
    return rows if flag is None else torch.cat([rows, flag.expand(rows.shape[0], 1)], dim=1)


def _rows(got: torch.Tensor, flag: torch.Tensor | None) -> Folded:
    """The rows received, without the flag column, and the flags."""
    return (got, None) if flag is None else (got[:, :-1], got[:, -1])


def _collective_traced(
    call: str,
    group: ProcessGroup | None,
    x: Any,
    options: dict[str, Any],
    check: Callable[[], Any],
    run: Callable[..., Folded],
    *,
    payload: _call_sites.Payload = _call_sites.Payload.REDUCED,
) -> torch.Tensor:
    """While dynamo traces, the local checks only: a graph cannot compare ranks."""
    _tensor(call, x)
    return run(x, check(), None)[0]


@_mode.traced_as(_collective_traced)
def _collective(
    call: str,
    group: ProcessGroup | None,
    x: Any,
    options: dict[str, Any],
    check: Callable[[], Any],
    run: Callable[..., Folded],
    *,
    payload: _call_sites.Payload = _call_sites.Payload.REDUCED,
) -> torch.Tensor:
    """``run(x, check(), flag)``'s result once every rank agrees on ``x`` and ``options``.

    A rank whose arguments are wrong (its ``check`` raises) still takes part
    in the agreement, with its error, so every rank raises: that rank its
    own error, the others one that names it. ``payload``: what the
    collective does with it, which says where the flag can travel.
    """
    _agreement.require_member(call, group)
    site = (call, _call_sites.here())
    known, agreed = _call_sites.SITES.lookup(group, site)
    if agreed is not None and not _mode.shapes_say_the_payload():
        # Under vmap or jvp a stand-in of the agreed shape would not pair with
        # a batched payload or a tangent's collective: agree first, on every rank.
        agreed = None
    if agreed is not None and isinstance(x, torch.Tensor) and _key(x, options) == agreed.key:
        # The arguments this site agreed on: their checks passed then, and give the same now.
        return _at_site(
            call, group, site, agreed, (x, options, agreed.value, None, True), run, payload
        )
    error: Exception | None = None
    value = None
    try:
        _tensor(call, x)
        value = check()
    except (TypeError, ValueError) as e:
        error = e
    if dist.get_world_size(group) == 1:
        if error is not None:
            raise error
        return run(x, value, None)[0]
    if agreed is None:
        first = _agree_first(call, group, x, options, error, site)
        if not known and first:  # every rank's verdict: the same site, the same arguments
            _remember(group, site, x, options, value, payload=payload)
        return run(x, value, None)[0]
    ok = error is None and _key(x, options) == agreed.key
    return _at_site(call, group, site, agreed, (x, options, value, error, ok), run, payload)


def _at_site(
    call: str,
    group: ProcessGroup | None,
    site: Any,
    agreed: _call_sites.Agreed,
    given: tuple[Any, dict[str, Any], Any, Exception | None, bool],
    run: Callable[..., Folded],
    payload: _call_sites.Payload,
) -> torch.Tensor:
    """The collective at a remembered site; ``given``: the call's arguments, their checks'
    value or error, and whether they are the agreed ones (else this rank sets its flag)."""
    x, options, value, error, ok = given
    args = (x, value) if ok else (agreed.stand_in(), agreed.value)
    if agreed.folded:
        out, flags = run(*args, agreed.flag(not ok))
    else:
        flags, work = agreed.beside(not ok, group)
        out = run(*args, None)[0]
        work.wait()
    agreed.calls += 1
    if flags is None or not _call_sites.flagged(flags):
        return out
    # A rank's arguments differ from what this site agreed on: the full
    # comparison raises on every rank, or all changed alike (a last batch).
    agreed.misses += 1
    _raise_unless_agreed(call, group, x, options, error)
    _remember(group, site, x, options, value, payload=payload, were=agreed)
    return run(x, value, None)[0]


def _agree_first(
    call: str,
    group: ProcessGroup | None,
    x: Any,
    options: dict[str, Any],
    error: Exception | None,
    site: Any,
) -> bool:
    """One tiny all-reduce; raises unless every rank agrees; whether every site is the same."""
    described = _described(x, options, error)
    fingerprint = _agreement.Fingerprint(described, extra=_call_sites.site_hash(*site))
    started = fingerprint.start(group)
    try:
        same_site = fingerprint.finish(started, group=group, call=call, arg="x", named=True)
    except ValueError as differs:
        if error is not None:
            raise error from differs
        raise
    if error is not None:
        raise error
    return same_site


def _raise_unless_agreed(
    call: str, group: ProcessGroup | None, x: Any, options: dict[str, Any], error: Exception | None
) -> None:
    try:
        _agreement.check(_described(x, options, error), group=group, call=call, arg="x", named=True)
    except ValueError as differs:
        if error is not None:
            raise error from differs
        raise
    if error is not None:
        raise error


def _remember(
    group: ProcessGroup | None,
    site: Any,
    x: torch.Tensor,
    options: dict[str, Any],
    value: Any,
    *,
    payload: _call_sites.Payload,
    were: _call_sites.Agreed | None = None,
) -> None:
    """What every rank agreed on at ``site``; None (agree first) once the site is unstable."""
    agreed = None
    if not (were is not None and were.unstable()):
        folded = _call_sites.foldable(x, payload)
        key, shape = _key(x, options), tuple(x.shape)
        agreed = _call_sites.Agreed(key, shape, x.dtype, x.device, value, folded)
        if were is not None:
            agreed.calls, agreed.misses = were.calls, were.misses
    _call_sites.SITES.put(group, site, agreed)


def _key(x: torch.Tensor, options: dict[str, Any]) -> tuple[Any, ...]:
    # Each option's type too: True == 1, but dim=True is refused where dim=1 is not.
    return (x.shape, x.dtype, x.device.type, *((k, type(v), v) for k, v in options.items()))


def _described(x: Any, options: dict[str, Any], error: Exception | None) -> list[tuple[str, str]]:
    described = [("x", _describe(x)), *((k, repr(v)) for k, v in options.items())]
    if error is not None:
        described.append((_agreement.ERROR, f"{type(error).__name__}: {error}"))
    return described


def _tensor(call: str, x: Any) -> None:
    if not isinstance(x, torch.Tensor):
        got = _tree.describe_tree(x, each=f"optree.tree_map(fdp.{call.rsplit('.', 1)[-1]}, tree)")
        raise TypeError(f"{call}: `x` expected a torch.Tensor; got {got}")


def _describe(x: Any) -> str:
    if not isinstance(x, torch.Tensor):
        return type(x).__name__
    said = f"a tensor of shape {tuple(x.shape)}, dtype {x.dtype} on {x.device.type}"
    # What travels under a transform: a batched payload, a tangent's collective.
    if _mode.wrapped([x]):
        physical = tuple(_compat.unwrap_all_functorch(x).shape)
        if physical != tuple(x.shape):
            said += f" (batched by vmap: {physical} in all)"
    if _mode.dual([x]):
        said += " with a tangent"
    return said


def _check_op(call: str, op: object, x: torch.Tensor) -> None:
    if op not in OPS:
        raise ValueError(f"{call}: `op` expected one of {list(OPS)}; got {op!r}")
    if op in ("max", "min") and x.is_complex():
        raise TypeError(f"{call}: `op={op!r}` expected a real tensor; got dtype {x.dtype}")
    if op == "mean" and not (x.is_floating_point() or x.is_complex()):
        raise TypeError(
            f"{call}: `op='mean'` expected a floating-point or complex tensor; got dtype "
            f"{x.dtype} (use op='sum' and divide)"
        )


def _dim(call: str, arg: str, dim: object, x: torch.Tensor) -> int:
    """``dim`` as a non-negative dimension of ``x``."""
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{call}: `{arg}` expected an int; got {dim!r}")
    if x.dim() == 0:
        raise ValueError(
            f"{call}: `x` expected a tensor with at least one dimension; got a 0-d tensor "
            "(x.reshape(1) gives it one)"
        )
    if not -x.dim() <= dim < x.dim():
        raise ValueError(
            f"{call}: `{arg}` expected a dimension of x (shape {tuple(x.shape)}), in "
            f"[{-x.dim()}, {x.dim() - 1}]; got {dim}"
        )
    return dim % x.dim()


def _divisible(call: str, arg: str, dim: int, x: torch.Tensor, group: ProcessGroup | None) -> int:
    world = dist.get_world_size(group)
    if x.shape[dim] % world:
        raise ValueError(
            f"{call}: `x` expected a size along `{arg}` ({dim}) that the group's size "
            f"{world} divides; got shape {tuple(x.shape)}"
        )
    return dim


def _src(call: str, src: object, group: ProcessGroup | None) -> None:
    world = dist.get_world_size(group)
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < world:
        raise ValueError(
            f"{call}: `src` expected a rank of the group (0 .. {world - 1}; a group rank, not "
            f"a global one); got {src!r}"
        )
