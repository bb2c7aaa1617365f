"""Device arguments: one normalisation shared by every fdp entry point."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Union

import torch

from fdp import _mode

DeviceLike = Union[torch.device, str, int]  # noqa: UP007 (a runtime alias, py3.10)
"""A device as users write it: ``torch.device``, ``"cuda:1"``, ``"cpu"``, or a CUDA index."""


_CPU = torch.device("cpu")


def as_device(device: object, *, call: str, arg: str) -> torch.device:
    """Normalises one device argument; ``-1`` means CPU, a bare int a CUDA index."""
    if isinstance(device, torch.device) and device == _CPU:
        return device  # already normalised (the common case, checked first)
    if device == "cpu":  # the next most common: CPU replicas
        return _CPU
    # bool is an int subclass; True silently meaning cuda:1 would be a trap.
    if isinstance(device, bool) or not isinstance(device, (torch.device, str, int)):
        raise TypeError(
            f"{call}: `{arg}` expected a torch.device, a device string such as 'cuda:1' "
            f"or 'cpu', or a CUDA index; got {device!r} of type {type(device).__name__}"
        )
    if isinstance(device, int):
        if device == -1:
            return torch.device("cpu")
        if device < 0:
            raise ValueError(
                f"{call}: `{arg}` expected a CUDA index >= 0 or -1 for the CPU; got {device}"
            )
        return _available(torch.device("cuda", device), call=call, arg=arg)
    try:
        dev = torch.device(device)
    except RuntimeError as err:
        raise ValueError(f"{call}: `{arg}` is not a device: got {device!r} ({err})") from None
    if dev.type == "cpu":
        # Every CPU tensor reports plain "cpu"; "cpu:1" is the same memory.
        return torch.device("cpu")
    dev = _available(dev, call=call, arg=arg)
    index: int | None = dev.index
    if index is None and dev.type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return dev


def _available(dev: torch.device, *, call: str, arg: str) -> torch.device:
    """``dev`` itself, if this torch build and machine have it.

    Not asked while dynamo traces: it cannot trace ``torch.cuda.device_count``
    (a non-tensor result; ``fullgraph=True`` raised on CUDA replicas). The
    eager call, which compiling starts from, has checked the same devices.
    """
    if _mode.traced():
        return dev
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(
                f"{call}: `{arg}` is {dev} but CUDA is not available (torch "
                f"{torch.__version__}, built with CUDA {torch.version.cuda}); expected a device "
                "of this machine, such as 'cpu'"
            )
        if dev.index is not None and dev.index >= count:
            raise ValueError(
                f"{call}: `{arg}` is {dev} but this machine has {count} CUDA device(s); "
                f"expected an index below {count}"
            )
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(
            f"{call}: `{arg}` is {dev} but MPS is not available on this machine; "
            "expected a device of this machine, such as 'cpu'"
        )
    return dev


def all_cpu(devices: list[torch.device]) -> bool:
    """Whether every device (normalised by :func:`as_device`) is the CPU."""
    # No d.type (0.6 us); a loop, as all()'s generator costs as much as the test.
    for d in devices:  # noqa: SIM110 (see above)
        if d != _CPU:
            return False
    return True


def default_devices() -> list[torch.device]:
    """Every CUDA device, else one CPU replica (as DataParallel, plus the CPU)."""
    if torch.cuda.is_available():
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return [torch.device("cpu")]


def as_devices(devices: object, *, call: str, arg: str = "devices") -> list[torch.device]:
    """Normalises a device list; ``None`` means :func:`default_devices`. Repeats are kept."""
    if devices is None:
        return default_devices()
    if type(devices) is list and devices:
        # The common case, CPU replicas, without building an argument name per entry.
        for d in devices:
            if not (d == "cpu" or (type(d) is torch.device and d == _CPU)):
                break
        else:
            return [_CPU] * len(devices)
    if type(devices) is not list and (  # a list, the common case, skips the ABC check
        isinstance(devices, (str, torch.device, int)) or not isinstance(devices, Sequence)
    ):
        raise TypeError(
            f"{call}: `{arg}` expected a sequence of devices such as ['cuda:0', 'cuda:1'] "
            f"or ['cpu', 'cpu']; got {devices!r} of type {type(devices).__name__}"
        )
    if len(devices) == 0:
        raise ValueError(f"{call}: `{arg}` expected at least one device; got an empty sequence")
    return [as_device(d, call=call, arg=f"{arg}[{i}]") for i, d in enumerate(devices)]
