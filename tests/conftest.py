"""Session-wide fixtures: the spawned gloo worlds are shut down at the end."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests import ranks


@pytest.fixture(scope="session", autouse=True)
def _close_worlds() -> Iterator[None]:
    yield
    ranks.close_all()
