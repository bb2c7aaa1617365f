"""Learning-rate schedules: pure functions of the step count (optax's style).

A schedule maps ``count``, the number of updates done before this one (a
0-d float64 tensor, the optimizer state's ``"step"``), to a learning rate.
Pass one as an optimizer's ``lr``: the rate then lives in the state every
checkpoint already saves, so a resumed run takes the same rates as an
uninterrupted one, and a compiled update traces once for every step (the
count is a tensor, never a Python number the compiler would specialise on).

torch's schedulers change ``group["lr"]`` after each ``optimizer.step()``;
the rate of update ``n`` (from 0) is the scheduler's after ``n`` calls of
``scheduler.step()``, which is ``schedule(n)`` here:

=========================================  ====================================================
torch                                      fdp.optim
=========================================  ====================================================
``LinearLR(start_factor=a, end_factor=b,   ``linear_schedule(a * lr, b * lr, T)``
total_iters=T)``
``CosineAnnealingLR(T_max=T,               ``cosine_decay_schedule(lr, T, alpha=m / lr)``
eta_min=m)``
``SequentialLR([s1, s2],                   ``join_schedules([f1, f2], [W])``
milestones=[W])``
``ConstantLR(factor=f, total_iters=T)``    ``join_schedules([constant_schedule(f * lr),
                                           constant_schedule(lr)], [T])``
=========================================  ====================================================
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

import torch

Schedule = Callable[[torch.Tensor], torch.Tensor]
"""``schedule(count) -> lr``: ``count`` is a 0-d float64 tensor, the updates done so far."""


def _check(call: str, name: str, value: object, ok: Callable[[float], bool], want: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not ok(float(value)):
        raise ValueError(f"fdp.optim.{call}: `{name}` expected {want}; got {value!r}")
    return float(value)


def constant_schedule(value: float) -> Schedule:
    """The same rate at every step.

    Example:
        >>> import torch, fdp
        >>> float(fdp.optim.constant_schedule(0.1)(torch.tensor(7.0)))
        0.1
    """
    rate = _check("constant_schedule", "value", value, lambda v: v >= 0, "a float >= 0")

    def schedule(count: torch.Tensor) -> torch.Tensor:
        return torch.full_like(count, rate, dtype=torch.float64)

    return schedule


def linear_schedule(init_value: float, end_value: float, transition_steps: int) -> Schedule:
    """From ``init_value`` to ``end_value`` linearly over ``transition_steps``, then constant.

    torch's ``LinearLR(start_factor=a, end_factor=b, total_iters=T)`` over a
    base rate ``lr`` is ``linear_schedule(a * lr, b * lr, T)``.

    Example:
        >>> import torch, fdp
        >>> warmup = fdp.optim.linear_schedule(0.0, 1.0, 4)
        >>> [float(warmup(torch.tensor(n, dtype=torch.float64))) for n in (0, 2, 4, 9)]
        [0.0, 0.5, 1.0, 1.0]
    """
    call = "linear_schedule"
    init = _check(call, "init_value", init_value, lambda v: v >= 0, "a float >= 0")
    end = _check(call, "end_value", end_value, lambda v: v >= 0, "a float >= 0")
    steps = _steps(call, "transition_steps", transition_steps)

    def schedule(count: torch.Tensor) -> torch.Tensor:
        done = torch.clamp(count.to(torch.float64), 0, steps) / steps
        return init + (end - init) * done

    return schedule


def cosine_decay_schedule(init_value: float, decay_steps: int, *, alpha: float = 0.0) -> Schedule:
    """Half a cosine from ``init_value`` down to ``alpha * init_value`` over ``decay_steps``.

    torch's ``CosineAnnealingLR(T_max=T, eta_min=m)`` over a base rate
    ``lr`` is ``cosine_decay_schedule(lr, T, alpha=m / lr)`` for its first
    ``T`` steps (torch's closed form; after ``T`` torch rises again, this
    stays at the floor).

    Example:
        >>> import torch, fdp
        >>> decay = fdp.optim.cosine_decay_schedule(1.0, 10)
        >>> [round(float(decay(torch.tensor(n, dtype=torch.float64))), 6) for n in (0, 5, 10)]
        [1.0, 0.5, 0.0]
    """
    call = "cosine_decay_schedule"
    init = _check(call, "init_value", init_value, lambda v: v >= 0, "a float >= 0")
    steps = _steps(call, "decay_steps", decay_steps)
    floor = _check(call, "alpha", alpha, lambda v: 0 <= v <= 1, "a float in [0, 1]")

    def schedule(count: torch.Tensor) -> torch.Tensor:
        done = torch.clamp(count.to(torch.float64), 0, steps) / steps
        cosine = 0.5 * (1 + torch.cos(math.pi * done))
        return init * ((1 - floor) * cosine + floor)

    return schedule


def join_schedules(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """``schedules[i]`` from step ``boundaries[i - 1]`` on, counting from 0 there.

    torch's ``SequentialLR([s1, s2], milestones=[W])`` is
    ``join_schedules([f1, f2], [W])``; ``len(boundaries)`` is one less than
    ``len(schedules)``, and the boundaries increase.

    Example:
        >>> import torch, fdp
        >>> warm = fdp.optim.linear_schedule(0.0, 1.0, 2)
        >>> lr = fdp.optim.join_schedules([warm, fdp.optim.cosine_decay_schedule(1.0, 2)], [2])
        >>> [round(float(lr(torch.tensor(n, dtype=torch.float64))), 6) for n in range(5)]
        [0.0, 0.5, 1.0, 0.5, 0.0]
    """
    call = "fdp.optim.join_schedules"
    parts, cuts = list(schedules), [_steps("join_schedules", "boundaries", b) for b in boundaries]
    if not parts or len(cuts) != len(parts) - 1:
        raise ValueError(
            f"{call}: `boundaries` expected one fewer entry than `schedules` "
            f"({max(len(parts) - 1, 0)}); got {len(cuts)}"
        )
    if any(not callable(s) for s in parts):
        raise TypeError(f"{call}: `schedules` expected callables of the step; got {parts!r}")
    if any(b <= a for a, b in itertools.pairwise(cuts)):
        raise ValueError(f"{call}: `boundaries` expected increasing steps; got {cuts}")

    def schedule(count: torch.Tensor) -> torch.Tensor:
        count = count.to(torch.float64)
        rate = torch.as_tensor(parts[0](count), dtype=torch.float64)
        for start, part in zip(cuts, parts[1:], strict=True):
            later = torch.as_tensor(part(count - start), dtype=torch.float64)
            rate = torch.where(count >= start, later, rate)
        return rate

    return schedule


def warmup_cosine_decay_schedule(
    init_value: float,
    peak_value: float,
    warmup_steps: int,
    decay_steps: int,
    *,
    end_value: float = 0.0,
) -> Schedule:
    """A linear warm-up to ``peak_value``, then a cosine down to ``end_value``.

    ``decay_steps`` counts from the start, warm-up included (optax's
    convention): torch's ``SequentialLR([LinearLR(...), CosineAnnealingLR(
    T_max=decay_steps - warmup_steps, eta_min=end_value)], [warmup_steps])``.

    Example:
        >>> import fdp
        >>> lr = fdp.optim.warmup_cosine_decay_schedule(0.0, 1e-3, 100, 1000)
        >>> opt = fdp.optim.adamw(lr)
    """
    call = "warmup_cosine_decay_schedule"
    peak = _check(call, "peak_value", peak_value, lambda v: v > 0, "a float > 0")
    warmup = _steps(call, "warmup_steps", warmup_steps)
    total = _steps(call, "decay_steps", decay_steps)
    if total <= warmup:
        raise ValueError(
            f"fdp.optim.{call}: `decay_steps` expected more than `warmup_steps` ({warmup}); "
            f"got {total}"
        )
    end = _check(call, "end_value", end_value, lambda v: 0 <= v <= peak, "a float in [0, peak]")
    warm = linear_schedule(init_value, peak, warmup)
    decay = cosine_decay_schedule(peak, total - warmup, alpha=end / peak)
    return join_schedules([warm, decay], [warmup])


def _steps(call: str, name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"fdp.optim.{call}: `{name}` expected an int > 0; got {value!r}")
    return value
