"""fdp.FaultTolerance on torchft: drills with a lighthouse and replica groups on 127.0.0.1.

Each drill starts its own lighthouse on a free port and one process per
replica group (``tests/ft_replica.py``), then checks, from each replica
group's ledger of attempted steps and its final state:
- the survivors never restart and every committed step is in their ledger;
- every replica group ends bitwise equal to the others;
- the final parameters equal one process replaying the committed steps
  (each the average of the gradients of the replica groups that took part).
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import fdp
from tests import ft_replica
from tests.ranks import free_port

torchft = pytest.importorskip("torchft")

ROOT = Path(__file__).resolve().parent.parent
JOIN_TIMEOUT_S = 180.0


@pytest.fixture(params=[2])
def lighthouse(request: pytest.FixtureRequest) -> Iterator[str]:
    """A lighthouse on a free port that forms quorums of at least ``request.param`` groups."""
    from torchft._torchft import LighthouseServer

    # RUST_LOG=warn: tests/conftest.py sets it before torchft is imported.
    server = LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=request.param,
        join_timeout_ms=2000,
        heartbeat_timeout_ms=1000,
    )
    try:
        yield "http://127.0.0.1:" + server.address().rsplit(":", 1)[1]
    finally:
        server.shutdown()


class Drill:
    """Replica groups of ``size`` processes each, their logs and results in ``where``."""

    def __init__(
        self,
        lighthouse: str,
        where: Path,
        *args: str,
        replicas: int = ft_replica.REPLICAS,
        size: int = 1,
    ) -> None:
        self.lighthouse, self.where, self.size = lighthouse, where, size
        self.args = (*args, "--replicas", str(replicas), "--group-size", str(size))
        self.replicas = replicas
        self.procs: dict[tuple[int, int], subprocess.Popen[bytes]] = {}
        self.starts = dict.fromkeys(range(replicas), 0)

    def start(self, replica: int, *extra: str) -> None:
        """The replica group's processes, on a store of their own (torchrun's per group)."""
        self.starts[replica] += 1
        port = free_port()
        for k in range(self.size):
            command = [sys.executable, "-m", "tests.ft_replica", "--lighthouse", self.lighthouse]
            command += ["--replica", str(replica), "--dir", str(self.where), *self.args, *extra]
            command += ["--group-rank", str(k), "--group-port", str(port)]
            # faulthandler: a crash (an abort at exit included) logs every thread's stack.
            env = {**os.environ, "PYTHONPATH": str(ROOT), "RUST_LOG": "warn"}
            env["PYTHONFAULTHANDLER"] = "1"
            env.pop("MASTER_ADDR", None)
            name = f"log-{replica}.{k}-{self.starts[replica]}"
            # One process group per replica group: a kill takes the whole group at once, as
            # a lost machine does (a process killed alone would break its peers' next call).
            leader = 0 if k == 0 else self.procs[replica, 0].pid  # 0: a new group of its own
            with (self.where / name).open("wb") as log:
                self.procs[replica, k] = subprocess.Popen(
                    command,
                    cwd=ROOT,
                    stdout=log,
                    stderr=log,
                    env=env,
                    preexec_fn=functools.partial(os.setpgid, 0, leader),
                )

    def wait(self, replica: int) -> list[int]:
        """The exit codes of the replica group's processes."""
        codes = []
        for k in range(self.size):
            try:
                codes.append(self.procs[replica, k].wait(timeout=JOIN_TIMEOUT_S))
            except subprocess.TimeoutExpired:
                self.kill()
                pytest.fail(f"replica {replica}.{k} did not finish:\n{self.logs()}")
        return codes

    def wait_for(self, what: str, done: Any) -> None:
        """Polls the ledgers until ``done(self)`` holds (an event, not a duration)."""
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while not done(self):
            if time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"the drill never reached: {what}\n{self.logs()}")
            time.sleep(0.05)

    def kill(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()

    def logs(self) -> str:
        tails = [f"--- {p.name}\n" + p.read_text()[-3000:] for p in self.where.glob("log-*")]
        return "\n".join(tails)

    def ledger(self, replica: int, k: int = 0) -> list[dict[str, Any]]:
        suffix = f".{k}" if k else ""
        lines = (self.where / f"ledger-{replica}{suffix}").read_text().splitlines()
        return [json.loads(line) for line in lines if line != "done"]

    def final(self, replica: int, k: int = 0) -> dict[str, Any]:
        suffix = f".{k}" if k else ""
        path = self.where / f"final-{replica}{suffix}.pt"
        return torch.load(path, weights_only=False)  # type: ignore[no-any-return]


def steps_of(ledger: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ledger's steps, without the process that attempted each (each group rank its own)."""
    return [{k: v for k, v in entry.items() if k != "pid"} for entry in ledger]


def replay(committed: dict[int, list[int]], size: int) -> dict[str, torch.Tensor]:
    """One process: each committed step averages the gradients of the workers that took part."""
    state = ft_replica.initial_state()
    params, opt_state, opt = state["params"], state["opt"], ft_replica.optimizer()
    for step in sorted(committed):
        workers = [r * size + k for r in committed[step] for k in range(size)]
        grads = [
            torch.func.grad(ft_replica.loss)(params, *ft_replica.batch(step, w)) for w in workers
        ]
        mean = {k: torch.stack([g[k] for g in grads]).mean(0) for k in params}
        params, opt_state = opt.update(mean, opt_state, params)
    out: dict[str, torch.Tensor] = params
    return out


def committed_steps(drill: Drill) -> dict[int, list[int]]:
    """Committed step -> the replica groups whose ledger has it (checked against its count)."""
    steps: dict[int, list[int]] = {}
    counts: dict[int, int] = {}
    for r in range(drill.replicas):
        for k in range(drill.size):  # a group's processes agree on every step
            assert steps_of(drill.ledger(r, k)) == steps_of(drill.ledger(r))
        for entry in drill.ledger(r):
            if entry["committed"]:
                steps.setdefault(entry["step"], []).append(r)
                assert counts.setdefault(entry["step"], entry["n"]) == entry["n"]
    assert sorted(steps) == list(range(len(steps))), "a committed step is missing"
    for step, replicas in steps.items():
        assert len(replicas) == counts[step], (step, replicas, counts[step])
    return steps


def killed_group_lives(drill: Drill) -> tuple[list[int], list[int]]:
    """Replica group 1's committed steps, of its first process and of its second."""
    ledger = drill.ledger(1)
    lives: tuple[list[int], list[int]] = ([], [])
    for e in ledger:
        if e["committed"]:
            lives[e["pid"] != ledger[0]["pid"]].append(e["step"])
    return lives


def discarded_after(drill: Drill, step: int) -> list[int]:
    """The survivors' discarded steps after ``step``."""
    return [
        e["step"]
        for r in (0, 2)
        for e in drill.ledger(r)
        if not e["committed"] and e["step"] > step
    ]


def stepped_without_killed(drill: Drill) -> bool:
    """Both survivors committed, as a pair, a step at or after the first one they discarded
    after the killed group's last committed step (the one the kill broke, or a later one)."""
    try:
        first_life, _ = killed_group_lives(drill)
        discarded = discarded_after(drill, first_life[-1])
        survivors = [drill.ledger(r) for r in (0, 2)]
    except (FileNotFoundError, IndexError, json.JSONDecodeError):  # a line half written
        return False
    return bool(discarded) and all(
        any(e["committed"] and e["n"] == 2 and e["step"] >= min(discarded) for e in ledger)
        for ledger in survivors
    )


def check_equal_and_replayed(drill: Drill) -> dict[int, list[int]]:
    """Every group rank bitwise equal across replica groups; the whole tree equal to the replay."""
    for k in range(drill.size):
        finals = [drill.final(r, k) for r in range(drill.replicas)]
        for other in finals[1:]:
            pairs = zip(*(fdp._tree.flatten(s)[0] for s in (finals[0], other)), strict=True)
            for a, b in pairs:
                assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    steps = committed_steps(drill)
    expected = replay(steps, drill.size)
    first = drill.final(0)
    whole = first["full"] if drill.size > 1 else first["params"]
    for key, value in expected.items():
        torch.testing.assert_close(whole[key], value, rtol=1e-6, atol=1e-6)
    assert first["data"] == len(steps)
    return steps


@pytest.mark.timeout(420)
@pytest.mark.parametrize("size", [1, 2], ids=["ddp", "hsdp"])
def test_a_killed_replica_group_heals_and_the_survivors_never_stop(
    lighthouse: str, tmp_path: Path, size: int
) -> None:
    """size 2: HSDP, FSDP inside each replica group of 2 processes, the groups averaged."""
    kill_at = 4
    drill = Drill(lighthouse, tmp_path, "--kill-at", str(kill_at), "--killer", "1", size=size)
    try:
        for r in range(ft_replica.REPLICAS):
            drill.start(r)
        assert drill.wait(1) == [-9] * size, drill.logs()
        # The restart waits for the survivors to commit a step without the killed group
        # after the step the kill broke: that they go on is what is tested, whatever the
        # machine's load (a restart faster than their recovery would join them at once).
        drill.wait_for("the survivors' step without the killed group", stepped_without_killed)
        drill.start(1, "--restarted")
        codes = [drill.wait(r) for r in range(ft_replica.REPLICAS)]
    finally:
        drill.kill()
    assert codes == [[0] * size] * 3, drill.logs()
    # What the processes did: each group rank's ledger names the process of each
    # attempt; the survivors' is one process throughout, the killed group's two.
    for k in range(size):
        lives = {r: len({e["pid"] for e in drill.ledger(r, k)}) for r in range(3)}
        assert lives == {0: 1, 1: 2, 2: 1}, lives
    steps = check_equal_and_replayed(drill)
    # The survivors stepped on to the last step (a replica group left out of
    # a quorum, e.g. one that asked late, heals into the next one: the job's
    # committed steps above have no gap).
    for r in (0, 2):
        mine = [e["step"] for e in drill.ledger(r) if e["committed"]]
        assert mine == sorted(set(mine))
        assert mine[-1] == max(steps)
    # The first life committed a step (the kill waits for one) and died in a later
    # one, which the survivors in its quorum discarded; the second life healed into
    # a step after the survivors' steps without it.
    first_life, second_life = killed_group_lives(drill)
    assert first_life
    assert second_life
    assert discarded_after(drill, first_life[-1])
    healed_at = second_life[0]
    between = [steps[s] for s in range(first_life[-1] + 1, healed_at)]
    assert between, steps
    assert all(rs == [0, 2] for rs in between), (between, steps)
    assert steps[max(steps)] == [0, 1, 2]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("lighthouse", [3], indirect=True)  # all three from the first step
@pytest.mark.parametrize(("reduction", "size"), [("all_reduce_grads", 1), ("ddp", 1), ("hsdp", 2)])
def test_an_error_in_one_replica_groups_all_reduce_discards_the_step_everywhere(
    lighthouse: str, tmp_path: Path, reduction: str, size: int
) -> None:
    error_at = 3
    drill = Drill(lighthouse, tmp_path, *(["--ddp"] if reduction == "ddp" else []), size=size)
    try:
        for r in range(ft_replica.REPLICAS):
            drill.start(r, *(("--error-at", str(error_at)) if r == 2 else ()))
        codes = [drill.wait(r) for r in range(ft_replica.REPLICAS)]
    finally:
        drill.kill()
    assert codes == [[0] * size] * 3, drill.logs()
    check_equal_and_replayed(drill)
    for r in range(ft_replica.REPLICAS):
        attempts = [(e["step"], e["committed"]) for e in drill.ledger(r)]
        assert (error_at, False) in attempts, attempts
        assert (error_at, True) in attempts, attempts


@pytest.mark.timeout(300)
@pytest.mark.parametrize("lighthouse", [2], indirect=True)
@pytest.mark.parametrize("case", ["whole", "fragments", "overlap"])
def test_diloco_across_replica_groups_equals_the_one_process_simulation(
    lighthouse: str, tmp_path: Path, case: str
) -> None:
    """Streaming: two fragments; with ``overlap`` each lands a step after it is sent."""
    from tests import test_diloco, test_streaming_diloco

    extra = {
        "whole": [],
        "fragments": ["--streaming"],
        "overlap": ["--streaming", "--overlap", "1"],
    }
    drill = Drill(lighthouse, tmp_path, "--diloco", *extra[case], replicas=2)
    try:
        for r in range(2):
            drill.start(r)
        codes = [drill.wait(r) for r in range(2)]
    finally:
        drill.kill()
    assert codes == [[0], [0]], drill.logs()
    expected = (
        test_streaming_diloco.simulate(case, 2, local_sgd=False)
        if case != "whole"
        else test_diloco.simulate("diloco", "grad", 2)
    )
    for r in range(2):
        got = drill.final(r)
        for key, tree in (("params", got["params"]), ("anchor", got["opt"]["anchor"])):
            for a, b in zip(
                fdp._tree.flatten(tree)[0], fdp._tree.flatten(expected[r][key])[0], strict=True
            ):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


KILL_AT = 6  # the drill's count: replica group 1 dies in the first landing from here


def _synced_without_killed(drill: Drill) -> bool:
    """Both survivors committed a sync as a pair after one they discarded (the kill's)."""
    try:
        ledgers = [drill.ledger(r) for r in (0, 2)]
    except (FileNotFoundError, json.JSONDecodeError):  # a line half written
        return False
    discarded = [
        e["count"]
        for ledger in ledgers
        for e in ledger
        if not e["committed"] and e["count"] >= KILL_AT
    ]
    return bool(discarded) and all(
        any(e["committed"] and e["n"] == 2 and e["count"] >= min(discarded) for e in ledger)
        for ledger in ledgers
    )


@pytest.mark.timeout(420)
def test_streaming_diloco_survives_a_group_killed_with_a_reduction_in_flight(
    lighthouse: str, tmp_path: Path
) -> None:
    """Two fragments, each landing a step after it is sent; replica group 1 dies in a landing
    step (its quorum formed): the survivors discard that step alike, land the fragment
    again between themselves, go on; the restarted group heals at a later sync."""
    kill_at = KILL_AT
    args = ("--diloco", "--streaming", "--overlap", "1", "--kill-at", str(kill_at))
    drill = Drill(lighthouse, tmp_path, *args, "--killer", "1")
    try:
        for r in range(3):
            drill.start(r)
        assert drill.wait(1) == [-9], drill.logs()
        drill.wait_for("the survivors' sync without the killed group", _synced_without_killed)
        drill.start(1, "--restarted")
        codes = [drill.wait(r) for r in range(3)]
    finally:
        drill.kill()
    assert codes == [[0]] * 3, drill.logs()
    lives = {r: len({e["pid"] for e in drill.ledger(r)}) for r in range(3)}
    assert lives == {0: 1, 1: 2, 2: 1}, lives
    finals = [drill.final(r) for r in range(3)]
    for other in finals[1:]:  # the shared state bitwise equal; the parameters are local
        assert int(other["opt"]["count"]) == int(finals[0]["opt"]["count"])
        for key in ("anchor", "outer"):
            for a, b in zip(
                fdp._tree.flatten(finals[0]["opt"][key])[0],
                fdp._tree.flatten(other["opt"][key])[0],
                strict=True,
            ):
                assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    # The survivors in the quorum the kill broke discarded that landing alike (at least
    # one was in it: min_replicas is 2), then landed it again as a pair.
    discarded = {
        r: {e["count"] for e in drill.ledger(r) if not e["committed"] and e["count"] >= kill_at}
        for r in (0, 2)
    }
    broken = min(discarded[0] | discarded[2])
    for r in (0, 2):
        ledger = drill.ledger(r)
        if broken in discarded[r]:
            assert any(e["committed"] and e["n"] == 2 and e["count"] == broken for e in ledger)
    # The second life's first committed sync came after a sync without it.
    first = drill.ledger(1)[0]["pid"]
    healed = min(e["count"] for e in drill.ledger(1) if e["committed"] and e["pid"] != first)
    pairs = [e["count"] for e in drill.ledger(0) if e["committed"] and e["n"] == 2]
    assert any(c < healed for c in pairs), (healed, pairs)


def test_an_unreachable_lighthouse_is_named() -> None:
    with pytest.raises(ConnectionError, match=r"lighthouse at `lighthouse` 'http://127.0.0.1:9'"):
        fdp.FaultTolerance.connect(
            "http://127.0.0.1:9",
            replica_id="r0",
            timeout=datetime.timedelta(seconds=2),
        )


def test_a_malformed_lighthouse_address_is_refused() -> None:
    with pytest.raises(ValueError, match=r"`lighthouse` expected an address like"):
        fdp.FaultTolerance.connect("127.0.0.1:9", replica_id="r0")


EXIT_SCRIPT = """
import datetime, json, os, sys, time
import torch
import fdp
from torchft._torchft import LighthouseServer

os.environ.pop("MASTER_ADDR", None)
server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100)
address = "http://127.0.0.1:" + server.address().rsplit(":", 1)[1]
landed = []

def slow(fut):
    time.sleep(0.5)  # still running on a gloo thread when the process exits, unless waited for
    landed.append(fut.value().tolist())
    return fut.value()

def step(state):
    bucket = fdp.GradBucket(
        torch.arange(4.0), index=0, is_last=True, gradients=[], parameters=[]
    )
    fdp.FaultTolerance.comm_hook(ft, bucket).then(slow)  # never waited for here
    return state + 1

timeout = datetime.timedelta(seconds=30)
with fdp.FaultTolerance.connect(address, replica_id="r0", timeout=timeout) as ft:
    state = ft.step(step, torch.zeros(()))
ft.shutdown()  # a second call does nothing
server.shutdown()
print(json.dumps({"state": state.item(), "landed": landed}))
"""


def test_shutdown_waits_for_callbacks_in_flight_and_the_process_exits_cleanly() -> None:
    # Without the wait, the callback never lands (the process exits under it) or, when its
    # gloo thread is in Python as the interpreter finalizes, the process aborts (-6,
    # "terminate called without an active exception"), as a drill's replica once did.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RUST_LOG": "warn", "PYTHONFAULTHANDLER": "1"}
    done = subprocess.run(
        [sys.executable, "-c", EXIT_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=JOIN_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # One replica group: the mean over the quorum is the bucket itself.
    assert result == {"state": 1.0, "landed": [[0.0, 1.0, 2.0, 3.0]]}
