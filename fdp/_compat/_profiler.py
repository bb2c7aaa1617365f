"""The autograd profiler: whether it records now.

Part of :mod:`fdp._compat` (its docstring says how each function degrades).
"""

from __future__ import annotations

import torch


def profiling() -> bool:
    """Whether the autograd profiler records now (``record_function`` labels show)."""
    # If the flag goes, label always (the cost of a label, never a missing one).
    return bool(getattr(torch.autograd.profiler, "_is_profiler_enabled", True))
