"""tests/ranks.py, the shared gloo worlds the multi-process tests run on."""

from __future__ import annotations

import pytest
import torch

from tests import ranks


def _unsendable(rank: int, size: int) -> torch.Tensor:
    return torch.ones(2, requires_grad=True) * (rank + 1)  # a non-leaf that requires grad


def _sendable(rank: int, size: int) -> list[float]:
    return (torch.ones(2, requires_grad=True) * (rank + 1)).detach().tolist()


def test_a_result_that_cannot_be_sent_back_fails_at_once_naming_the_function() -> None:
    """The queue pickles in a background thread and drops what it cannot send: without
    the worker's own check the caller would wait out its timeout (a TimeoutError)."""
    with pytest.raises(ranks.RankError, match=r"`_unsendable` returned a result that cannot"):
        ranks.world(2).run(_unsendable, timeout_s=120)
    assert ranks.world(2).run(_sendable) == [[1.0, 1.0], [2.0, 2.0]]  # a fresh world serves
