"""Runs an example under torchrun and SIGKILLs one rank right after its first checkpoint.

``python tests/kill_after_checkpoint.py RANK examples/train_x.py ARGS...``
(as torchrun's entry point): on the first attempt
(``TORCHELASTIC_RESTART_COUNT`` 0), rank ``RANK`` dies by SIGKILL as soon as
its first ``fdp.save_checkpoint`` returns, so the checkpoint is complete and
the step is known whatever the machine's speed; later attempts run the
example untouched.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
from pathlib import Path
from typing import Any

import fdp


def main() -> None:
    victim, script, *args = sys.argv[1:]
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if first_attempt and int(os.environ["RANK"]) == int(victim):
        save = fdp.save_checkpoint

        def save_then_die(*a: Any, **k: Any) -> None:
            save(*a, **k)
            os.kill(os.getpid(), signal.SIGKILL)

        fdp.save_checkpoint = save_then_die
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
