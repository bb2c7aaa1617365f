"""The collectives of fully sharded parameters: the flat all-gather of a unit and its transpose.

A unit's parameters live as one flat shard per rank; :func:`gather` makes
the whole flat buffer (every rank's shard in rank order) and its backward
averages the cotangents over ranks and keeps this rank's part: a
reduce-scatter divided by the world size, so that the shards' gradient is
the gradient of the mean of the ranks' losses, as under DDP.

The collectives, with their rules for every transform, are
:mod:`fdp._comm._differentiable`'s: the data-parallel mean
(``replicated``: the identity forward; backward summed over HSDP's
replicas, then divided by every rank) and the flat all-gather and its
transpose (``all_gather_flat``). What is fully sharded's own is here: the
dtype policy per bucket (the shard is cast to ``param_dtype`` before the
all-gather, a cotangent to ``reduce_dtype`` before the reduce-scatter, and
the shard's gradient comes back in the shard's own dtype; ``gather_dtype``
``torch.int8``: the shard travels block-wise quantized, :func:`start` for
the asynchronous gathers), the leaves'
views of a gathered unit, and the explanation of a collective that failed
(:func:`in_step`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed import ProcessGroup
from torch.utils import checkpoint

from fdp import _bucket, _compat, _mode
from fdp._comm import _agreement, _differentiable, _quantized, _raw
from fdp._comm._differentiable import Policy as Policy


def policy(
    group: ProcessGroup | None,
    world: int,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    replicas: ProcessGroup | None,
    total: int,
    *,
    sum_dtype: torch.dtype | None = None,
    gather_dtype: torch.dtype | None = None,
) -> Policy:
    """A FullyShardedDataParallel's policy; a ``None`` dtype: each bucket's (:func:`for_bucket`)."""
    return Policy(
        group,
        world,
        param_dtype,
        reduce_dtype,
        replicas=replicas,
        total=total,
        explain=in_step,
        sum_dtype=sum_dtype,
        gather_dtype=gather_dtype,
    )


def policies(
    call: str,
    names: Sequence[str],
    dtypes: Mapping[str, Any],
    unit_dtypes: Any,
    **where: Any,
) -> dict[str, Policy]:
    """Each unit's policy, checked here and the same on every rank, or every rank raises.

    ``dtypes``: the ``param_dtype``, ``reduce_dtype``, ``sum_dtype`` and
    ``gather_dtype`` options; ``where``: :func:`policy`'s ``group``, ``world``,
    ``replicas`` and ``total``. A rank whose options differ would gather or
    reduce other bytes than its peers (an abort or a hang): refused at construction.
    """
    error: Exception | None = None
    found: dict[str, Policy] = {}
    try:
        for name in ("param_dtype", "reduce_dtype", "sum_dtype"):
            _agreement.check_dtype(dtypes[name], name, call=call)
        check_gather_dtype(dtypes["gather_dtype"], "gather_dtype", call=call)
        base = policy(**where, **dtypes)
        found = per_unit(call, base, unit_dtypes, names)
    except (TypeError, ValueError) as err:
        error = err
    described = [(k, str(v)) for k, v in dtypes.items()] + [("unit_dtypes", _said(unit_dtypes))]
    if error is not None:
        described.append((_agreement.ERROR, f"{type(error).__name__}: {error}"))
    replicas = where["replicas"]
    for among in (where["group"],) if replicas is None else (where["group"], replicas):
        _agreement.check(described, group=among, call=call, arg="options", named=True)
    if error is not None:
        raise error
    return found


def _said(unit_dtypes: Any) -> str:
    """``unit_dtypes`` as words that are the same on every rank that gave the same."""
    if not isinstance(unit_dtypes, Mapping):
        return type(unit_dtypes).__name__
    return repr(sorted((str(k), repr(v)) for k, v in unit_dtypes.items()))


def check_gather_dtype(value: object, name: str, *, call: str) -> None:
    """Refuses a ``gather_dtype`` that is neither None nor ``torch.int8``."""
    if value is not None and value != torch.int8:
        raise ValueError(
            f"{call}: `{name}` expected None (parameters travel in param_dtype) or "
            f"torch.int8 (block-wise quantized, dequantized to param_dtype); got {value!r}"
        )


def for_bucket(
    policy: Policy, bucket: _bucket.Bucket, shard: torch.Tensor, *, exact: bool = False
) -> Policy:
    """How ``shard`` (of ``bucket``) travels: every dtype set; ``exact``: the bucket's own."""
    dtype, wire = policy.param_dtype, policy.gather_dtype
    # torch has no bfloat16 complex: complex leaves keep their dtype. On an int8
    # wire their real and imaginary parts (the bucket's values) are rounded alike.
    if exact or dtype is None or any(bucket.complex_):
        dtype = bucket.dtype
    if exact:
        wire = None
    reduce = dtype if policy.reduce_dtype is None else policy.reduce_dtype
    return policy._replace(
        param_dtype=dtype, reduce_dtype=reduce, grad_dtype=shard.dtype, gather_dtype=wire
    )


def start(
    shard: torch.Tensor, how: Policy, *, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, Any]:
    """Starts the all-gather of ``shard`` as ``how`` has it (eager); returns the result and work.

    The result (``out``, new if ``None``) holds every rank's shard in
    ``how.param_dtype`` once the work's ``wait()`` returns: prefetches and
    refills gather what :func:`gather` would.
    """
    if how.gather_dtype is None:
        part = shard.detach().to(how.param_dtype)
        return _raw.all_gather_start(part, group=how.group, out=out)
    dtype = shard.dtype if how.param_dtype is None else how.param_dtype
    pending = _quantized.all_gather_start(shard, group=how.group, dtype=dtype, out=out)
    return pending.out, pending


def per_unit(
    call: str, policy: Policy, unit_dtypes: Mapping[str, Any] | None, names: Sequence[str]
) -> dict[str, Policy]:
    """Each unit's policy: ``policy``, with the dtypes ``unit_dtypes`` gives a unit."""
    policies = dict.fromkeys(names, policy)
    if unit_dtypes is None:
        return policies
    if not isinstance(unit_dtypes, Mapping):
        raise TypeError(
            f"{call}: `unit_dtypes` expected a dict from unit name to a dtype, a pair "
            f"(param_dtype, reduce_dtype) or a dict of dtypes; got {type(unit_dtypes).__name__}"
        )
    for name, value in unit_dtypes.items():
        if name not in policies:
            raise ValueError(
                f"{call}: `unit_dtypes` key expected one of the units {list(names)}; got {name!r}"
            )
        policies[name] = _unit_policy(call, policy, name, value)
    return policies


_UNIT_KEYS = ("param_dtype", "reduce_dtype", "gather_dtype")


def _unit_policy(call: str, policy: Policy, name: str, value: Any) -> Policy:
    """``policy`` with unit ``name``'s dtypes: a param dtype, a pair, or a dict of them."""
    where = f"`unit_dtypes[{name!r}]`"
    if isinstance(value, Mapping):
        unknown = [k for k in value if k not in _UNIT_KEYS]
        if unknown:
            raise ValueError(
                f"{call}: {where} expected keys among {list(_UNIT_KEYS)}; got {unknown[0]!r}"
            )
        changes = dict(value)
        check_gather_dtype(changes.get("gather_dtype"), f"unit_dtypes[{name!r}]", call=call)
        pair = (
            changes.get("param_dtype", policy.param_dtype),
            changes.get("reduce_dtype", policy.reduce_dtype),
        )
    else:
        changes = {}
        pair = value if isinstance(value, tuple) else (value, policy.reduce_dtype)
    if len(pair) != 2 or not all(_float_dtype(d) for d in pair):
        raise TypeError(
            f"{call}: {where} expected a floating-point dtype, None, a pair of them "
            f"(param_dtype, reduce_dtype) or a dict of {list(_UNIT_KEYS)}; got {value!r}"
        )
    wire = changes.get("gather_dtype", policy.gather_dtype)
    return policy._replace(param_dtype=pair[0], reduce_dtype=pair[1], gather_dtype=wire)


def _float_dtype(dtype: object) -> bool:
    return dtype is None or (isinstance(dtype, torch.dtype) and dtype.is_floating_point)


@dataclass(frozen=True)
class Ready:
    """A gather's result, already all-gathered (prefetched): not an input of autograd."""

    flat: torch.Tensor


def _gather_traced(shard: torch.Tensor, how: Policy, ready: Ready | None = None) -> torch.Tensor:
    """:func:`gather` while dynamo traces (nothing is prefetched there)."""
    # Measured on torch 2.13: compiling a transform would drop the mean's backward.
    _mode.refuse_compiled_transform(
        "fdp.FullyShardedDataParallel",
        "gathering shards",
        lost="the reduce-scatter of the gradients",
    )
    mean = _differentiable.replicated(shard, replicas=how.replicas, total=how.total)
    return _differentiable.all_gather_flat(mean, how)


@_mode.traced_as(_gather_traced)
def gather(shard: torch.Tensor, how: Policy, ready: Ready | None = None) -> torch.Tensor:
    """Every rank's ``shard`` (1-D), concatenated in rank order, in ``param_dtype``.

    The backward gives ``shard`` the mean over ranks of the cotangents'
    parts for this rank (a reduce-scatter in ``reduce_dtype``, divided by
    the world size), in the shard's dtype. ``ready``: that result, gathered
    before from ``shard`` as it is now (eager only).
    """
    mean = _differentiable.replicated(shard, replicas=how.replicas, total=how.total)
    return _differentiable.all_gather_flat(mean, how, done=None if ready is None else ready.flat)


def _unit_leaves_traced(
    bucket: _bucket.Bucket,
    shard: torch.Tensor,
    how: Policy,
    gathered: Callable[[], torch.Tensor],
    *,
    recompute: bool,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """With ``recompute``, the leaves gathered in a region the compiler recomputes in backward.

    Note [compile-first resharding]: the compile-first way (SimpleFSDP,
    arXiv 2411.00284).
    The eager path frees a unit after forward and gathers it again for
    backward (``_fsdp_reshard``), which no graph can do. Here the all-gather
    and the leaves' views of its result are one checkpointed region, whose
    ops the partitioner recomputes: it then saves the shard, never the
    gathered parameters, and gathers again in backward where they are
    needed. Gather and views must be one region: at the border of two
    regions, or of a region and a plain view, the partitioner saves the
    tensor that crosses it (the gathered buffer). The flat buffer never
    leaves the region; the first leaf stands for it (only eager resharding
    uses it).
    """
    if not recompute:
        flat = gathered()
        return flat, bucket.split(flat)
    _mode.refuse_compiled_transform(
        "fdp.FullyShardedDataParallel",
        "gathering shards",
        lost="the reduce-scatter of the gradients",
    )
    mean = _differentiable.replicated(shard, replicas=how.replicas, total=how.total)

    def region(part: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(bucket.split(_differentiable.all_gather_flat(part, how)))

    # Compiled plain activation checkpointing tags every op of the region
    # "prefer recompute", which the partitioner honours as a must; before
    # torch 2.13 only a selective-checkpoint policy tags them.
    if _compat.plain_checkpoint_recomputes():
        leaves = checkpoint.checkpoint(region, mean, use_reentrant=False)
    else:
        leaves = checkpoint.checkpoint(region, mean, use_reentrant=False, context_fn=_recompute)
    return leaves[0], list(leaves)


@_mode.traced_as(_unit_leaves_traced)
def unit_leaves(
    bucket: _bucket.Bucket,
    shard: torch.Tensor,
    how: Policy,
    gathered: Callable[[], torch.Tensor],
    *,
    recompute: bool,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A bucket's flat buffer, as ``gathered()`` makes it, and its leaves (views of it)."""
    flat = gathered()
    return flat, bucket.split(flat)


def _recompute() -> Any:
    """A selective-checkpoint policy: every op of the region recomputed."""
    return checkpoint.create_selective_checkpoint_contexts(  # type: ignore[no-untyped-call]
        lambda ctx, op, *args, **kwargs: checkpoint.CheckpointPolicy.MUST_RECOMPUTE
    )


_WHAT = {
    "all-gather": "the all-gather of a unit's shards",
    "reduce-scatter": "the reduce-scatter of a unit's gradient",
}


@contextlib.contextmanager
def in_step(collective: str) -> Iterator[None]:
    """Explains an eager collective that failed, most often because ranks are out of step.

    ``collective``: ``"all-gather"`` (of a unit's shards), ``"reduce-scatter"``
    (of a unit's gradient) or the words for another.

    There is no ``join()`` for fully sharded ranks: each forward and backward
    is a sequence of collectives that every rank must make. A rank with more
    batches than another waits for collectives nobody answers, until the
    process group's timeout; this says why, instead of the backend's
    "timed out" alone (chained as the cause).
    """
    what = _WHAT.get(collective, collective)
    try:
        yield
    except RuntimeError as err:  # gloo raises RuntimeError, NCCL a subclass (DistBackendError)
        raise RuntimeError(
            f"fdp.FullyShardedDataParallel: {what} failed on this rank: {err}\n"
            "Every rank must make the same fully sharded calls (gather, apply, backward) in "
            "the same order. Most often a rank has more batches than another (uneven inputs) "
            "and waits for collectives the others never make: FullyShardedDataParallel has no "
            "join(), so give every rank the same number of batches (DistributedSampler with "
            "drop_last=True), or stop every rank when the first runs out of data"
        ) from err
