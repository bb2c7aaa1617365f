"""What every step of one ``DistributedDataParallel`` reduces, and one bucket's state in a step.

:class:`Reduction` is fixed for a ``DistributedDataParallel``; each backward's
``Step`` (``fdp/_ddp/_step.py``) holds an :class:`InFlight` per bucket.
:class:`StepState` is what a step's parts in other modules (the graphed and
the late gradients) read and change of it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from fdp._bucket import Layout
from fdp._comm import _comm_hooks
from fdp._comm._comm_hooks import CommHook
from fdp._ddp._delivery import Delivery
from fdp._ddp._replicas import Replicas

if TYPE_CHECKING:
    from fdp._ddp._hooked import Hooked


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
    # Computed in __post_init__ (dataclasses.replace recomputes them for a new hook).
    usage_tail: int = field(init=False, default=0)
    slots: dict[int, int] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        # Note [usage rides the last bucket]: a step that counts which leaves
        # had a gradient (loss.backward(): .grad stays None where no rank had
        # one) sums the counts in the last bucket's all-reduce, in slots after
        # its gradients, instead of one more all-reduce at the end of every
        # backward (a round trip: about 2 ms of a GPT-2 step on gloo). The
        # last bucket waits for the end of backward then, when every count
        # is known; its gradients are the last to arrive anyway. Only the
        # default sum can carry them, and only exactly: float32 or float64.
        object.__setattr__(self, "usage_tail", _usage_tail(self.layout, self.hook, self.group))
        object.__setattr__(self, "slots", {i: p for p, i in enumerate(self.layout.order)})

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


def _usage_tail(layout: Layout, hook: CommHook | None, group: dist.ProcessGroup | None) -> int:
    """Elements the usage counts add to the last bucket: a slot per leaf, one for late ones.

    0 where they go in an all-reduce of their own: under a comm hook, or a
    last bucket whose dtype cannot sum the counts exactly.
    """
    if hook is not None or not layout.buckets:
        return 0
    exact = {torch.float32: 2**24, torch.float64: 2**53}.get(layout.buckets[-1].dtype)
    world = dist.get_world_size(group)
    if exact is None or world * (world + 1) >= exact:  # a sparse user counts world + 1
        return 0
    return len(layout.order) + 1


@dataclass
class InFlight:
    """One bucket of a :class:`Step`, from its first gradient to its reduced result."""

    flat: torch.Tensor | None = None  # the flat buffer, taken at the first gradient
    views: list[torch.Tensor] = field(default_factory=list)  # of flat, per leaf
    filled: set[int] = field(default_factory=set)  # leaves packed so far
    expected: int = 0  # leaves hooked on this rank (a tied tensor counts once)
    future: Any = None  # the reduction, once launched


class StepState(Protocol):
    """A step as ``fdp/_ddp/_graphed.py`` and ``fdp/_ddp/_late.py`` see it."""

    reduction: Reduction
    leaves: list[Any]
    hooked: list[int]
    plan: Hooked  # what every step of these hooked leaves reads: fdp/_ddp/_hooked.py
    buckets: list[InFlight]
    used: set[int]
    late: dict[int, torch.Tensor]
    sparse: dict[int, torch.Tensor | None]
    rides: bool  # the usage counts ride the last bucket
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
