"""What ``fdp.load_checkpoint`` reads: each of ``like``'s entries against the checkpoint's.

Each entry of ``like`` must be in the checkpoint with the same global shape
(a ``ZeroState`` slot and an unsharded optimizer state load into each
other, :func:`match`); and by default every entry the checkpoint holds must
be read (:func:`check_unread`): a checkpoint whose entries ``like`` lacks
would otherwise load part of a training state without a word.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any, Protocol

import torch

from fdp._sharding._per_rank import MARK

RNG = "_fdp/rng/"
# A ZeroState's layout record: read when a ZeroState loads, else informational.
ORDERS = ".memory_orders"


class Owner(Protocol):
    """A leaf of `like` that may read an entry saved in another shape."""

    def reshaped(self, key: str, saved: Any) -> tuple[torch.Tensor, Callable[[], None]] | None: ...


def _tensor_metadata() -> Any:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return TensorStorageMetadata


def match(
    call: str, entries: dict[str, Any], metadata: dict[str, Any], owners: Mapping[str, Owner]
) -> list[Callable[[], None]]:
    """Checks each entry against the checkpoint; reshapes ZeRO <-> unsharded entries.

    A ``ZeroState`` slot is saved as the leaf's elements, 1-D; an unsharded
    optimizer state's as the leaf. Either loads into the other (a DDP run
    resumed with ZeRO, or ZeRO consolidated into one process); returns what
    to run after the load.
    """
    after = []
    for key in [k for k, v in entries.items() if v is None]:
        saved = metadata.get(key)
        if saved is None:
            del entries[key]  # a None leaf: nothing to read (a ZeroState saves none)
        elif isinstance(saved, _tensor_metadata()):
            # None gives no shape: the checkpoint's, in a new CPU tensor (a DiLoCo
            # state's reduction in flight, where a fresh state's slot is None).
            entries[key] = torch.empty(tuple(saved.size), dtype=saved.properties.dtype)
    for key, value in list(entries.items()):
        saved = metadata.get(key)
        if not (isinstance(value, torch.Tensor) and isinstance(saved, _tensor_metadata())):
            continue
        reshaped = None
        if tuple(saved.size) != tuple(value.size()):
            reshaped = owners[key].reshaped(key, saved)
        if reshaped is not None:
            entries[key], fill = reshaped
            after.append(fill)
    _check_present(call, entries, metadata)
    return after


def _check_present(call: str, entries: dict[str, Any], metadata: dict[str, Any]) -> None:
    """Each entry is in the checkpoint, a tensor of the same global shape where expected."""
    for key, value in entries.items():
        saved = metadata.get(key)
        if saved is None:
            raise ValueError(
                f"{call}: `like` leaf like{key} is not in the checkpoint; it holds "
                f"{sorted(k for k in metadata if not k.startswith(RNG))[:20]}"
            )
        if not isinstance(value, torch.Tensor) and isinstance(saved, _tensor_metadata()):
            raise ValueError(
                f"{call}: `like` leaf like{key} holds {type(value).__name__} {value!r:.40}; the "
                f"checkpoint holds a tensor of shape {tuple(saved.size)} there (pass a tensor)"
            )
        if isinstance(value, torch.Tensor):
            if not isinstance(saved, _tensor_metadata()):
                raise ValueError(
                    f"{call}: `like` leaf like{key} expected a tensor; the checkpoint holds "
                    "a Python value there"
                )
            if tuple(saved.size) != tuple(value.size()):
                raise ValueError(
                    f"{call}: `like` leaf like{key} expected shape {tuple(value.size())}; "
                    f"the checkpoint holds shape {tuple(saved.size)}"
                )


def check_unread(call: str, path: str, entries: Collection[str], metadata: dict[str, Any]) -> None:
    """Raises if the checkpoint holds entries that ``like`` has no leaf for (fdp's own aside)."""
    unread = sorted(
        k for k in metadata if k not in entries and not k.startswith(RNG) and not k.endswith(ORDERS)
    )
    if unread:
        ranked = next((k for k in unread if MARK in k), None)
        raise ValueError(
            f"{call}: the checkpoint at `path` {path!r} holds {len(unread)} entries that `like` "
            f"has no leaf for: {unread[:10]}{' ...' if len(unread) > 10 else ''}; give `like` "
            "those leaves (a torch optimizer: the Optimizer itself or its state_dict(), which "
            "load whole), or pass strict=False to load the rest without them"
            + (
                ""
                if ranked is None
                else f" ({ranked.partition(MARK)[0]} was saved in "
                "fdp.PerRank, each rank's own: put an fdp.PerRank there in `like`)"
            )
        )
