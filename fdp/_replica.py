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

import contextvars
from collections.abc import Callable
from typing import TypeAlias

__all__ = ["Deferred", "defer", "enter", "leave", "run", "running"]


Deferred: TypeAlias = "list[Callable[[], None]]"
"""What replica 0 left to do once every replica of a call has finished (a plain list: cheap)."""


def run(deferred: Deferred) -> None:
    """Runs what replica 0 deferred, in order."""
    for action in deferred:
        action()


_current: contextvars.ContextVar[tuple[int, Deferred] | None] = contextvars.ContextVar(
    "fdp_replica", default=None
)


# Replica ``index`` of a call runs between ``token = enter((index, deferred))``
# and ``leave(token)``: the context variable's own methods, since a Python
# function around them costs as much as the rest of a tiny replica's bookkeeping.
enter = _current.set
leave = _current.reset


def running() -> bool:
    """Whether a replica of a ``parallel_apply`` call is running in this context."""
    return _current.get() is not None


def defer(action: Callable[[], None]) -> None:
    """Runs ``action`` now outside a replica, after the call for replica 0, never for others."""
    current = _current.get()
    if current is None:
        action()
    elif current[0] == 0:
        current[1].append(action)
