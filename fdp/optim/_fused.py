"""torch's fused optimizer kernels for ``fdp.optim``'s eager steps: one pass over each leaf.

torch's foreach Adam reads and writes each parameter's memory about twenty
times per step (one pass per op); its fused kernel (``torch._fused_adamw_``,
torch.optim's ``fused=True``) does it once. A pure step that copies the
parameters and moments and runs the fused kernel in place on the copies is
faster than torch's foreach step in place (``benchmarks/bench_optim.py``);
with ``donate=True`` the copies go too. The values are torch's ``fused=True``
step's bitwise, and its foreach step's to rounding (1e-7 relative after ten
steps; in float16 and bfloat16 the fused kernel computes in float32).

A leaf takes this path only where the kernel computes what the rule does:
eagerly, with no derivative to carry, a floating dtype on a device torch has
the kernels for, and the parameter, gradient and state in one dense layout
(the CPU kernel walks memory in order: a gradient expanded from a sum, or
in another memory format than its parameter, would be misread). Other leaves
take the foreach step in the same call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from fdp import _compat
from fdp.optim import _lists

_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})

# One (device, dtype) group's call: (params, grads, {slot: list}, steps, lr).
Kernel = Callable[
    [list[torch.Tensor], list[torch.Tensor], dict[str, list[torch.Tensor]], list[torch.Tensor],
     float | torch.Tensor],
    None,
]  # fmt: skip


def fusable(tensors: Sequence[torch.Tensor], devices: frozenset[str]) -> bool:
    """Whether one leaf's parameter, gradient and state tensors can go through a fused kernel.

    ``devices``: :func:`fdp._compat.fused_optimizer_devices`, read once per step.
    """
    first = tensors[0]
    if first.dtype not in _DTYPES:
        if not first.is_complex():
            return False
        tensors = [torch.view_as_real(t) for t in tensors]  # stepped as real pairs, as the rule
        first = tensors[0]
    device, shape = first.device, first.shape
    if device.type not in devices:
        return False
    contiguous = first.is_contiguous()
    for t in tensors[1:]:  # a loop, not all(): this runs for every leaf of every step
        if t.shape != shape or t.device != device:
            return False
        if contiguous and not t.is_contiguous():
            contiguous = False
    return contiguous or (_dense(first) and all(t.stride() == first.stride() for t in tensors))


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: memory order visits each element once, with no gap."""
    extent = sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True)) + 1
    return t.numel() == 0 or extent == t.numel()


def run(
    kernel: Kernel,
    leaves: tuple[list[torch.Tensor], list[torch.Tensor], dict[str, list[torch.Tensor]]],
    steps: list[torch.Tensor],
    donate: bool,
    lr: float | torch.Tensor,
) -> tuple[list[torch.Tensor], dict[str, list[torch.Tensor]]]:
    """The step of these (real) leaves: new parameters and slots, or the donated ones written.

    ``steps`` are the step counts, already incremented. Without ``donate``
    the parameters and slots are copied first (same strides), a run of
    leaves at a time (:func:`fdp.optim._lists.runs`: eagerly on CPU the
    kernel reads the copies while they are in cache), and the kernel writes
    the copies: the caller's tensors are untouched.
    """
    params, grads, slots = leaves
    out_p, out_s = list(params), {k: list(v) for k, v in slots.items()}
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for j, t in enumerate(params):
        groups.setdefault((t.device, t.dtype), []).append(j)
    for (device, _), idx in groups.items():
        rate = lr.to(device) if isinstance(lr, torch.Tensor) else lr
        cuts = [slice(None)] if donate else _lists.runs([params[j] for j in idx])
        for cut in cuts:
            at = idx[cut]
            p = [params[j] for j in at]
            s = {k: [v[j] for j in at] for k, v in slots.items()}
            if not donate:
                p, s = _copies(p), {k: _copies(v) for k, v in s.items()}
            kernel(p, [grads[j] for j in at], s, [steps[j] for j in at], rate)
            for dst, new in ((out_p, p), *((out_s[k], v) for k, v in s.items())):
                for j, t in zip(at, new, strict=True):
                    dst[j] = t
    return out_p, out_s


def _copies(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for t in ts]
    _compat.foreach_copy_(out, ts)
    return out
