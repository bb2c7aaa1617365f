"""The main example's training step: ``data_parallel`` over 2 CPU replicas vs a plain loop.

``examples/train_digits.py`` (``nox -s train``) steps a 64-256-256-10 MLP
with Adam on batches of 128 digits. Here one step of it, with the forward
through ``fdp.data_parallel(devices=["cpu", "cpu"])``, is timed side by
side with the same step calling the model directly (a plain
single-process loop), at 1 and at 2 intra-op threads, and optionally with
a CPU-burning process beside it (``--loaded``: a shared machine). The
issue 24 target: data_parallel within 1.2x of the plain loop whatever the
thread setting. A third variant calls the model on the same two half
batches by hand: what splitting the batch costs by itself (small matrix
products, twice the operator calls), which no data parallelism avoids.

    python benchmarks/bench_train.py [--quick] [--loaded]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
from pathlib import Path
from typing import Any

import results
import torch
import torch.nn.functional as F
from timing import interleaved

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from train_digits import init_params, load_data, mlp, replicated_loss


def _burn() -> None:  # pragma: no cover (a child process)
    while True:
        pass


def step_fns(batch: int) -> tuple[Any, Any, Any]:
    """One Adam step of the example: through data_parallel, directly, on two chunks by hand."""
    x, y, _, _ = load_data(0)
    x, y = x[:batch], y[:batch]

    def make(loss_of: Any) -> Any:
        params = init_params([64, 256, 256, 10], device="cpu", generator=torch.Generator())
        leaves = [t for layer in params["layers"] for t in layer.values()]
        opt = torch.optim.Adam(leaves, lr=3e-3)

        def step() -> None:
            loss = loss_of(params)
            opt.zero_grad(set_to_none=True)
            torch.autograd.backward(loss)
            opt.step()

        return step

    replicas = make(lambda p: replicated_loss(p, x, y, ["cpu", "cpu"]))
    plain = make(lambda p: F.cross_entropy(mlp(p, x), y))
    halves = make(lambda p: F.cross_entropy(torch.cat([mlp(p, c) for c in x.chunk(2)]), y))
    return replicas, plain, halves


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--loaded", action="store_true", help="a CPU-burning process beside")
    args = parser.parse_args()
    rounds = 5 if args.quick else 11
    burner = mp.Process(target=_burn, daemon=True) if args.loaded else None
    if burner is not None:
        burner.start()
    figures: dict[str, float] = {}
    try:
        print(f"torch {torch.__version__}, {'one CPU burner beside' if burner else 'no load'}")
        for threads in (1, 2):
            torch.set_num_threads(threads)
            replicas, plain, halves = step_fns(128)
            fns = {"dp": replicas, "plain": plain, "halves": halves}
            t = interleaved(fns, rounds=rounds, repeats=20)
            print(
                f"train step, {threads} intra-op thread(s): data_parallel 2 CPU replicas "
                f"{1e3 * t['dp']:.2f} ms, plain loop {1e3 * t['plain']:.2f} ms -> "
                f"{t['dp'] / t['plain']:.3f}x (target <= 1.2x); the two half batches by hand "
                f"{t['halves'] / t['plain']:.3f}x, data_parallel / them "
                f"{t['dp'] / t['halves']:.3f}x"
            )
            figures[f"threads_{threads}.vs_plain"] = t["dp"] / t["plain"]
            figures[f"threads_{threads}.vs_halves"] = t["dp"] / t["halves"]
        results.record("bench_train", figures)
    finally:
        if burner is not None:
            burner.terminate()
            burner.join()


if __name__ == "__main__":
    main()
