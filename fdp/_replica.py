"""Which replica of a ``parallel_apply`` call is running, and what it leaves for afterwards.

A module's forward may change the module's own Python attributes (a step
counter, a toggle choosing the next branch). One call on the whole batch
changes them once; replicas must not change them once each, nor see one
another's changes while they run. So ``make_functional``'s function, when it
runs as a replica, hands its changes to :func:`defer` instead of applying
them: replica 0's are applied once every replica has finished, the others'
are dropped (DataParallel's rule for state, as for buffers). Outside a
replica the changes are applied at once, as a module call would.

The state is a :class:`contextvars.ContextVar`, set only for the duration of
one replica's call: nothing outlives the call.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

__all__ = ["Deferred", "defer", "enter", "leave", "running"]


class Deferred:
    """What replica 0 left to do once every replica of a call has finished."""

    __slots__ = ("actions",)

    def __init__(self) -> None:
        self.actions: list[Callable[[], None]] = []

    def apply(self) -> None:
        actions, self.actions = self.actions, []
        for action in actions:
            action()


_current: contextvars.ContextVar[tuple[int, Deferred] | None] = contextvars.ContextVar(
    "fdp_replica", default=None
)


@contextlib.contextmanager
def running(index: int, deferred: Deferred) -> Iterator[None]:
    """Marks the current thread as running replica ``index`` until the block ends."""
    token = enter(index, deferred)
    try:
        yield
    finally:
        leave(token)


def enter(index: int, deferred: Deferred) -> contextvars.Token[tuple[int, Deferred] | None]:
    """:func:`running` without a context manager (a few microseconds a replica less)."""
    return _current.set((index, deferred))


def leave(token: contextvars.Token[tuple[int, Deferred] | None]) -> None:
    """Ends what :func:`enter` began."""
    _current.reset(token)


def defer(action: Callable[[], None]) -> None:
    """Runs ``action`` now outside a replica, after the call for replica 0, never for others."""
    current = _current.get()
    if current is None:
        action()
    elif current[0] == 0:
        current[1].actions.append(action)
