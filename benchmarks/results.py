"""The benchmark figures the README and the guides quote, kept in one JSON.

    python3 -m nox -s bench                 # every script records into results.json
    python benchmarks/results.py --write    # the pages' figures, rewritten from it
    python benchmarks/results.py            # checks the pages against it (as the tests do)

A benchmark run with ``FDP_BENCH_RESULTS=<path>`` in its environment (``nox -s
bench`` sets it to ``benchmarks/results.json``) records its headline figures
under its script's name, with the command, the date and torch's version. A
page quotes one as an HTML comment naming it, right before the number:
``<!--fig:bench_zero.zero2_vs_torch-->**1.02x**``. The number shows as many
decimals as the page writes; ``--write`` rewrites it from the JSON and the
check fails on any that differs, so two pages cannot quote one figure twice
apart, nor a page a figure no run produced. docs/performance.md's list of the
runs (between ``RUNS_BEGIN`` and ``RUNS_END``) is written the same way.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results.json"
ENV = "FDP_BENCH_RESULTS"
NUMBER = r"(?P<number>-?\d+(?:\.(?P<decimals>\d+))?(?:(?P<e>e)-?\d+)?)"
FIGURE = re.compile(r"<!--fig:(?P<key>[\w.]+)-->(?P<lead>[*+~]*)" + NUMBER)
RUNS_BEGIN = "<!-- benchmark runs: written by benchmarks/results.py --write -->"
RUNS_END = "<!-- end of benchmark runs -->"


def record(script: str, figures: Mapping[str, float]) -> None:
    """Records ``figures`` under ``script`` when ``FDP_BENCH_RESULTS`` names a file."""
    path = os.environ.get(ENV)
    if not path:
        return
    import torch

    results = load(Path(path)) if Path(path).is_file() else {}
    results[script] = {
        "command": " ".join(["python", f"benchmarks/{script}.py", *sys.argv[1:]]),
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "figures": {name: float(f"{value:.4g}") for name, value in sorted(figures.items())},
    }
    Path(path).write_text(json.dumps(dict(sorted(results.items())), indent=1) + "\n")
    print(f"recorded {len(figures)} figures of {script} in {path}")


def slug(name: str) -> str:
    """A printed name as a key: ``fdp ZeRO-2, donate=True`` -> ``fdp_zero_2_donate_true``."""
    return "_".join(re.findall(r"[a-z0-9]+", name.lower()))


def load(path: Path = RESULTS) -> dict[str, Any]:
    """The recorded runs: ``{script: {command, date, torch, figures}}``."""
    loaded: dict[str, Any] = json.loads(path.read_text())
    return loaded


def pages(root: Path = ROOT) -> list[Path]:
    """The pages that may quote figures: the README and every guide."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def value(results: Mapping[str, Any], key: str) -> float:
    """The figure ``script.name`` of ``results``; a clear error when none was recorded."""
    script, _, name = key.partition(".")
    figures = results.get(script, {}).get("figures", {})
    if name not in figures:
        raise KeyError(f"a page quotes {key}, which no run recorded in {RESULTS.name}")
    number: float = figures[name]
    return number


def runs_block(results: Mapping[str, Any]) -> str:
    """docs/performance.md's list of the runs the quoted figures come from."""
    rows = [f"| `{run['command']}` | {run['date']} | {run['torch']} |" for run in results.values()]
    table = ["| command | date | torch |", "| --- | --- | --- |", *rows]
    return "\n".join([RUNS_BEGIN, *table, RUNS_END])


def render(text: str, results: Mapping[str, Any]) -> str:
    """``text`` with every quoted figure (and the list of runs) written from ``results``."""

    def written(match: re.Match[str]) -> str:
        decimals = len(match["decimals"] or "")
        number = f"{value(results, match['key']):.{decimals}{match['e'] or 'f'}}"
        number = re.sub(r"e([+-])0*(\d)", lambda e: f"e{e[1].strip('+')}{e[2]}", number)
        return f"<!--fig:{match['key']}-->{match['lead']}{number}"

    text = FIGURE.sub(written, text)
    if RUNS_BEGIN in text:
        start, end = text.index(RUNS_BEGIN), text.index(RUNS_END) + len(RUNS_END)
        text = text[:start] + runs_block(results) + text[end:]
    return text


def stale(results: Mapping[str, Any], root: Path = ROOT) -> list[str]:
    """The pages whose figures differ from ``results``, by name."""
    return [
        str(page.relative_to(root))
        for page in pages(root)
        if render(page.read_text(), results) != page.read_text()
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the pages' figures")
    args = parser.parse_args()
    results = load()
    if args.write:
        for page in pages():
            text = page.read_text()
            if (new := render(text, results)) != text:
                page.write_text(new)
                print(f"wrote {page.relative_to(ROOT)}")
        return
    differ = stale(results)
    if differ:
        sys.exit(f"figures differ from {RESULTS.name} in: {', '.join(differ)} (run --write)")
    print(f"every quoted figure is the one in {RESULTS.name}")


if __name__ == "__main__":
    main()
