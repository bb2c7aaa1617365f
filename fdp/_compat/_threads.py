"""Thread-local state a worker thread does not inherit (dispatch keys, modes, saved-tensor
hooks): whether replicas may run on threads.

Part of :mod:`fdp._compat` (its docstring says how each function degrades).
"""

from __future__ import annotations

import threading

import torch


def _dispatch_key_sets() -> tuple[str, str]:
    # If these go, return a value unlike a fresh thread's: replicas then loop.
    return (
        repr(torch._C._dispatch_tls_local_include_set()),
        repr(torch._C._dispatch_tls_local_exclude_set()),
    )


_fresh_sets: list[tuple[str, str]] = []


def _fresh_thread_key_sets() -> tuple[str, str]:
    """The dispatch key sets of a new thread (measured once, on a new thread)."""
    if not _fresh_sets:
        thread = threading.Thread(target=lambda: _fresh_sets.append(_dispatch_key_sets()))
        thread.start()
        thread.join()
    return _fresh_sets[0]


def default_device_modes() -> list[torch.device] | None:
    """The devices of the active ``torch.device`` contexts, outermost first.

    ``None`` when any other torch function mode is active: such modes (and
    every dispatch mode) hold state a worker thread cannot share safely.
    If ``_get_current_function_mode_stack`` goes, return ``None`` (loop).
    """
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._device import DeviceContext

    devices: list[torch.device] = []
    for mode in _get_current_function_mode_stack():  # type: ignore[no-untyped-call]
        if not isinstance(mode, DeviceContext):
            return None
        devices.append(mode.device)
    return devices


def uncarried_thread_state(*, carried: bool) -> str | None:
    """Why replicas cannot run on worker threads, or ``None`` if they can.

    A new thread starts with torch's defaults. fdp carries grad mode,
    inference mode, autocast, ``torch.device`` contexts and the CUDA device
    and stream; anything else thread-local (dispatch modes such as
    ``FlopCounterMode``, other function modes, saved-tensor hooks such as
    ``save_on_cpu``, forward-mode AD switched off, any dispatch key set a
    guard changed) would reach replica 0 only, so replicas then run in a loop
    on the calling thread. ``carried``: grad/inference/autocast state differs
    from a new thread's and will be carried (the key-set comparison, which
    those states change, is skipped then). If a probe below goes, answer
    with a reason (loop): wrong threads are worse than a slower loop.
    """
    if torch._C._len_torch_dispatch_stack() > 0:
        return "a torch dispatch mode is active"
    if default_device_modes() is None:
        return "a torch function mode is active"
    if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        return "saved-tensor hooks are active"
    if not carried:
        if not torch._C._is_fwd_grad_enabled():
            return "forward-mode AD is disabled"
        if _dispatch_key_sets() != _fresh_thread_key_sets():
            return "the dispatch key sets differ from a new thread's"
    return None
