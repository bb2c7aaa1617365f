"""The module layers of docs/design.md, checked on fdp's import graph.

Three layers: the single-process core imports nothing distributed; the
building blocks (groups, the psum-rule collectives, agreement checks, comm
hooks, sync batch norm) import neither DDP nor sharding; DDP and sharding
do not import each other. A module-level ``from fdp import ...`` is an
edge, an import inside a function (asked for by an option) is not.
"""

from __future__ import annotations

import ast
from pathlib import Path

FDP = Path(__file__).resolve().parent.parent / "fdp"

CORE = {
    "_data_parallel",
    "_functional",
    "_replica",
    "_scatter_gather",
    "_batch",
    "_replicate",
    "_parallel_apply",
    "_device",
    "_tree",
    "_bucket",
    "_compat",
    "_optim",
    "_optim_rules",
    "_param_groups",
    "_clip",
    "_caches",
}
# The building blocks: buckets' collectives, agreement, hooks, sync batch norm.
BLOCKS = {
    "_groups",
    "_transforms",
    "_agreement",
    "_comm_hooks",
    "_sync_batch_norm",
    "_training",
    "_collectives",
    "_launch",
}
DDP = {
    "_ddp",
    "_ddp_arming",
    "_ddp_reducer",
    "_ddp_sparse",
    "_ddp_traced",
    "_ddp_buffers",
    "_ddp_join",
}
SHARDING = {
    "_zero",
    "_zero_comm",
    "_zero_join",
    "_zero_shards",
    "_checkpoint",
    "_fsdp",
    "_fsdp_chain",
    "_fsdp_gather",
    "_fsdp_optim",
    "_fsdp_plan",
    "_fsdp_prefetch",
    "_fsdp_reshard",
    "_fsdp_state",
}
DISTRIBUTED = BLOCKS | DDP | SHARDING


def module_imports(name: str) -> set[str]:
    """The fdp modules ``fdp/<name>.py`` imports at module level."""
    tree = ast.parse((FDP / f"{name}.py").read_text())
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module == "fdp":
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fdp."):
            found.add((node.module or "").removeprefix("fdp."))
    return found


def closure(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name in seen or not (FDP / f"{name}.py").exists():
            continue
        seen.add(name)
        todo.extend(module_imports(name))
    return seen - {start}


def test_the_core_imports_nothing_distributed() -> None:
    reached = {name: closure(name) & DISTRIBUTED for name in sorted(CORE)}
    assert {k: v for k, v in reached.items() if v} == {}


def test_the_building_blocks_serve_ddp_and_sharding_without_importing_them() -> None:
    reached = {name: closure(name) & (DDP | SHARDING) for name in sorted(BLOCKS)}
    assert {k: v for k, v in reached.items() if v} == {}


def test_ddp_and_sharding_do_not_import_each_other() -> None:
    reached = {name: closure(name) & SHARDING for name in sorted(DDP)}
    reached |= {name: closure(name) & DDP for name in sorted(SHARDING)}
    assert {k: v for k, v in reached.items() if v} == {}


def test_every_module_is_in_a_layer() -> None:
    modules = {p.stem for p in FDP.glob("_*.py")} - {"__init__"}
    others = {"_grad_scaler", "_version"}  # public glue that may reach both layers
    assert modules == CORE | DISTRIBUTED | others


def test_the_graph_has_no_cycle() -> None:
    for name in {p.stem for p in FDP.glob("_*.py")} - {"__init__"}:
        assert name not in closure(name), name


def test_no_private_helper_is_used_across_modules() -> None:
    """A module uses another's names without a leading underscore: those are its API."""
    crossings = []
    for path in sorted(FDP.glob("*.py")):
        tree = ast.parse(path.read_text())
        modules = set()
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module == "fdp":
                modules |= {alias.asname or alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fdp._"):
                crossings += [
                    f"{path.name}: from {node.module} import {a.name}"
                    for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")
                ]
        for inner in ast.walk(tree):
            if (
                isinstance(inner, ast.Attribute)
                and isinstance(inner.value, ast.Name)
                and inner.value.id in modules
                and inner.attr.startswith("_")
                and not inner.attr.startswith("__")
            ):
                crossings.append(f"{path.name}: {inner.value.id}.{inner.attr}")
    assert crossings == []
