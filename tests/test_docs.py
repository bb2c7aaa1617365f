"""Every Python code block in README.md and docs/ runs, so the docs cannot rot.

A page's ``python`` blocks run in order, in one fresh interpreter, with the
environment torchrun would set for a one-process world (so a page may call
``torch.distributed.init_process_group``). Other blocks (``sh``, plain
output) are not run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ranks import free_port

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)


def python_blocks(page: Path) -> list[str]:
    return BLOCK.findall(page.read_text())


def test_the_pages_have_code() -> None:
    with_code = {p.name for p in PAGES if python_blocks(p)}
    prose_only = {"api.md", "guarantees.md", "performance.md"}  # signatures, tables, figures
    assert {p.name for p in PAGES} - prose_only <= with_code


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p)], ids=lambda p: p.name)
def test_code_blocks_run(page: Path, tmp_path: Path) -> None:
    script = tmp_path / f"{page.stem}.py"
    script.write_text("\n\n".join(python_blocks(page)))
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, timeout=240
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]


NAMED_TEST = re.compile(r"`(?:(test_\w+)\.py::)?(test_\w+?)(\*?)`")
DEFINED = re.compile(r"^def (test_\w+)\(", re.M)


def test_every_test_the_docs_name_exists() -> None:
    """A table row that cites a test cites one that exists (in that file, when named).

    Names of torch's own tests (docs/porting.md's left column and lists) are
    not fdp's: only cells that cite fdp's tests are checked, by the page's
    convention that those follow a ``|`` of a right-hand column.
    """
    files = {p.stem: DEFINED.findall(p.read_text()) for p in (ROOT / "tests").glob("test_*.py")}
    everywhere = {name for names in files.values() for name in names}
    missing = []
    for page in PAGES:
        for line in page.read_text().splitlines():
            cited = line.rsplit("|", 2)[-2] if line.count("|") >= 3 else ""
            for file, name, star in NAMED_TEST.findall(cited):
                pool = files.get(file, []) if file else everywhere
                ok = any(n.startswith(name) for n in pool) if star else name in pool
                if not ok:
                    missing.append(f"{page.name}: {file + '.py::' if file else ''}{name}{star}")
    assert not missing, missing


def test_api_reference_is_current() -> None:
    """docs/api.md is what ``python tests/apiref.py`` writes from today's docstrings."""
    from tests import apiref

    assert apiref.PAGE.read_text() == apiref.render(), "run: python tests/apiref.py"


def test_api_reference_covers_every_public_name() -> None:
    import fdp
    import fdp.optim

    page = (ROOT / "docs" / "api.md").read_text()
    headings = set(re.findall(r"^### `([\w.]+)`$", page, re.M))
    public = {f"fdp.{n}" for n in fdp.__all__} | {f"fdp.optim.{n}" for n in fdp.optim.__all__}
    assert public == headings
    assert "(undocumented)" not in page


def test_version_is_the_installed_distribution() -> None:
    from importlib.metadata import version

    import fdp

    assert fdp.__version__ == version("fdp")
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", fdp.__version__)
