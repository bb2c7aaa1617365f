"""The caches fdp keeps between calls, and how to release them."""

from __future__ import annotations

from fdp import _collectives, _parallel_apply

__all__ = ["clear_caches"]


def clear_caches() -> None:
    """Releases what fdp keeps between calls.

    ``all_reduce_grads`` keeps up to 8 plans, one per (tree signature,
    bucket cap, process group), each with its flat buffers (as large as the
    gradients, on their device), so that a training loop plans once and
    reuses its buffers. ``parallel_apply`` remembers which compiled functions
    it has already called once. Neither changes results; clearing them frees
    the buffers (once no result still views them), and the next call plans
    again. ``DistributedDataParallel`` keeps its own buffers, released with
    the object.

    Example:
        >>> import fdp
        >>> fdp.clear_caches()
    """
    _collectives.clear_plans()
    _parallel_apply.forget_compiled()
