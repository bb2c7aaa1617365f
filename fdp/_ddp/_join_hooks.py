"""A rank that has left ``join`` mirrors a comm hook's reduction: the hook on zeros.

As torch's DDP does (``_match_all_reduce_for_bwd_pass``), the rank runs the
registered hook, with its own state, on a bucket of zeros for each bucket, in
the training ranks' order and with their discipline: a hook that issues
collectives from its future's callbacks (PowerSGD) waits for one bucket
before the next, as the training ranks' reduction does
(``Reduction.serial``). Then the usage counts, in an all-reduce of their own
(a hook's bucket cannot carry them): started before the buckets are waited
for, or after a serial hook's last collective, as in ``Step._finish``. A
stateful hook's state advances with the others' (PowerSGD's step count,
which decides when it starts compressing); its zeros are the rank's
contribution to the sum, as a module's unused gradients would be.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from fdp import _bucket
from fdp._comm import _comm_hooks
from fdp._comm._comm_hooks import CommHook, GradBucket


@dataclasses.dataclass(frozen=True)
class HookPlan:
    """The comm hook that reduces each bucket (None: the default sum) and its state."""

    hook: CommHook | None = None
    state: Any = None
    serial: bool = False  # a bucket's reduction waits for the one before (PowerSGD)


class Usage(NamedTuple):
    """A started all-reduce of usage counts: the tensor and its work."""

    summed: torch.Tensor
    work: Any


def mirror(
    hooks: HookPlan,
    buckets: Sequence[_bucket.Bucket],
    usage: Callable[[], Usage],
    params: Callable[[_bucket.Bucket], list[torch.Tensor]],
) -> list[float]:
    """Every bucket's hook on zeros, then the usage counts: the summed counts, then late ones.

    ``usage()`` starts the counts' all-reduce; ``params(bucket)`` gives the
    tensors the hook sees as ``bucket.parameters()``.
    """
    if hooks.hook is None:
        raise RuntimeError("fdp internal error: a hook's mirror without a hook")
    hook = _comm_hooks.direct(hooks.hook)
    futures: list[Any] = []
    for k, bucket in enumerate(buckets):
        if hooks.serial and futures:
            futures[-1].wait()
        flat = bucket.empty().zero_()
        grad_bucket = GradBucket(
            flat,
            index=k,
            is_last=k == len(buckets) - 1,
            gradients=bucket.views(flat),
            parameters=params(bucket),
        )
        future = hook(hooks.state, grad_bucket)
        _comm_hooks.check_future(future)
        futures.append(future)
    started = None if hooks.serial else usage()
    for future in futures:
        _comm_hooks.resolved(future)
    if started is None:  # after every hook's last collective
        started = usage()
    started.work.wait()
    return list(started.summed.tolist())
