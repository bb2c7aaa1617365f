"""The example scripts' own error paths (their training runs are ``nox -s examples``)."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import fdp
from tests import ranks
from tests.helpers import tree_allclose

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


EXAMPLES = sorted(p.stem for p in (ROOT / "examples").glob("*.py") if p.stem != "common")
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
NEEDS_TRANSFORMERS = pytest.mark.skipif(
    not HAS_TRANSFORMERS, reason="transformers (the test group) is not installed"
)


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=NEEDS_TRANSFORMERS) if n == "finetune_hf" else n for n in EXAMPLES],
)
def test_help_shows_every_default(
    name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    module = importlib.import_module(name)
    with pytest.raises(SystemExit):
        module.parse_args(["--help"])
    text = capsys.readouterr().out
    options = set(re.findall(r"\[(--[a-z-]+)", text.split("\n\n")[0]))  # the usage line
    assert len(options) >= 3
    assert text.count("(default:") == len(options), text


def test_progress_writes_a_tenth_of_the_steps_into_a_log_file(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    common = importlib.import_module("common")
    progress = common.Progress(range(5, 1000), unit="step")  # resumed at step 5
    for _ in progress:
        progress.step(8)
        progress.show(loss=0.5)
    lines = capsys.readouterr().out.splitlines()  # not a terminal: no bar
    assert len(lines) == 11  # every 99 steps of 995, and the last
    assert lines[0].startswith("step 104/1000: loss 0.5000, samples/s ")
    assert lines[-1].startswith("step 1000/1000: loss 0.5000, samples/s ")


# ---------------------------------------------------------------------------
# Launching as users do: torchrun restarts after a lost worker, two agents as two nodes.

KILL = ROOT / "tests" / "kill_after_checkpoint.py"
TORCHRUN = (sys.executable, "-m", "torch.distributed.run")
ZERO = ("examples/train_digits_zero.py", "--epochs", "3", "--checkpoint-every", "10")
ZERO_ARGS = (*ZERO, "--min-accuracy", "0", "--resume")
LM = ("examples/train_lm_fsdp.py", "--steps", "12", "--checkpoint-every", "5", "--resume")
LM_ARGS = (*LM, "--dim", "32", "--blocks", "2", "--loss-threshold", "100")
LM_MUON_ARGS = (*LM_ARGS, "--optimizer", "muon")  # each matrix on one owner rank
# A Hugging Face GPT-2, fully sharded (fsdp.wrap, fdp.optim) or DDP with torch's AdamW.
HF = ("examples/finetune_hf.py", "--steps", "12", "--checkpoint-every", "5", "--resume")
HF_FSDP_ARGS = (*HF, "--fsdp", "--loss-threshold", "100")
HF_DDP_ARGS = (*HF, "--loss-threshold", "100")
# Streaming DiLoCo (each worker's own state, fdp.PerRank): fragment 1 is in flight at step 10.
DILOCO = ("examples/train_diloco.py", "--steps", "30", "--sync-every", "7", "--fragments", "2")
STREAMING = ("--overlap", "1", "--checkpoint-every", "10", "--resume", "--min-accuracy", "0")
DILOCO_ARGS = (*DILOCO, *STREAMING)
# The ported torch script: 2 epochs of 23 steps, checkpoints at 10, 20, ... and 46.
PORTED = ("examples/train_cnn_ported.py", "--epochs", "2", "--checkpoint-every", "10")
PORTED_ARGS = (*PORTED, "--min-accuracy", "0", "--resume")


def torchrun(
    directory: Path,
    script_args: tuple[str, ...],
    *,
    nodes: int = 1,
    kill: bool = False,
    rendezvous: str = "c10d",
) -> str:
    """Runs an example (2 ranks: 1 agent of 2, or 2 agents of 1) to its end; returns rank 0's log.

    With ``kill``, rank 1 is SIGKILLed after its first checkpoint and torchrun
    (``--max-restarts=1``) restarts the group, which resumes from it. Without
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE: the agent's store is shared, as by default.
    """
    entry = (str(KILL), "1") if kill else ()
    script = (*entry, *script_args, "--checkpoint-dir", str(directory))
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    env["OMP_NUM_THREADS"] = "1"
    launch: list[tuple[str, ...]]
    node: tuple[str, ...] = (*TORCHRUN, "--nnodes=2", "--nproc_per_node=1", "--max-restarts=1")
    if nodes == 1:
        launch = [(*TORCHRUN, "--standalone", "--nproc_per_node=2", "--max-restarts=1")]
    elif rendezvous == "c10d":  # ranks assigned at rendezvous
        endpoint = f"--rdzv-endpoint=127.0.0.1:{ranks.free_port()}"
        launch = [(*node, "--rdzv-backend=c10d", endpoint, "--rdzv-id=fdp-test")] * nodes
    else:  # a static master: node ranks given
        master = ("--master-addr=127.0.0.1", f"--master-port={ranks.free_port()}")
        launch = [(*node, *master, f"--node-rank={n}") for n in range(nodes)]
    agents = [
        subprocess.Popen(
            [*command, *script],
            cwd=ROOT,
            env=env,
            text=True,
            start_new_session=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for command in launch
    ]
    logs = []
    try:
        for agent in agents:
            logs.append(agent.communicate(timeout=180)[0])
    finally:
        for agent in agents:  # the agent and its workers, whatever state they are in
            with contextlib.suppress(ProcessLookupError):
                os.killpg(agent.pid, signal.SIGKILL)
            agent.communicate()
    for agent, log in zip(agents, logs, strict=True):
        assert agent.returncode == 0, log[-4000:]
    return "\n".join(logs)


def final_state(directory: Path, tmp: Path) -> dict[str, Any]:
    """The newest checkpoint, read whole by torch alone (no fdp, no process group)."""
    steps = [p for p in directory.glob("step_*") if (p / ".metadata").exists()]
    newest = max(steps, key=lambda p: int(p.name.removeprefix("step_")))
    target = tmp / f"{directory.name}.pt"
    dcp_to_torch_save(newest, target)
    loaded: dict[str, Any] = torch.load(target, weights_only=False)
    return {k: v for k, v in loaded.items() if not k.startswith("_fdp/rng")}


def assert_bitwise_equal(got: Any, expected: Any, path: str = "") -> None:
    if isinstance(expected, dict):
        assert got.keys() == expected.keys(), path
        for key in expected:
            assert_bitwise_equal(got[key], expected[key], f"{path}.{key}")
    elif isinstance(expected, torch.Tensor):
        assert torch.equal(got, expected), path
    else:
        assert got == expected, path


class _Uninterrupted:
    """The examples' final states from runs that nothing interrupted (one agent).

    Each run is made at its first use, so a test's timeout covers its own
    run, not every example's (six runs took over 300 s on a loaded machine).
    """

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.states = tmp, dict[str, dict[str, Any]]()
        self.runs = {
            "zero": ZERO_ARGS,
            "lm": LM_ARGS,
            "lm_muon": LM_MUON_ARGS,
            "ported": PORTED_ARGS,
            "diloco": DILOCO_ARGS,
        }
        if HAS_TRANSFORMERS:
            self.runs |= {"hf_fsdp": HF_FSDP_ARGS, "hf_ddp": HF_DDP_ARGS}

    def __getitem__(self, name: str) -> dict[str, Any]:
        if name not in self.states:
            log = torchrun(self.tmp / name, self.runs[name])
            assert f"--resume: no complete checkpoint in {self.tmp / name}; starting fresh" in log
            self.states[name] = final_state(self.tmp / name, self.tmp)
        return self.states[name]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> _Uninterrupted:
    """The examples' uninterrupted final states, one run per example at most."""
    return _Uninterrupted(tmp_path_factory.mktemp("whole"))


@pytest.mark.parametrize(
    "name",
    [
        "zero",
        "lm",
        "lm_muon",
        "ported",
        "diloco",
        pytest.param("hf_fsdp", marks=NEEDS_TRANSFORMERS),
        pytest.param("hf_ddp", marks=NEEDS_TRANSFORMERS),
    ],
)
def test_a_killed_rank_restarts_and_ends_where_an_uninterrupted_run_does(
    tmp_path: Path, uninterrupted: _Uninterrupted, name: str
) -> None:
    # "ported": a torch DDP script's features, the learning rate saved with the state.
    args, first = {
        "zero": (ZERO_ARGS, "step_10"),
        "lm": (LM_ARGS, "step_5"),
        "lm_muon": (LM_MUON_ARGS, "step_5"),
        "ported": (PORTED_ARGS, "step_10"),
        "diloco": (DILOCO_ARGS, "step_10"),
        "hf_fsdp": (HF_FSDP_ARGS, "step_5"),
        "hf_ddp": (HF_DDP_ARGS, "step_5"),
    }[name]
    log = torchrun(tmp_path / name, args, kill=True)
    assert f"--resume: continuing from {tmp_path / name / first}" in log
    final = final_state(tmp_path / name, tmp_path)
    assert_bitwise_equal(final, uninterrupted[name])


@pytest.mark.parametrize("rendezvous", ["c10d", "static"])
def test_two_agents_as_two_nodes_with_a_restart_equal_one_node(
    tmp_path: Path, uninterrupted: _Uninterrupted, rendezvous: str
) -> None:
    # Each agent counts its own restarts (TORCHELASTIC_RESTART_COUNT), so the
    # fresh key space cannot come from that count.
    log = torchrun(tmp_path / "zero", ZERO_ARGS, nodes=2, kill=True, rendezvous=rendezvous)
    assert f"--resume: continuing from {tmp_path / 'zero' / 'step_10'}" in log
    assert_bitwise_equal(final_state(tmp_path / "zero", tmp_path), uninterrupted["zero"])


def _lm_losses(rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor, Any, Any]:
    """train_diloco.py's unsharded LM against train_lm_fsdp.py's, fully sharded (1 rank)."""
    if str(ROOT / "examples") not in sys.path:  # a rank's process: the examples import each other
        sys.path.insert(0, str(ROOT / "examples"))
    train_diloco = importlib.import_module("train_diloco")
    train_lm_fsdp = importlib.import_module("train_lm_fsdp")
    args = train_diloco.parse_args(["--model", "lm", "--dim", "32", "--blocks", "2"])
    task = train_diloco.Language(args)
    params = task.init_params()
    x, y = task.batch(3, 0, 1)
    grads, loss = torch.func.grad_and_value(task.loss)(params, x, y)
    fsdp = fdp.FullyShardedDataParallel(params)
    shards = {k: tuple(t.requires_grad_() for t in ts) for k, ts in fsdp.shard(params).items()}
    reference = train_lm_fsdp.lm_loss(fsdp, shards, x, y, task.heads)
    reference.backward()
    expected = fsdp.full(
        {k: tuple(t.grad for t in ts if t.grad is not None) for k, ts in shards.items()}
    )
    return loss, reference.detach(), grads, expected


def test_the_diloco_examples_lm_is_the_fsdp_examples_model() -> None:
    """``train_diloco.py --model lm``: the loss and gradients of train_lm_fsdp.py's model."""
    loss, reference, grads, expected = ranks.world(1).run(_lm_losses)[0]
    torch.testing.assert_close(loss, reference)
    tree_allclose(grads, expected, rtol=1e-5, atol=1e-6)
