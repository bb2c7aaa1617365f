"""What every step of one ``DistributedDataParallel`` reduces, and one bucket's state in a step.

:class:`Reduction` is fixed for a ``DistributedDataParallel``; each backward's
``Step`` (``fdp/_ddp/_step.py``) holds an :class:`InFlight` per bucket.
:class:`StepState` is what a step's parts in other modules (the graphed and
the late gradients) read and change of it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from fdp._bucket import Layout
from fdp._comm import _comm_hooks
from fdp._comm._comm_hooks import CommHook
from fdp._ddp._delivery import Delivery
from fdp._ddp._replicas import Replicas


@dataclass(frozen=True)
class Reduction:
    """What every step of one ``DistributedDataParallel`` reduces, and how.

    ``hook(state, bucket)`` (a comm hook, or None: ``_comm_hooks.sum_hook`` after
    a ``prescale`` folded into packing) returns a future of the reduced
    bucket. ``paths`` names every leaf for error messages.
    """

    layout: Layout
    hook: CommHook | None
    state: Any
    group: dist.ProcessGroup | None
    paths: list[str]
    replicas: Replicas | None = None  # the parameters' check after reduced backwards

    @property
    def serial(self) -> bool:
        """Whether buckets must wait for each other: the hook may issue collectives later.

        PowerSGD issues its second and third all-reduce from its future's
        callbacks, on the backend's thread: launching the next bucket (or
        the usage all-reduce) meanwhile would order the collectives
        differently on different ranks (measured: a hang). Hooks known to
        issue one collective up front keep the buckets overlapping.
        """
        return self.hook is not None and not _comm_hooks.one_collective(self.hook)

    @property
    def prescale(self) -> float:
        """What packing multiplies each gradient by: the default's division by the world size."""
        return 1.0 / dist.get_world_size(self.group) if self.hook is None else 1.0


@dataclass
class InFlight:
    """One bucket of a :class:`Step`, from its first gradient to its reduced result."""

    flat: torch.Tensor | None = None  # the flat buffer, taken at the first gradient
    views: list[torch.Tensor] = field(default_factory=list)  # of flat, per leaf
    filled: set[int] = field(default_factory=set)  # leaves packed so far
    expected: int = 0  # leaves hooked on this rank (a tied tensor counts once)
    future: torch.futures.Future[torch.Tensor] | None = None  # the reduction, once launched


class StepState(Protocol):
    """A step as ``fdp/_ddp/_graphed.py`` and ``fdp/_ddp/_late.py`` see it."""

    reduction: Reduction
    leaves: list[Any]
    hooked: list[int]
    buckets: list[InFlight]
    used: set[int]
    late: dict[int, torch.Tensor]
    lock: threading.Lock
    delivery: Delivery
    queued: bool
    next_launch: int
    prescale: float

    @property
    def returned(self) -> bool: ...

    def decide(self, i: int) -> bool: ...

    def dropped(self, i: int) -> bool: ...

    def view(self, i: int) -> torch.Tensor: ...

    def into_bucket(self, leaf: Any, view: torch.Tensor) -> torch.Tensor: ...

    def launch_usage(self) -> tuple[torch.Tensor, Any]: ...

    def finish(self) -> None: ...
