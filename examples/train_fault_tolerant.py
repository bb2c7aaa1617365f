"""Train the digits MLP on replica groups that survive losing one (fdp.FaultTolerance, torchft).

Every replica group (here one process each) trains the same model on its
share of each global batch; ``fdp.FaultTolerance`` averages the gradients
over the replica groups that are alive at that step (torchft's lighthouse
forms the quorum), and a step counts only if every live one commits it. A
replica group that dies costs the others one discarded step, not a
restart; when it comes back it takes a live peer's training state
(parameters, AdamW state with its schedule, the data position) and steps
with them again.

    python examples/train_fault_tolerant.py --drill   # lighthouse + 3 groups, a kill, a restart

``--drill`` runs the whole job on this machine: a lighthouse, three replica
groups, a SIGKILL of group 1 at step ``--kill-at``, its restart, and the
same run without the kill for comparison; its last line is one JSON object.
On a cluster, start ``torchft_lighthouse --min_replicas 2`` once and each
replica group with ``--lighthouse http://HOST:29510 --replica R``:
docs/fault_tolerance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import common
import optree
import torch
from train_digits import Params, load_data, mlp
from train_diloco import cross_entropy, init_params

import fdp

HERE = Path(__file__).resolve().parent


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = common.parser(__doc__, "fault_tolerant")
    parser.add_argument("--drill", action="store_true", help="run the whole drill locally")
    parser.add_argument("--lighthouse", help="a replica group: the lighthouse's http://host:port")
    parser.add_argument("--replica", type=int, help="a replica group: its index")
    parser.add_argument("--replicas", type=int, default=3, help="replica groups")
    parser.add_argument("--steps", type=int, default=300, help="committed steps at least")
    parser.add_argument("--kill-at", type=int, default=100, help="--drill: SIGKILL group 1 here")
    parser.add_argument("--batch-size", type=int, default=96, help="global batch")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW's peak learning rate")
    parser.add_argument("--hidden", type=int, default=128, help="hidden layer width")
    parser.add_argument("--seed", type=int, default=0, help="data split, initialisation")
    parser.add_argument("--out", type=Path, help="a replica group: where its results go")
    parser.add_argument(
        "--min-accuracy", type=float, default=0.9, help="exit 1 below this test accuracy"
    )
    return parser.parse_args(argv)


def init_state(args: argparse.Namespace) -> dict[str, Any]:
    params = init_params(args)  # the digits MLP of train_diloco.py, He-initialised
    return {"params": params, "opt": optimizer(args).init(params), "data": 0, "shrunk": 0}


def optimizer(args: argparse.Namespace) -> fdp.optim.Optimizer:
    schedule = fdp.optim.warmup_cosine_decay_schedule(0.0, args.lr, 20, 2 * args.steps)
    return fdp.optim.adamw(schedule, weight_decay=1e-4)


def replica(args: argparse.Namespace) -> int:
    """One replica group: steps until all groups took part in a step past ``--steps``."""
    started = time.perf_counter()
    x_train, y_train, _, _ = load_data(args.seed)
    ft = fdp.FaultTolerance.connect(
        args.lighthouse,
        replica_id=f"replica_{args.replica}",
        min_replicas=2,
        timeout=timedelta(seconds=30),
    )
    opt, state, info = optimizer(args), init_state(args), {}
    first_seconds = 0.0
    first = None

    def train_step(s: dict[str, Any]) -> dict[str, Any]:
        info["step"], info["n"] = ft.current_step(), ft.participants()
        order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(s["data"]))
        idx = order[: args.batch_size][args.replica :: args.replicas]  # this group's share
        grads = fdp.grad(cross_entropy)(s["params"], x_train[idx], y_train[idx])
        params, opt_state = opt.update(ft.all_reduce_grads(grads), s["opt"], s["params"])
        shrunk = s["shrunk"] + int(info["n"] < args.replicas)
        return {"params": params, "opt": opt_state, "data": s["data"] + 1, "shrunk": shrunk}

    with (args.out / f"progress-{args.replica}").open("a") as progress:
        while True:
            state = ft.step(train_step, state)
            if first is None:  # the first step this process ran: 0, or the one it healed into
                first, first_seconds = info["step"], time.perf_counter() - started
            progress.write(f"{ft.current_step()}\n")
            progress.flush()
            everyone = info["n"] == args.replicas and ft.current_step() >= args.steps
            if everyone and (state["shrunk"] > 0 or args.kill_at < 0):
                break
    torch.save(
        {
            "state": state,
            "first_step": first,
            "first_step_seconds": first_seconds,
            "step": ft.current_step(),
            "seconds": time.perf_counter() - started,
        },
        args.out / f"final-{args.replica}.pt",
    )
    ft.shutdown()
    return 0


def run_job(args: argparse.Namespace, out: Path, *, kill: bool) -> dict[str, Any]:
    """A lighthouse, ``--replicas`` groups, optionally the kill and restart of group 1."""
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(
        bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=2000, heartbeat_timeout_ms=1000
    )
    address = "http://127.0.0.1:" + server.address().rsplit(":", 1)[1]
    out.mkdir(parents=True, exist_ok=True)
    base = [sys.executable, str(HERE / Path(__file__).name), "--lighthouse", address]
    base += ["--out", str(out), "--steps", str(args.steps), "--replicas", str(args.replicas)]
    base += ["--kill-at", str(args.kill_at if kill else -1), "--seed", str(args.seed)]
    base += ["--batch-size", str(args.batch_size), "--hidden", str(args.hidden)]

    def start(r: int) -> subprocess.Popen[bytes]:
        with (out / f"log-{r}").open("ab") as log:
            return subprocess.Popen([*base, "--replica", str(r)], stdout=log, stderr=log)

    procs = {r: start(r) for r in range(args.replicas)}
    restarts = dict.fromkeys(procs, 0)
    try:
        if kill:
            _wait_for_step(out / "progress-1", args.kill_at, procs[1])
            procs[1].send_signal(signal.SIGKILL)
            procs[1].wait()
            procs[1], restarts[1] = start(1), 1
        codes = [procs[r].wait(timeout=600) for r in range(args.replicas)]
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        server.shutdown()
    if codes != [0] * args.replicas:
        raise SystemExit(f"replica groups exited with {codes}; logs in {out}")
    finals = [torch.load(out / f"final-{r}.pt", weights_only=False) for r in procs]
    return {"finals": finals, "restarts": restarts}


def _wait_for_step(progress: Path, step: int, proc: subprocess.Popen[bytes]) -> None:
    """Until the replica group has committed ``step`` (read from its progress file)."""
    while proc.poll() is None:
        lines = progress.read_text().split() if progress.exists() else []
        if lines and int(lines[-1]) >= step:
            return
        time.sleep(0.01)
    raise SystemExit(f"replica group 1 exited before step {step}")


def drill(args: argparse.Namespace) -> int:
    _, _, x_test, y_test = load_data(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        killed = run_job(args, Path(tmp) / "drill", kill=True)
        calm = run_job(args, Path(tmp) / "uninterrupted", kill=False)
    states = [f["state"] for f in killed["finals"]]
    equal = all(
        torch.equal(a, b)
        for other in states[1:]
        for a, b in zip(_tensors(states[0]), _tensors(other), strict=True)
    )
    metric = _accuracy(states[0]["params"], x_test, y_test)
    uninterrupted = _accuracy(calm["finals"][0]["state"]["params"], x_test, y_test)
    result = {
        "metric": metric,
        "metric_name": "test accuracy (digits, held out)",
        "threshold": args.min_accuracy,
        "metric_uninterrupted": uninterrupted,
        "replica_groups": args.replicas,
        "killed_replica": 1,
        "killed_at_step": args.kill_at,
        "survivor_restarts": killed["restarts"][0] + killed["restarts"][2],
        "healed_at_step": killed["finals"][1]["first_step"],
        "params_bitwise_equal_across_replicas": equal,
        "steps": killed["finals"][0]["step"],
        # From the restarted process's start (torch imported) to its first committed step:
        # joining the quorum, the peer's state over HTTP, one step.
        "heal_seconds": round(killed["finals"][1]["first_step_seconds"], 3),
    }
    common.log(
        f"killed replica group 1 at step {args.kill_at}; it healed at step "
        f"{result['healed_at_step']}; the survivors never restarted; test accuracy "
        f"{metric:.4f} (uninterrupted {uninterrupted:.4f})"
    )
    print(json.dumps(result))
    return 0 if equal and metric >= args.min_accuracy else 1


def _tensors(state: dict[str, Any]) -> list[torch.Tensor]:
    leaves: list[Any] = optree.tree_leaves(cast(Any, state))
    return [t for t in leaves if isinstance(t, torch.Tensor)]


def _accuracy(params: Params, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((mlp(params, x).argmax(1) == y).float().mean())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's servers log every quorum at info
    if args.drill:
        return drill(args)
    if args.lighthouse is None or args.replica is None or args.out is None:
        sys.exit("pass --drill, or --lighthouse, --replica and --out for one replica group")
    torch.set_num_threads(1)  # several groups share this machine's cores
    return replica(args)


if __name__ == "__main__":
    sys.exit(main())
