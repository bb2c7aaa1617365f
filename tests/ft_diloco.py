"""DiLoCo across the replica groups of ``tests/ft_replica.py --diloco``.

Without ``--streaming``: tests/test_diloco.py's DiLoCo, ``STEPS`` inner
steps. With ``--streaming``: tests/test_streaming_diloco.py's two fragments
(``--overlap`` tau: its ``"overlap"`` case, alpha 0.5); the inner steps go
on until the state's count reaches ``STEPS`` (a group that heals takes its
peer's count). Each synchronising update runs in ``FaultTolerance.step``;
the others are local.

The drill (``--kill-at K --killer R``, streaming only): replica group R dies
in the first update at or after count K that lands a fragment (its
reduction in flight, the quorum formed with R in it); then every
synchronising update appends ``{"count", "committed", "n", "pid"}`` to
``ledger-R``, and the groups stop together after the first committed
landing at or past ``STEPS`` that all took part in, once a sync after the
kill ran without R (``shrunk`` in the state, healed with it), and with no
reduction in flight. The final state goes to ``final-R.pt``.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from typing import Any

import torch

import fdp
from tests import test_diloco as case
from tests import test_streaming_diloco as streaming


def algorithm(ft: fdp.FaultTolerance, args: argparse.Namespace) -> fdp.DiLoCo:
    if not args.streaming:
        return case.algorithm("diloco", group=ft)
    opts = streaming.options("overlap" if args.overlap else "fragments")
    opts["overlap"] = args.overlap
    return fdp.DiLoCo(
        fdp.optim.adamw(0.05, weight_decay=0.01), sync_every=streaming.H, group=ft, **opts
    )


def run(ft: fdp.FaultTolerance, args: argparse.Namespace, kill: Callable[[], None]) -> None:
    alg, params = algorithm(ft, args), case.init_params()
    state: dict[str, Any] = {"params": params, "opt": alg.init(params), "shrunk": 0}
    steps = streaming.STEPS if args.streaming else case.STEPS
    drill = args.kill_at >= 0
    ledger = (args.dir / f"ledger-{args.replica}").open("a")
    seen: dict[str, int] = {}

    def update(s: dict[str, Any]) -> dict[str, Any]:
        """One inner step from ``s`` (a healed state's own count and data position)."""
        count = seen["count"] = int(s["opt"]["count"]) + 1
        seen["step"] = ft.current_step() if alg.syncs(s["opt"]) else -1
        landing = any(
            e["started"] >= 0 and e["started"] + alg.overlap == count for e in s["opt"]["in_flight"]
        )
        dies = args.replica == args.killer and not args.restarted
        if drill and dies and landing and count >= args.kill_at:
            kill()
        grads = case.grads_of("grad", s["params"], *case.batch(count - 1, args.replica))
        params, opt = alg.update(grads, s["opt"], s["params"])
        after = drill and count > args.kill_at and ft.participants() < args.replicas
        return {"params": params, "opt": opt, "shrunk": s["shrunk"] + int(after)}

    while drill or int(state["opt"]["count"]) < steps:
        if not alg.syncs(state["opt"]):
            state = update(state)
            continue
        state = ft.step(update, state)
        committed = ft.current_step() > seen["step"]
        n = ft.participants()
        record = {"count": seen["count"], "committed": committed, "n": n, "pid": os.getpid()}
        ledger.write(json.dumps(record) + "\n")
        ledger.flush()
        idle = all(slot["started"] < 0 for slot in state["opt"]["in_flight"])
        done = committed and seen["count"] >= steps and n == args.replicas and idle
        if drill and done and state["shrunk"] > 0:
            break
    torch.save(state, args.dir / f"final-{args.replica}.pt")
    ledger.write("done\n")
    ledger.close()
    ft.shutdown()
