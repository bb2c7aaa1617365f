"""What a replica group hands a peer that heals, and takes when it heals itself.

torchft's Manager calls ``save`` on a live replica group while a behind one
joins the quorum, sends the result through its checkpoint transport, and
calls ``load`` on the receiver. The state travels as its flattened leaves;
the receiver rebuilds its own tree from them (same structure on every
replica group), each tensor on the device and with the autograd flag of the
leaf it replaces, so the healed state is bitwise the peer's.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch

from fdp import _tree

__all__ = ["Healing"]

T = TypeVar("T")


class Healing:
    """The committed state offered to peers, and a peer's state received."""

    def __init__(self) -> None:
        self._offered: list[Any] = []
        self._received: list[Any] | None = None

    def offer(self, state: Any) -> None:
        """``state`` is what a peer healing in the next quorum receives."""
        leaves, _ = _tree.flatten(state)
        self._offered = [t.detach() if isinstance(t, torch.Tensor) else t for t in leaves]

    def save(self) -> dict[str, Any]:
        return {"leaves": list(self._offered)}

    def load(self, state_dict: dict[str, Any]) -> None:
        self._received = list(state_dict["leaves"])

    def take(self, state: T, *, call: str) -> T:
        """``state``, or the peer's state received during the quorum, in ``state``'s form."""
        received, self._received = self._received, None
        if received is None:
            return state
        leaves, spec = _tree.flatten(state)
        if len(received) != len(leaves):
            raise ValueError(
                f"{call}: `state` expected the tree of the peer it heals from; got "
                f"{len(leaves)} leaves here and {len(received)} on the peer"
            )
        healed = [
            _like(call, state, i, mine, theirs)
            for i, (mine, theirs) in enumerate(zip(leaves, received, strict=True))
        ]
        return _tree.unflatten(spec, healed)  # type: ignore[no-any-return]


def _like(call: str, state: Any, i: int, mine: Any, theirs: Any) -> Any:
    """The peer's leaf on this leaf's device, with its autograd flag."""
    if not isinstance(mine, torch.Tensor):
        return theirs
    if (
        not isinstance(theirs, torch.Tensor)
        or theirs.shape != mine.shape
        or (theirs.dtype != mine.dtype)
    ):
        raise ValueError(
            f"{call}: `state` leaf {_tree.path(state, i, 'state')} expected what the peer "
            f"holds there, {_tree.describe(theirs)}; got {_tree.describe(mine)}"
        )
    out = theirs.to(mine.device, copy=theirs.device == mine.device)
    return out.requires_grad_(mine.requires_grad) if mine.is_leaf else out
