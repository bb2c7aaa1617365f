"""The example scripts' own error paths (their training runs are ``nox -s examples``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a build or machine without CUDA")
def test_cuda_devices_without_cuda_fail_with_fdps_device_error() -> None:
    """The README's ``--devices cuda:0,cuda:1`` on a CPU-only machine: fdp's error, not torch's."""
    done = subprocess.run(
        [sys.executable, "examples/train_digits.py", "--devices", "cuda:0,cuda:1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError: fdp.replicate: `devices[0]` is cuda:0 but CUDA is not")
    assert "AssertionError" not in done.stderr
