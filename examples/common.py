"""What the examples share: arguments, launching, rank-0 logging, progress, outputs.

Copy this file next to your own script: ``launch`` joins the process group
torchrun describes (``fdp.init_distributed``: this rank's device, threads,
a group that survives ``torchrun --max-restarts``), ``log`` prints once (on
rank 0), and ``Progress`` shows a bar on a terminal but only a few lines in
a log file. Outputs (checkpoints, plots) go under ``runs/<example>/``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

import fdp

RUNS = Path("runs")


def parser(
    doc: str | None, name: str, *, plot: str = "loss.png", what: str = "the loss curve"
) -> argparse.ArgumentParser:
    """An argument parser whose ``--help`` shows every default, with ``--plot``."""
    parser = argparse.ArgumentParser(
        description=(doc or "").splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    path = RUNS / name / plot
    parser.add_argument(
        "--plot",
        nargs="?",
        const=str(path),
        default=None,
        metavar="PNG",
        help=f"write {what} to PNG (the flag alone: {path})",
    )
    return parser


def add_digits_args(parser: argparse.ArgumentParser, *, batch: str) -> None:
    """The digits MLP's training options, shared by its three examples."""
    parser.add_argument("--epochs", type=int, default=40, help="passes over the training set")
    parser.add_argument("--batch-size", type=int, default=128, help=batch)
    parser.add_argument("--lr", type=float, default=3e-3, help="learning rate")
    parser.add_argument("--hidden", type=int, default=256, help="hidden layer width")
    parser.add_argument("--seed", type=int, default=0, help="data split, initialisation")


def add_launch_args(parser: argparse.ArgumentParser) -> None:
    """``--backend`` (gloo on the CPU, nccl on cuda:LOCAL_RANK) and ``--timeout``."""
    parser.add_argument(
        "--backend",
        default="gloo",
        choices=["gloo", "nccl"],
        help="gloo: every rank on the CPU; nccl: rank LOCAL_RANK on cuda:LOCAL_RANK",
    )
    parser.add_argument("--timeout", type=float, default=120.0, help="collective timeout, s")


def add_checkpoint_args(parser: argparse.ArgumentParser, name: str, every: int) -> None:
    """``--checkpoint-dir``, ``--checkpoint-every``, ``--resume``."""
    directory = RUNS / name / "checkpoints"
    parser.add_argument(
        "--checkpoint-dir", type=Path, default=directory, help="where step_N checkpoints go"
    )
    parser.add_argument("--checkpoint-every", type=int, default=every, help="in steps")
    parser.add_argument("--resume", action="store_true", help="from the newest checkpoint")


def launch(args: argparse.Namespace, script: str) -> torch.device:
    """Joins torchrun's process group; returns this rank's device."""
    if "RANK" not in os.environ:
        sys.exit(f"launch with torchrun, e.g. torchrun --standalone --nproc_per_node=2 {script}")
    timeout = datetime.timedelta(seconds=args.timeout)
    return fdp.init_distributed(args.backend, timeout=timeout)


def is_main() -> bool:
    """Rank 0, or the only process."""
    return not dist.is_initialized() or dist.get_rank() == 0


def log(message: str) -> None:
    """Prints once per job (rank 0), above a progress bar if one is showing."""
    if is_main():
        tqdm.write(message, file=sys.stdout)
        sys.stdout.flush()


def resume_from(args: argparse.Namespace) -> Path | None:
    """The checkpoint ``--resume`` continues from (the same on every rank), said in the log."""
    if not args.resume:
        return None
    found = fdp.latest_checkpoint(args.checkpoint_dir)  # rank 0's pick, on every rank
    if found is None:
        log(f"--resume: no complete checkpoint in {args.checkpoint_dir}; starting fresh")
        return None
    log(f"--resume: continuing from {found}")
    return Path(found)


class Progress:
    """Training progress on rank 0: a tqdm bar on a terminal, else one line per tenth.

    ``step(samples)`` counts the samples of the global batch just trained;
    ``show(loss=...)`` puts the figures and the throughput (samples/s since
    the start) on the bar, or prints them when the line is due.
    """

    def __init__(self, steps: range, *, unit: str, lines: int = 10) -> None:
        self.steps = steps
        self.unit = unit
        self.terminal = is_main() and sys.stderr.isatty()
        self.bar: tqdm[int] = tqdm(steps, unit=unit, disable=not self.terminal)
        self.every = max(1, len(steps) // lines)
        self.next_line = self.every  # a line once this many steps are done, and at the end
        self.samples = 0
        self.start = time.perf_counter()
        self.done = 0

    def __iter__(self) -> Iterator[int]:
        for index in self.bar:
            yield index
            self.done += 1

    def step(self, samples: int) -> None:
        self.samples += samples

    @property
    def rate(self) -> float:
        """Samples per second since the start."""
        return self.samples / max(time.perf_counter() - self.start, 1e-9)

    def show(self, **figures: Any) -> None:
        text = {k: f"{v:.4f}" if isinstance(v, float) else str(v) for k, v in figures.items()}
        text["samples/s"] = f"{self.rate:.0f}"
        if self.terminal:
            self.bar.set_postfix(text)
            return
        position = self.done + 1
        if is_main() and (position >= self.next_line or position == len(self.steps)):
            self.next_line = (position // self.every + 1) * self.every
            figures_text = ", ".join(f"{k} {v}" for k, v in text.items())
            print(f"{self.unit} {self.steps[self.done] + 1}/{self.steps.stop}: {figures_text}")
            sys.stdout.flush()


def save_plot(
    values: list[float], path: str, *, title: str, xlabel: str = "epoch", first: int = 1
) -> None:
    """Writes a training-loss curve (log scale) to a PNG, making its folder."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig: Any
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(range(first, first + len(values)), values)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("training loss (cross-entropy)")
    ax.set_yscale("log")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    log(f"loss curve written to {path}")
