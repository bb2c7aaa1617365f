"""Session-wide fixtures and markers.

The spawned gloo worlds are shut down at the end. Every test that runs on
several processes, directly or through a helper of its module, gets the
``distributed`` marker (``-m distributed`` / ``-m "not distributed"``),
found on the module's call graph: a function that calls ``ranks.world``, or
calls one that does.
"""

from __future__ import annotations

import ast
import functools
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import ranks

# torchft's Rust servers read RUST_LOG once, when torchft is imported (while
# tests are collected): at its default, every quorum logs at info into the output.
os.environ.setdefault("RUST_LOG", "warn")


@pytest.fixture(scope="session", autouse=True)
def _close_worlds() -> Iterator[None]:
    yield
    ranks.close_all()


@functools.cache
def _multi_process_functions(path: Path) -> frozenset[str]:
    """Names of the module's functions that reach ``ranks.world``."""
    tree = ast.parse(path.read_text())
    calls: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            names = set()
            for inner in ast.walk(node):
                if (
                    isinstance(inner, ast.Attribute)
                    and inner.attr == "world"
                    and isinstance(inner.value, ast.Name)
                    and inner.value.id == "ranks"
                ):
                    names.add("<world>")
                elif isinstance(inner, ast.Name):
                    names.add(inner.id)
            calls[node.name] = names
    reach = {name for name, names in calls.items() if "<world>" in names}
    while True:
        more = {name for name, names in calls.items() if names & reach} - reach
        if not more:
            return frozenset(reach)
        reach |= more


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        function = getattr(item, "function", None)
        if function is not None and function.__name__ in _multi_process_functions(item.path):
            item.add_marker(pytest.mark.distributed)
