"""fdp's structure in figures: modules, function sizes, import edges, and what one step visits.

Static figures come from the source (``ast``): module sizes, functions over
50 lines of code, the import graph among fdp's modules (module-level
imports; an import inside a function is not an edge) and its depth, and the
modules that ask "is dynamo tracing?" (``is_compiling()``, ``_mode.traced()``)
and those that pair an eager and a traced form (``_mode.traced_as``), or call
``torch.distributed``'s collectives directly. Runtime figures come from two
gloo ranks: the fdp modules that one public collective and one
``data_parallel``, DDP, ZeRO and fully sharded step call into (rank 0,
``sys.setprofile``), in the order first entered, and how often the call
sequence moves from one module to another.

    python benchmarks/structure.py
    python benchmarks/structure.py --write-design   # docs/design.md's figures
"""

from __future__ import annotations

import ast
import datetime
import multiprocessing as mp
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
FDP = ROOT / "fdp"
COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
               "broadcast", "all_to_all_single", "reduce_scatter", "all_gather_object",
               "broadcast_object_list", "all_reduce_coalesced"}  # fmt: skip
# The question "is dynamo tracing?", however a module asks it.
ASKS = ("is_compiling()", "_mode.traced()", "compiling_a_transform()")


def modules() -> dict[str, Path]:
    """Dotted name (``fdp._tree``, ``fdp._ddp._reducer``) to file."""
    found = {}
    for path in sorted(FDP.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The fdp modules ``name`` imports at module level."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.parse(path.read_text()).body:
        if not isinstance(node, ast.ImportFrom):
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join([*anchor, base] if base else anchor)
        for alias in node.names:
            target = f"{base}.{alias.name}"
            found.add(target if target in known else base)
    return {m for m in found if m in known and m != name and m != "fdp"}


def code_lines(node: ast.FunctionDef | ast.AsyncFunctionDef, source: list[str]) -> int:
    """Lines of code of a function: no blank lines, comments or docstring."""
    body = getattr(node, "body", [])
    skip = set()
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        skip = set(range(body[0].lineno, (body[0].end_lineno or body[0].lineno) + 1))
    lines = range(node.lineno, (getattr(node, "end_lineno", None) or node.lineno) + 1)
    return sum(
        1
        for i in lines
        if i not in skip and source[i - 1].strip() and not source[i - 1].strip().startswith("#")
    )


def static_figures() -> dict[str, Any]:
    """The static figures (from the source alone, no process group)."""
    mods = modules()
    known = set(mods)
    sizes = {n: len(p.read_text().splitlines()) for n, p in mods.items()}
    long = []
    for n, p in mods.items():
        source = p.read_text().splitlines()
        functions = [
            node
            for node in ast.walk(ast.parse(p.read_text()))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        ]
        long += [(size, f"{n}:{f.name}") for f in functions if (size := code_lines(f, source)) > 50]
    graph = {n: imports(n, p, known) for n, p in mods.items()}
    text = {n: p.read_text() for n, p in mods.items()}
    return {
        "sizes": sizes,
        "long": sorted(long, reverse=True),
        "edges": sum(len(v) for v in graph.values()),
        "depth": depth(graph),
        "deciding": sorted(n for n, t in text.items() if any(q in t for q in ASKS)),
        "forms": sorted(
            n for n, t in text.items() if "_mode.traced_as(" in t or "_mode.by_mode(" in t
        ),
        "raw": sorted(n for n, t in text.items() if raw_collectives(t)),
    }


def static() -> None:
    f = static_figures()
    sizes = f["sizes"]
    print(f"modules: {len(sizes)}, {sum(sizes.values())} lines; largest:")
    for n in sorted(sizes, key=sizes.__getitem__, reverse=True)[:5]:
        print(f"  {sizes[n]:5d}  {n}")
    print(f"functions over 50 lines of code: {len(f['long'])}")
    for size, where in f["long"]:
        print(f"  {size:5d}  {where}")
    print(f"import edges among fdp's modules: {f['edges']}")
    print(f"import depth (longest chain of modules): {f['depth']}")
    print(f"modules asking whether dynamo traces: {len(f['deciding'])}: {f['deciding']}")
    print(f"modules pairing an eager and a traced form (_mode.traced_as): {len(f['forms'])}")
    print(f"modules calling torch.distributed collectives directly: {len(f['raw'])}: {f['raw']}")


BEGIN, END = "<!-- structure.py: begin -->", "<!-- structure.py: end -->"


def design_block(f: dict[str, Any]) -> str:
    """docs/design.md's figures, as ``structure.py --write-design`` writes them."""
    sizes = f["sizes"]
    over = [n for n in sorted(sizes) if sizes[n] > 500]
    largest = max(sizes, key=sizes.__getitem__)
    return "\n".join([
        BEGIN,
        f"- {len(sizes)} modules, {sum(sizes.values()):,} lines; the largest "
        f"`{largest}` ({sizes[largest]}); over 500 lines: "
        f"{', '.join(f'`{n}` ({sizes[n]})' for n in over) or 'none'}",
        f"- functions over 50 lines of code: {len(f['long'])}",
        f"- {f['edges']} import edges among fdp's modules, depth {f['depth']}",
        f"- {len(f['deciding'])} modules ask whether dynamo traces; {len(f['forms'])} hand "
        "two forms to `_mode.traced_as`",
        f"- {len(f['raw'])} modules call `torch.distributed` collectives directly",
        END,
    ])  # fmt: skip


def write_design(path: Path = ROOT / "docs" / "design.md") -> None:
    text = path.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    path.write_text(text[:start] + design_block(static_figures()) + text[end:])
    print(f"wrote the figures into {path}")


def depth(graph: dict[str, set[str]]) -> int:
    memo: dict[str, int] = {}

    def longest(n: str) -> int:
        if n not in memo:
            memo[n] = 1 + max((longest(m) for m in graph[n]), default=0)
        return memo[n]

    return max(longest(n) for n in graph)


def raw_collectives(source: str) -> bool:
    for node in ast.walk(ast.parse(source)):
        func = node.func if isinstance(node, ast.Call) else None
        if not isinstance(func, ast.Attribute) or func.attr not in COLLECTIVES:
            continue
        if isinstance(func.value, ast.Name) and func.value.id == "dist":
            return True
    return False


def trace(step: Callable[[], Any]) -> tuple[list[str], int]:
    """The fdp modules ``step`` calls into, first-entered order, and module-to-module moves."""
    order: list[str] = []
    moves, last = 0, None
    prefix = str(FDP) + "/"

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal moves, last
        if event != "call" or not frame.f_code.co_filename.startswith(prefix):
            return
        name = frame.f_code.co_filename[len(str(ROOT)) + 1 : -3].replace("/", ".")
        name = name.removesuffix(".__init__")
        if name not in order:
            order.append(name)
        if name != last:
            moves += last is not None
            last = name

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return order, moves


def mlp(p: list[dict[str, torch.Tensor]], x: torch.Tensor) -> torch.Tensor:
    for layer in p[:-1]:
        x = torch.relu(x @ layer["w"] + layer["b"])
    return x @ p[-1]["w"] + p[-1]["b"]


def steps(rank: int) -> dict[str, Callable[[], Any]]:
    import fdp

    g = torch.Generator().manual_seed(0)
    shapes = [(32, 64), (64, 64), (64, 10)]
    params = [
        {
            "w": torch.randn(*s, generator=g).requires_grad_(),
            "b": torch.zeros(s[1]).requires_grad_(),
        }
        for s in shapes
    ]
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
    ddp = fdp.DistributedDataParallel(params, bucket_cap_mb=0.01)
    fsdp = fdp.FullyShardedDataParallel({str(i): layer for i, layer in enumerate(params)})
    shards = fsdp.shard({str(i): layer for i, layer in enumerate(params)})

    def ddp_step() -> None:
        torch.autograd.backward(torch.nn.functional.cross_entropy(mlp(ddp(params), x), y))

    def fsdp_step() -> None:
        mine = {k: tuple(t.detach().requires_grad_() for t in ts) for k, ts in shards.items()}
        h = x
        for i in range(len(params)):
            last = i == len(params) - 1

            def layer(p: dict[str, torch.Tensor], h: torch.Tensor, last: bool = last) -> Any:
                out = h @ p["w"] + p["b"]
                return out if last else torch.relu(out)

            h = fsdp.apply(mine, str(i), layer, h)
        torch.autograd.backward(torch.nn.functional.cross_entropy(h, y))

    zero = fdp.ZeroRedundancy(
        fdp.optim.adamw(1e-3), [{k: t.detach() for k, t in layer.items()} for layer in params]
    )
    plain = [{k: t.detach() for k, t in layer.items()} for layer in params]
    opt = zero.init(plain)

    def zero_step() -> None:
        grads = torch.func.grad(lambda p: torch.nn.functional.cross_entropy(mlp(p, x), y))(plain)
        zero.step(grads, opt, plain)

    def data_parallel_step() -> None:
        out = fdp.data_parallel(mlp, params, x, devices=["cpu", "cpu"])
        torch.autograd.backward(torch.nn.functional.cross_entropy(out, y))

    def collective_step() -> None:
        h = x.detach().requires_grad_()
        torch.autograd.backward(fdp.all_gather(h).square().sum())  # and its reduce-scatter

    return {
        "one public collective (fdp.all_gather, forward and backward)": collective_step,
        "one data_parallel step (2 CPU replicas)": data_parallel_step,
        "one eager DDP step": ddp_step,
        "one ZeRO step (AdamW)": zero_step,
        "one FSDP step (apply per unit)": fsdp_step,
    }


def rank_main(rank: int, size: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
        timeout=datetime.timedelta(seconds=120),
    )  # fmt: skip
    for name, step in steps(rank).items():
        step()  # warm: first-call setup is not a step
        order, moves = trace(step)
        if rank == 0:
            print(f"{name}: {len(order)} modules, {moves} moves between modules")
            print("  " + " -> ".join(m.removeprefix("fdp.") for m in order))
    # Rank 0, slowed by the profiler, may still be in its last step: a rank
    # tearing gloo down under a peer's open collective aborts (seen 3 in 15).
    dist.barrier()
    dist.destroy_process_group()


def runtime() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(r, 2, port)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
        if p.exitcode != 0:
            raise SystemExit(f"a rank failed ({p.exitcode})")


if __name__ == "__main__":
    if "--write-design" in sys.argv:
        write_design()
    else:
        static()
        runtime()
