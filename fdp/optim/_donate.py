"""Donated steps (``update(..., donate=True)``): the leaves that must not be written in place.

Written in place, memory that two leaves hold (tied weights, or ZeRO's
pieces of one tensor) would be stepped twice; :func:`untied` copies all but
the first, so each is stepped once, from the same values, as the pure step
steps each leaf.
"""

from __future__ import annotations

from typing import Any

import torch

from fdp import _mode


def _untied_traced(p: list[Any], live: list[int]) -> list[Any]:
    """:func:`untied` by identity only: dynamo cannot read data pointers."""
    out = list(p)
    seen: set[int] = set()
    for i in live:
        if id(p[i]) in seen:
            out[i] = _copy(p[i])
        seen.add(id(p[i]))
    return out


@_mode.traced_as(_untied_traced)
def untied(p: list[Any], live: list[int]) -> list[Any]:
    """``p`` with a copy at every leaf whose memory another leaf holds (tied weights).

    Written in place, memory at two leaves would be stepped twice; the copy
    is stepped once, from the same values, as the pure step steps each leaf
    (and, as there, the results are no longer tied). Overlap is judged by
    the span of addresses (ZeRO's pieces of one tensor at two leaves need
    not have the same shape), in one sweep over the sorted spans.
    """
    out = list(p)
    spans = sorted((_span(p[i]), i) for i in live if p[i].numel())
    end = -1
    for (start, stop), i in spans:
        if start < end:
            out[i] = _copy(p[i])
        end = max(end, stop)
    return out


def _span(t: torch.Tensor) -> tuple[int, int]:
    extent = sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride(), strict=True)) + 1
    return t.data_ptr(), t.data_ptr() + extent * t.element_size()


def _copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone(memory_format=torch.preserve_format).requires_grad_(t.requires_grad)
