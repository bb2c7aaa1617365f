"""Instructions per call of fdp.data_parallel on a tiny function, counted by valgrind.

Wall-clock timings of a ~50 us call swing by 2x on a shared 2-core VM; the
number of instructions the CPU executes does not. This script runs itself
under callgrind, dumps the counters around each variant's loop, and
reports instructions per call:

    python benchmarks/count_instructions.py            # about 3 minutes
    python benchmarks/count_instructions.py --stages   # also each stage alone

Variants: the direct call, the same two half batches by hand
(``split_with_sizes``, the function twice, ``torch.cat``: what splitting the
batch costs by itself), and ``data_parallel`` over two CPU replicas; then
the same with 63 more parameter leaves, for the cost of each leaf. With
``--stages``, the stages data_parallel runs for these arguments, one at a
time (each includes freeing what it made).
On this VM one instruction of this workload takes about 0.3 ns, so 100k
instructions are about 30 us (the overhead target of issue 24).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import fdp

VARIANTS = ["none", "direct", "hand", "data_parallel", "direct_64", "data_parallel_64"]
STAGES = ["devices", "scatter", "replicate", "apply", "gather"]


def variants() -> dict[str, Callable[[], Any]]:
    """The calls to count, on one tiny function and a batch of 8."""
    from fdp._device import as_devices
    from fdp._parallel_apply import parallel_apply_on
    from fdp._replicate import replicate_on
    from fdp._scatter_gather import cat_plain, split_plain

    params = {"w": torch.randn(4, requires_grad=True)}
    x = torch.randn(8, 4)
    devices = ["cpu", "cpu"]

    def tiny(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return x * p["w"]

    def hand() -> torch.Tensor:
        a, b = x.split_with_sizes([4, 4])
        return torch.cat([tiny(params, a), tiny(params, b)])

    # The same call with 63 more parameters the function does not read: the
    # overhead per leaf (a model's parameters are checked on every call).
    params_64 = {
        "w": params["w"],
        **{f"w{i}": torch.randn(4, requires_grad=True) for i in range(63)},
    }

    call = "fdp.data_parallel"
    devs = as_devices(devices, call=call)
    chunks = split_plain((x,), devs, 0)
    assert chunks is not None
    kws: list[dict[str, Any]] = [{}, {}]
    replicas = replicate_on(params, devs, call=call, copied_state=[])
    outputs = parallel_apply_on(tiny, replicas, chunks, kws, devs)
    return {
        "none": lambda: None,
        "direct": lambda: tiny(params, x),
        "hand": hand,
        "data_parallel": lambda: fdp.data_parallel(tiny, params, x, devices=devices),
        "direct_64": lambda: tiny(params_64, x),
        "data_parallel_64": lambda: fdp.data_parallel(tiny, params_64, x, devices=devices),
        "devices": lambda: as_devices(devices, call=call),
        "scatter": lambda: split_plain((x,), devs, 0),
        "replicate": lambda: replicate_on(params, devs, call=call, copied_state=[]),
        "apply": lambda: parallel_apply_on(tiny, replicas, chunks, kws, devs),
        "gather": lambda: cat_plain(outputs, devs[0], 0),
    }


def child(names: list[str], calls: int) -> None:
    """Runs each variant's loop between two calls of getppid (callgrind dumps before each)."""
    table = variants()
    for name in names:
        fn = table[name]
        for _ in range(200):  # warm-up: allocator, freelists, lazy imports
            fn()
        os.getppid()
        for _ in range(calls):
            fn()
        os.getppid()


def count(names: list[str], calls: int) -> dict[str, float]:
    """Instructions per call of each variant, minus the empty loop's."""
    if shutil.which("valgrind") is None:
        sys.exit("count_instructions.py needs valgrind (apt install valgrind)")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cg"
        command = [
            "valgrind",
            "--tool=callgrind",
            f"--callgrind-out-file={out}",
            "--dump-before=getppid",
            "--dump-instr=no",
            sys.executable,
            __file__,
            "--child",
            ",".join(names),
            "--calls",
            str(calls),
        ]
        subprocess.run(command, check=True, capture_output=True)
        totals = []
        for dump in sorted(Path(tmp).glob("cg.*"), key=lambda p: int(p.suffix[1:])):
            match = re.search(r"^summary: (\d+)", dump.read_text(), re.MULTILINE)
            totals.append(int(match.group(1)) if match else 0)
    # Dump 1 is the start-up; then each variant gives its loop (even) and its warm-up (odd).
    if len(totals) < 2 * len(names):
        sys.exit(f"expected {2 * len(names)} callgrind dumps, got {len(totals)}")
    per_call = {name: totals[2 * i + 1] / calls for i, name in enumerate(names)}
    empty = per_call.pop("none")
    return {name: n - empty for name, n in per_call.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", action="store_true", help="also each stage alone")
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--quick", action="store_true", help="300 calls per variant")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child.split(","), args.calls)
        return
    if args.quick:
        args.calls = 300
    names = VARIANTS + (STAGES if args.stages else [])
    got = count(names, args.calls)
    print(f"torch {torch.__version__}, instructions per call (callgrind, {args.calls} calls)")
    for name, n in got.items():
        print(f"  {name:14s} {n / 1e3:8.1f}k")
    over = got["data_parallel"] - got["direct"]
    floor = got["hand"] - got["direct"]
    ratio = got["data_parallel"] / got["hand"]
    print(
        f"data_parallel over the direct call: {over / 1e3:.1f}k instructions "
        f"(by hand: {floor / 1e3:.1f}k; data_parallel / hand {ratio:.2f}x)"
    )
    per_leaf = (got["data_parallel_64"] - got["direct_64"] - over) / 63
    print(f"each further parameter leaf: {per_leaf:.0f} instructions per call")


if __name__ == "__main__":
    main()
