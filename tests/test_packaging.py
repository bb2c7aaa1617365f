"""The declared ranges agree with the range sessions' lists: pyproject.toml, noxfile.py, README.

What this checks: each Python classifier is a version in ``nox -s
python_range``'s list, the torch floor is the first release in ``nox -s
torch_range``'s, and the README's "Tested" line names exactly those; the
test group's pins (constraints.txt) give each declared Python one version of
each package that allows it, and the versions installed here support every
Python their markers select (so each python_range run checks its own pins).
What it does not: run them. CI runs the default sessions (the suite on this
machine's Python and torch); the range sessions take an hour and download
each torch, so they are run by hand before a release or a change to the
ranges, and each issue's resolution note says which of them ran and what
they gave.
"""

from __future__ import annotations

import ast
import os
import pathlib
import re
import subprocess
import sys
from importlib import metadata

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

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


def _test_group() -> list[Requirement]:
    """The test dependency group's own requirements (not the groups it includes)."""
    found = re.search(r"^test = (\[.*?^\])", PYPROJECT, re.M | re.S)
    assert found is not None, "pyproject.toml has no test group"
    listed = re.sub(r"\{[^}]*\}", "None", found.group(1))  # include-group tables
    return [Requirement(r) for r in ast.literal_eval(re.sub(r"#.*", "", listed)) if r]


def _pins() -> list[Requirement]:
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    return [Requirement(line) for line in lines if line.strip() and not line.startswith("#")]


def _environment(python: str) -> dict[str, str]:
    return {"python_version": python, "python_full_version": f"{python}.0"}


def _selects(requirement: Requirement, python: str) -> bool:
    """Whether ``requirement``'s marker (if any) applies on ``python`` ("3.10")."""
    return requirement.marker is None or requirement.marker.evaluate(_environment(python))


@pytest.mark.parametrize("python", _nox_list("PYTHON_RANGE"))
def test_each_declared_python_has_one_pin_per_test_requirement_that_allows_it(python: str) -> None:
    # transformers 5.21+ needs Python 3.11: one unmarked pin made 3.10's install fail.
    pins = _pins()
    wanted = [r for r in _test_group() if _selects(r, python)]
    names = [canonicalize_name(r.name) for r in wanted]
    assert len(names) == len(set(names)), f"Python {python}: two requirements for one package"
    for requirement in wanted:
        applying = [
            p for p in pins
            if canonicalize_name(p.name) == canonicalize_name(requirement.name)
            and _selects(p, python)
        ]  # fmt: skip
        assert len(applying) <= 1, f"Python {python}: {requirement.name} pinned twice"
        for pin in applying:
            (exact,) = pin.specifier
            assert requirement.specifier.contains(exact.version), (python, requirement, pin)


def test_each_installed_pin_supports_every_declared_python_its_marker_selects() -> None:
    # Run on each Python of python_range, this covers every pin: transformers
    # 5.24 requires Python 3.11, so an unmarked pin left 3.10 uninstallable.
    if os.environ.get("FDP_UNPINNED"):
        pytest.skip("nox -s torch_range installs without constraints.txt, another torch")
    this = f"{sys.version_info.major}.{sys.version_info.minor}"
    declared = _nox_list("PYTHON_RANGE")
    checked = 0
    for pin in _pins():
        if not _selects(pin, this):
            continue
        try:
            installed = metadata.distribution(pin.name)
        except metadata.PackageNotFoundError:
            continue  # an optional test package: its tests skip
        (exact,) = pin.specifier
        assert installed.version.split("+")[0] == exact.version, (pin, installed.version)
        supports = SpecifierSet(installed.metadata["Requires-Python"] or "")
        selected = [v for v in declared if _selects(pin, v)]
        assert [v for v in selected if f"{v}.0" not in supports] == [], (str(pin), str(supports))
        checked += 1
    assert checked >= 5
