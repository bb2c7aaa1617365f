"""What ``import fdp`` costs on top of ``import torch``, in fresh interpreters.

    python benchmarks/bench_import.py          # 11 rounds
    python benchmarks/bench_import.py --quick  # 5 rounds

Each round starts two fresh interpreters, in alternating order: one imports
torch alone, the other torch and then fdp, timing each import inside the
process. Reported: medians of torch's import, of fdp's on top of it, and
of the two together against torch alone (a ratio, side by side in one
run). Target: fdp adds at most 0.3 s. Also printed: whether ``import fdp``
loaded ``torch._dynamo`` or ``torch.distributed.checkpoint`` (seconds each;
fdp imports them when first compiling or checkpointing).

Imports read bytecode, as from an installed package: the interpreters
write and read theirs under a temporary ``PYTHONPYCACHEPREFIX``, warmed by
one untimed round, whatever the environment's own bytecode or
``PYTHONDONTWRITEBYTECODE`` (without bytecode, each import compiles its
sources: torch's took 3.2 s here, not 1.4 s).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import results

PROBE = """
import json, sys, time
start = time.perf_counter()
import torch
torch_s = time.perf_counter() - start
fdp_s = None
if {with_fdp}:
    start = time.perf_counter()
    import fdp
    fdp_s = time.perf_counter() - start
heavy = ["torch._dynamo", "torch.distributed.checkpoint"]
loaded = [m for m in heavy if m in sys.modules]
print(json.dumps({{"torch": torch_s, "fdp": fdp_s, "loaded": loaded}}))
"""


def probe(with_fdp: bool, env: dict[str, str]) -> dict[str, object]:
    code = PROBE.format(with_fdp=with_fdp)
    command = [sys.executable, "-c", code]
    done = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
    out: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 rounds")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env["PYTHONPYCACHEPREFIX"] = cache
        probe(True, env)  # writes the bytecode
        measure(5 if args.quick else 11, env)


def measure(rounds: int, env: dict[str, str]) -> None:
    alone, both, extra = [], [], []
    loaded: list[object] = []
    for r in range(rounds):
        order = [False, True] if r % 2 == 0 else [True, False]
        for with_fdp in order:
            got = probe(with_fdp, env)
            torch_s = float(got["torch"])  # type: ignore[arg-type]
            if with_fdp:
                fdp_s = float(got["fdp"])  # type: ignore[arg-type]
                both.append(torch_s + fdp_s)
                extra.append(fdp_s)
                loaded = list(got["loaded"])  # type: ignore[call-overload]
            else:
                alone.append(torch_s)
    t, e, b = statistics.median(alone), statistics.median(extra), statistics.median(both)
    print(f"python {sys.version.split()[0]}, medians of {len(alone)} fresh interpreters each")
    print(f"  import torch:                 {t:6.2f} s")
    print(f"  import fdp after it:          {e:6.2f} s   (target <= 0.30 s)")
    print(f"  torch and fdp / torch alone:  {b / t:6.2f}x")
    print(f"  heavy modules import fdp loaded: {loaded or 'none'}")
    results.record("bench_import", {"fdp_s": e, "torch_s": t, "both_vs_torch": b / t})


if __name__ == "__main__":
    main()
