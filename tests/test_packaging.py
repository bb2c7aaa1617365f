"""The declared ranges agree with the range sessions' lists: pyproject.toml, noxfile.py, README.

What this checks: each Python classifier is a version in ``nox -s
python_range``'s list, the torch floor is the first release in ``nox -s
torch_range``'s, and the README's "Tested" line names exactly those. What it
does not: run them. CI runs the default sessions (the suite on this
machine's Python and torch); the range sessions take an hour and download
each torch, so they are run by hand before a release or a change to the
ranges, and each issue's resolution note says which of them ran and what
they gave.
"""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _nox_list(name: str) -> list[str]:
    """A module-level list of strings in noxfile.py (read, not imported: nox is a dev tool)."""
    for node in ast.parse((ROOT / "noxfile.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            value = ast.literal_eval(node.value)
            assert isinstance(value, list)
            return [str(v) for v in value]
    raise AssertionError(f"noxfile.py has no {name}")


def _pyproject(key: str) -> str:
    """The text of ``key = ...`` in pyproject.toml (a regex: tomllib is not in Python 3.10)."""
    found = re.search(rf"^{re.escape(key)} = (.*?)$(?=\n\S)", PYPROJECT, re.M | re.S)
    assert found is not None, f"pyproject.toml has no {key}"
    return found.group(1)


PYPROJECT = (ROOT / "pyproject.toml").read_text()


def test_declared_pythons_are_the_ones_in_python_range_s_list() -> None:
    declared = re.findall(r'"Programming Language :: Python :: (3\.\d+)"', PYPROJECT)
    assert declared == _nox_list("PYTHON_RANGE")
    assert _pyproject("requires-python") == f'">={declared[0]}"'


def test_the_torch_floor_is_the_first_release_in_torch_range_s_list() -> None:
    dependencies = ast.literal_eval(_pyproject("dependencies"))
    (torch,) = [d for d in dependencies if d.startswith("torch")]
    floor = _nox_list("TORCH_RANGE")[0]
    assert torch == f"torch>={floor.removesuffix('.0')}"


@pytest.mark.parametrize("name", ["TORCH_RANGE", "PYTHON_RANGE"])
def test_the_readme_names_every_tested_version(name: str) -> None:
    readme = (ROOT / "README.md").read_text()
    tested = re.search(r"^Tested: .*?\n\n", readme, re.M | re.S)
    assert tested is not None, "README.md has no 'Tested:' paragraph"
    text = " ".join(tested.group(0).split())
    for version in _nox_list(name):
        assert version in text, f"README's Tested paragraph lacks {version}"


def test_import_fdp_leaves_the_compiler_and_checkpoints_unloaded() -> None:
    # Both cost seconds (issue 46: import fdp took 3.7 s against torch's 1.5 s);
    # fdp loads them when it first compiles or checkpoints.
    code = (
        "import sys, torch, fdp\n"
        "print(sorted(m for m in ('torch._dynamo', 'torch.distributed.checkpoint') "
        "if m in sys.modules))\n"
        "opt = fdp.optim.sgd(0.5)\n"
        "f = torch.compile(lambda p: opt.update(p, opt.init(p), p)[0], backend='eager')\n"
        "print(f({'x': torch.ones(2)})['x'].tolist())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.splitlines() == ["[]", "[0.5, 0.5]"]
