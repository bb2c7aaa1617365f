"""The layers of docs/design.md, as folders, checked on fdp's import graph.

The single-process core is the flat ``fdp/_*.py``; the communication
building blocks live in ``fdp/_comm/``, DDP in ``fdp/_ddp/``, ZeRO, fully
sharded parameters and checkpoints in ``fdp/_sharding/``, the functional
optimizers in ``fdp/optim/``. Which layer a module belongs to is where its
file is; what each layer may import is the table below. A module-level
``from fdp... import ...`` is an edge; an import inside a function (asked
for by an option) is not.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.helpers import benchmark_script

FDP = Path(__file__).resolve().parent.parent / "fdp"
LAYERS = {
    "_compat": "core",  # private torch APIs, a package of topic modules
    "_comm": "comm",
    "_ddp": "ddp",
    "_sharding": "sharding",
    "optim": "optim",
    "_ft": "ft",
}
# What each layer's modules may import (besides their own layer).
ALLOWED = {
    "core": set(),
    "comm": {"core"},
    "optim": {"core", "comm"},
    "ddp": {"core", "comm"},
    "sharding": {"core", "comm", "optim"},
    "ft": {"core", "comm", "optim"},
}


def modules() -> dict[str, Path]:
    """Every module but the public surface: dotted name (``fdp._comm._groups``) to file."""
    found = {}
    for path in sorted(FDP.rglob("*.py")):
        parts = path.relative_to(FDP.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if name != "fdp":
            found[name] = path
    return found


MODULES = modules()


def layer(name: str) -> str:
    parts = name.split(".")
    return LAYERS[parts[1]] if len(parts) > 2 or parts[1] in LAYERS else "core"


def module_imports(name: str) -> set[str]:
    """The fdp modules ``name`` imports at module level."""
    found: set[str] = set()
    for node in ast.parse(MODULES[name].read_text()).body:
        if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith("fdp"):
            continue
        for alias in node.names:
            target = f"{node.module}.{alias.name}"
            found.add(target if target in MODULES else str(node.module))
    return {m for m in found if m in MODULES and m != name}


def closure(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo.extend(module_imports(name))
    return seen - {start}


def test_every_folder_is_a_layer() -> None:
    folders = {p.name for p in FDP.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(LAYERS)
    assert {layer(m) for m in MODULES} == set(ALLOWED)


def test_each_layer_imports_only_the_layers_below_it() -> None:
    wrong = sorted(
        f"{name} ({layer(name)}) -> {dep} ({layer(dep)})"
        for name in MODULES
        for dep in closure(name)
        if layer(dep) != layer(name) and layer(dep) not in ALLOWED[layer(name)]
    )
    assert wrong == []


def test_the_core_imports_nothing_distributed() -> None:
    core = [m for m in MODULES if layer(m) == "core"]
    assert {m: closure(m) for m in core if any(layer(d) != "core" for d in closure(m))} == {}


def test_the_graph_has_no_cycle() -> None:
    assert [name for name in MODULES if name in closure(name)] == []


def test_no_private_helper_is_used_across_modules() -> None:
    """A module uses another's names without a leading underscore: those are its API."""
    crossings = []
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text())
        imported = set()
        for node in tree.body:
            if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith("fdp"):
                continue
            for alias in node.names:
                if f"{node.module}.{alias.name}" in MODULES:
                    imported.add(alias.asname or alias.name)
                elif alias.name.startswith("_") and not alias.name.startswith("__"):
                    crossings.append(f"{name}: from {node.module} import {alias.name}")
        for inner in ast.walk(tree):
            if (
                isinstance(inner, ast.Attribute)
                and isinstance(inner.value, ast.Name)
                and inner.value.id in imported
                and inner.attr.startswith("_")
                and not inner.attr.startswith("__")
            ):
                crossings.append(f"{name}: {inner.value.id}.{inner.attr}")
    assert crossings == []


def test_only_mode_asks_whether_a_transform_or_a_dual_tensor_is_involved() -> None:
    # The second question has one home (docs/design.md): a module that asks
    # _compat itself would answer it its own way again.
    asks = ("_compat.functorch_active(", "_compat.has_tangent(", "_compat.is_transformed(")
    askers = [n for n, p in MODULES.items() if any(q in p.read_text() for q in asks)]
    assert askers == ["fdp._mode"]


def test_every_eager_and_traced_pair_uses_one_naming_scheme() -> None:
    # ``@_mode.traced_as(_name_traced)`` on ``def name``: go-to-definition lands on code.
    pattern = re.compile(r"@_mode\.traced_as\((\w+)\)\n\s*def (\w+)\(")
    pairs = [m.groups() for p in MODULES.values() for m in pattern.finditer(p.read_text())]
    assert len(pairs) > 20
    assert [(t, n) for t, n in pairs if t != f"_{n.lstrip('_')}_traced"] == []
    by_mode = [n for n, p in MODULES.items() if "_mode.by_mode(" in p.read_text()]
    assert by_mode == ["fdp._comm._differentiable"]  # a Collective builds its forms


def test_design_md_shows_the_structure_as_it_is() -> None:
    # Its figures were written by hand and fell behind (55 modules, 186 edges
    # when there were 61 and 210): now benchmarks/structure.py writes them.
    root = Path(__file__).resolve().parent.parent
    structure = benchmark_script("structure")
    text = (root / "docs" / "design.md").read_text()
    shown = text[text.index(structure.BEGIN) : text.index(structure.END) + len(structure.END)]
    expected = structure.design_block(structure.static_figures())
    assert shown == expected, "run: python benchmarks/structure.py --write-design"


def test_every_note_referred_to_is_defined_once() -> None:
    # Notes are named (``Note [late gradients]: ...``) so code can point at them.
    root = Path(__file__).resolve().parent.parent
    texts = [p.read_text() for p in (root / "fdp").rglob("*.py")]
    named = [n for t in texts for n in re.findall(r"Note \[([^\]]+)\]:", t)]
    referred = {n for t in texts for n in re.findall(r"Note \[([^\]]+)\]", t)}
    assert len(named) >= 10
    assert sorted(set(named)) == sorted(named), "a note defined twice"
    assert referred <= set(named), referred - set(named)
    unnamed = [t.count("Note: ") + t.count("# Note:") for t in texts]
    assert sum(unnamed) == 0, "a Note without a [name]"


def test_only_one_module_imports_torchft_and_only_when_called() -> None:
    """torchft is an optional extra: ``import fdp`` never imports it."""
    importing = {
        n for n, p in MODULES.items() if re.search(r"^\s*import torchft", p.read_text(), re.M)
    }
    assert importing == {"fdp._ft._torchft"}
    top_level = re.search(
        r"^import torchft|^from torchft", MODULES["fdp._ft._torchft"].read_text(), re.M
    )
    assert top_level is None
