"""The caches fdp keeps between calls: a registry the modules that keep one append to."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["clear_caches", "register"]

_CLEARERS: list[Callable[[], None]] = []


def register(clear: Callable[[], None]) -> Callable[[], None]:
    """Adds ``clear`` to what :func:`clear_caches` calls (a decorator; returns ``clear``)."""
    _CLEARERS.append(clear)
    return clear


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
    for clear in _CLEARERS:
        clear()
