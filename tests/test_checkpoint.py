"""fdp.save_checkpoint / fdp.load_checkpoint (fdp._sharding._checkpoint) against uninterrupted runs.

Round trips in one process; ZeRO states saved on 4 gloo ranks and resumed on
2 and 3 against one process that never stopped; and a fault drill under
torchrun that SIGKILLs a rank and must end bitwise where an uninterrupted
run ends.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import optree
import pytest
import torch

import fdp
from tests import ranks, restart_drill
from tests.helpers import detached_copy, params_corpus, tensor_leaves, tree_allclose

STEPS = 3  # before and after the checkpoint


def test_round_trip_in_one_process_restores_values_and_rng(tmp_path: Path) -> None:
    params = optree.tree_map(torch.Tensor.detach, params_corpus())  # type: ignore[arg-type]
    opt = fdp.optim.adam(0.1)
    state = {"params": params, "opt": opt.init(params), "step": 7, "note": "x", "none": None}
    torch.manual_seed(3)
    fdp.save_checkpoint(tmp_path / "c", state)
    expected_draw = torch.rand(4)
    like = {
        "params": optree.tree_map(torch.zeros_like, params),
        "opt": opt.init(params),
        "step": 0,
        "note": "",
        "none": None,
    }
    before = detached_copy(like)
    loaded = fdp.load_checkpoint(tmp_path / "c", like)
    tree_allclose(loaded, state, rtol=0, atol=0)
    tree_allclose(like, before, rtol=0, atol=0)  # like is untouched
    torch.testing.assert_close(torch.rand(4), expected_draw, rtol=0, atol=0)
    # A leaf of like that requires grad loads as one (a .backward() loop resumes).
    grad_like = {"w": torch.zeros(3, 4, requires_grad=True), "b": torch.zeros(4)}
    fdp.save_checkpoint(tmp_path / "g", {"w": torch.ones(3, 4), "b": torch.ones(4)}, rng=False)
    got_grad = fdp.load_checkpoint(tmp_path / "g", grad_like)
    assert got_grad["w"].requires_grad
    assert got_grad["w"].is_leaf
    assert not got_grad["b"].requires_grad
    # Layouts follow like: a channels_last like loads channels_last.
    conv = {"w": torch.randn(2, 3, 2, 2)}
    fdp.save_checkpoint(tmp_path / "d", conv, rng=False)
    cl = {"w": torch.empty(2, 3, 2, 2).contiguous(memory_format=torch.channels_last)}
    got = fdp.load_checkpoint(tmp_path / "d", cl)["w"]
    assert got.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(got, conv["w"], rtol=0, atol=0)


def test_missing_or_misshapen_leaves_are_named(tmp_path: Path) -> None:
    fdp.save_checkpoint(tmp_path / "c", {"w": torch.ones(3), "n": 1})
    with pytest.raises(ValueError, match=r"`like` leaf like\['b'\] is not in the checkpoint"):
        fdp.load_checkpoint(tmp_path / "c", {"w": torch.ones(3), "b": torch.ones(1), "n": 1})
    with pytest.raises(ValueError, match=r"like\['w'\] expected shape \(4,\); .* shape \(3,\)"):
        fdp.load_checkpoint(tmp_path / "c", {"w": torch.ones(4), "n": 1})
    with pytest.raises(ValueError, match=r"like\['n'\] expected a tensor; .* a Python value"):
        fdp.load_checkpoint(tmp_path / "c", {"w": torch.ones(3), "n": torch.ones(1)})


# ---------------------------------------------------------------------------
# ZeRO: save on 4 ranks, resume on 2 and on 3.


def tree() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(7, 5, generator=g),
        "z": torch.randn(5, generator=g, dtype=torch.complex64),
        "h": [torch.randn(11, generator=g, dtype=torch.float64), None],
    }


def grad(step: int, p: torch.Tensor) -> torch.Tensor:
    """The same on every rank (so any world averages to it), a multiple of 2**-10."""
    g = torch.view_as_real(p) if p.is_complex() else p
    q = torch.round((torch.sin(g * (step + 1)) + 0.1) * 1024) / 1024
    return torch.view_as_complex(q) if p.is_complex() else q


def grads(params: Any, step: int) -> Any:
    return optree.tree_map(lambda p: grad(step, p), params)


def _train(
    rank: int, size: int, path: str, first: int, load: bool, cap: float
) -> list[torch.Tensor]:
    params = tree()
    zero = fdp.ZeroRedundancy(fdp.optim.adamw(0.05), params, bucket_cap_mb=cap)
    state = zero.init(params)
    if load:
        like: dict[str, Any] = {"params": params, "opt": state, "step": 0}
        loaded = fdp.load_checkpoint(path, like)
        params, state, first = loaded["params"], loaded["opt"], loaded["step"]
    for step in range(first, first + STEPS):
        params, state = zero.step(grads(params, step), state, params)
    if not load:
        fdp.save_checkpoint(path, {"params": params, "opt": state, "step": first + STEPS})
    return tensor_leaves(params)


def reference() -> list[torch.Tensor]:
    params = tensor_leaves(tree())
    opt = torch.optim.AdamW(params, lr=0.05, foreach=True)
    for step in range(2 * STEPS):
        for p in params:
            p.grad = grad(step, p)
        opt.step()
    return params


@pytest.mark.parametrize("resume_on", [2, 3])
def test_zero_state_saved_on_4_ranks_resumes_on_fewer(tmp_path: Path, resume_on: int) -> None:
    path = str(tmp_path / "c")
    cap = 64 / 2**20  # 64-byte buckets: slices cut leaves differently at each world size
    ranks.world(4).run(_train, path, 0, False, cap)
    results = ranks.world(resume_on).run(_train, path, 0, True, cap)
    expected = reference()
    for got in results:
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------
# The fault drill: torchrun restarts the group after a SIGKILL.

DRILL = Path(__file__).with_name("restart_drill.py")


def torchrun(tmp: Path, out: str, *args: str) -> None:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--max-restarts=1",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{ranks.free_port()}",
        "--monitor-interval=0.1", str(DRILL), "--dir", str(tmp / out), *args,
    ]  # fmt: skip
    # The agent's TCPStore is shared with the workers and kept across the
    # restart (pytorch/pytorch#135712); fdp.init_distributed gives the
    # restarted group a fresh key space, so no environment variable is needed.
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def ends_where_uninterrupted(killed: Path, uninterrupted: Path) -> dict[str, Any]:
    """Asserts the killed run's final parameters are the uninterrupted run's, bitwise."""
    like = {"params": restart_drill.tree(), "step": 0}
    done = fdp.load_checkpoint(killed / "final", like, rng=False)
    whole = fdp.load_checkpoint(uninterrupted / "final", like, rng=False)
    assert done["step"] == whole["step"] == 12
    for a, b in zip(tensor_leaves(done), tensor_leaves(whole), strict=True):
        assert torch.equal(a, b)
    return like


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The drill run once without a kill: where every killed run must end (saving to
    ``last`` or to step directories trains alike)."""
    tmp = tmp_path_factory.mktemp("drill")
    torchrun(tmp, "whole")
    assert not any(p.name.startswith("resumed_from") for p in (tmp / "whole").iterdir())
    return tmp / "whole"


@pytest.mark.parametrize(
    "how",
    [
        ("--kill-in-save", "9", "--kill-rank", "1"),  # into a fresh step directory
        ("--kill-in-save", "9", "--kill-rank", "1", "--last"),  # over the one checkpoint
        ("--kill-in-save", "9", "--kill-rank", "0", "--last"),  # the coordinator
    ],
    ids=["step_dir", "last_rank1", "last_rank0"],
)
def test_a_rank_killed_while_saving_resumes_from_the_last_whole_checkpoint(
    tmp_path: Path, uninterrupted: Path, how: tuple[str, ...]
) -> None:
    # Before: a save over ckpt/last removed its .metadata first, so a kill
    # midway left no checkpoint at all and the job started again from step 0.
    torchrun(tmp_path, "killed", *how)
    assert (tmp_path / "killed" / "resumed_from_6").exists()
    like = ends_where_uninterrupted(tmp_path / "killed", uninterrupted)
    if "--last" in how:  # the last save is whole, and nothing is left beside it
        last = fdp.load_checkpoint(tmp_path / "killed" / "last", like, strict=False)
        assert last["step"] == 12
        left = [p.name for p in (tmp_path / "killed").iterdir() if p.name.startswith(".")]
        assert left == []


def test_killed_rank_resumes_from_the_last_checkpoint_bitwise(
    tmp_path: Path, uninterrupted: Path
) -> None:
    torchrun(tmp_path, "killed", "--kill-at", "7")
    # The killed run restarted once, from the checkpoint of step 6.
    assert (tmp_path / "killed" / "resumed_from_6").exists()
    ends_where_uninterrupted(tmp_path / "killed", uninterrupted)


# ---------------------------------------------------------------------------
# ZeRO <-> unsharded: a ZeroState loads into an fdp.optim state and back.


def _zero_then_save(rank: int, size: int, path: str) -> None:
    _train(rank, size, path, 0, False, 64 / 2**20)


def test_zero_state_consolidates_into_one_process(tmp_path: Path) -> None:
    path = str(tmp_path / "c")
    ranks.world(2).run(_zero_then_save, path)
    opt = fdp.optim.adamw(0.05)
    params = tree()
    like: dict[str, Any] = {"params": params, "opt": opt.init(params), "step": 0}
    loaded = fdp.load_checkpoint(path, like)  # no process group: this process alone
    params, state = loaded["params"], loaded["opt"]
    assert loaded["step"] == STEPS
    for step in range(STEPS, 2 * STEPS):
        params, state = opt.update(grads(params, step), state, params)
    for g, e in zip(tensor_leaves(params), reference(), strict=True):
        torch.testing.assert_close(g, e.detach(), rtol=1e-6, atol=1e-7)


def _resume_unsharded(rank: int, size: int, path: str) -> list[torch.Tensor]:
    return _train(rank, size, path, 0, True, 64 / 2**20)


def test_an_unsharded_state_resumes_under_zero(tmp_path: Path) -> None:
    opt = fdp.optim.adamw(0.05)
    params = tree()
    state = opt.init(params)
    for step in range(STEPS):
        params, state = opt.update(grads(params, step), state, params)
    path = str(tmp_path / "c")
    fdp.save_checkpoint(path, {"params": params, "opt": state, "step": STEPS}, rng=False)
    expected = reference()
    for got in ranks.world(3).run(_resume_unsharded, path):
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g, e.detach(), rtol=1e-6, atol=1e-7)


def test_a_tensor_at_two_paths_stays_tied(tmp_path: Path) -> None:
    # torch.nn.Module.load_state_dict keeps tied weights tied; so does fdp.
    w = torch.randn(3, requires_grad=True)
    fdp.save_checkpoint(tmp_path / "c", {"emb": w, "head": w, "other": torch.ones(2)})
    like = {"emb": torch.zeros(3, requires_grad=True), "other": torch.zeros(2)}
    like["head"] = like["emb"]
    loaded = fdp.load_checkpoint(tmp_path / "c", like)
    assert loaded["emb"] is loaded["head"]
    assert loaded["emb"].requires_grad
    torch.testing.assert_close(loaded["emb"], w.detach(), rtol=0, atol=0)
    torch.testing.assert_close(loaded["other"], torch.ones(2), rtol=0, atol=0)


def test_unreadable_checkpoints_raise_value_errors(tmp_path: Path) -> None:
    # DCP's CheckpointException is a BaseException, which `except Exception` misses.
    path = tmp_path / "c"
    fdp.save_checkpoint(path, {"w": torch.ones(3), "n": 5})
    good = {"w": torch.zeros(3), "n": 0}
    with pytest.raises(ValueError, match=r"like\['w'\] holds int 3; the checkpoint holds a tensor"):
        fdp.load_checkpoint(path, {"w": 3, "n": 0})
    with pytest.raises(ValueError, match="holds no checkpoint"):
        fdp.load_checkpoint(tmp_path / "nothing", good)
    data = [f for f in os.listdir(path) if f.endswith(".distcp")]
    broken = tmp_path / "truncated"
    shutil.copytree(path, broken)
    for f in data:
        with open(broken / f, "r+b") as handle:
            handle.truncate(10)
    with pytest.raises(ValueError, match=r"could not read `path` .*truncated.*: rank 0: "):
        fdp.load_checkpoint(broken, good)
    missing = tmp_path / "missing"
    shutil.copytree(path, missing)
    for f in data:
        os.remove(missing / f)
    with pytest.raises(ValueError, match=r"could not read `path` .*: rank 0: FileNotFoundError"):
        fdp.load_checkpoint(missing, good)
    assert fdp.load_checkpoint(path, good)["n"] == 5  # the good one still loads


def test_a_save_that_dies_midway_leaves_the_previous_checkpoint_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The writer "dies" after writing the new data files, before .metadata.
    path = tmp_path / "c"
    fdp.save_checkpoint(path, {"w": torch.ones(3), "step": 1})
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    def die(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(FileSystemWriter, "finish", die)
    with pytest.raises(BaseException, match="killed"):
        fdp.save_checkpoint(path, {"w": torch.full((3,), 2.0), "step": 2})
    monkeypatch.undo()
    # Long ago the old .metadata stayed over the new data file and loaded as
    # step 1 with step 2's values; then the save removed .metadata first, and
    # the path held no checkpoint. Now the old one is untouched, whole.
    loaded = fdp.load_checkpoint(path, {"w": torch.zeros(3), "step": 0})
    assert loaded["step"] == 1
    torch.testing.assert_close(loaded["w"], torch.ones(3), rtol=0, atol=0)
    assert (tmp_path / ".c.saving").is_dir()  # the partial save, beside it
    fdp.save_checkpoint(path, {"w": torch.full((3,), 3.0), "step": 3})
    loaded = fdp.load_checkpoint(path, {"w": torch.zeros(3), "step": 0})
    assert loaded["step"] == 3
    torch.testing.assert_close(loaded["w"], torch.full((3,), 3.0), rtol=0, atol=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]  # the staging one is gone


def _zero_layouts(rank: int, size: int, path: str, save_cl: bool, load_cl: bool) -> str:
    def conv() -> dict[str, torch.Tensor]:
        w = torch.arange(2 * 3 * 2 * 2, dtype=torch.float32).view(2, 3, 2, 2)
        return {"conv": w.contiguous(memory_format=torch.channels_last) if save_cl else w}

    params = conv()
    zero = fdp.ZeroRedundancy(fdp.optim.adam(0.1), params)
    state = zero.init(params)
    params, state = zero.step({"conv": torch.ones_like(params["conv"])}, state, params)
    fdp.save_checkpoint(path, {"opt": state})
    fresh = conv() if save_cl == load_cl else {"conv": conv()["conv"].contiguous()}
    if load_cl and not save_cl:
        fresh = {"conv": fresh["conv"].contiguous(memory_format=torch.channels_last)}
    like = fdp.ZeroRedundancy(fdp.optim.adam(0.1), fresh)
    try:
        loaded = fdp.load_checkpoint(path, {"opt": like.init(fresh)})["opt"]
    except ValueError as e:
        return str(e)
    same = all(
        torch.equal(a, b)
        for k in state.slots
        for x, y in zip(state.slots[k], loaded.slots[k], strict=True)
        for a, b in zip(x, y, strict=True)
    )
    return "loaded, equal" if same else "loaded, different"


@pytest.mark.parametrize(("save_cl", "load_cl"), [(True, True), (True, False), (False, True)])
def test_a_zero_state_in_another_memory_format_is_refused(
    tmp_path: Path, save_cl: bool, load_cl: bool
) -> None:
    # Before: the pieces loaded in the other order, and the next step was off by 0.05.
    for message in ranks.world(2).run(_zero_layouts, str(tmp_path / "c"), save_cl, load_cl):
        if save_cl == load_cl:
            assert message == "loaded, equal"
        else:
            assert "the checkpoint saved its pieces in memory order" in message
            assert "like['opt'] (a ZeroState) holds parameter ['conv']" in message


def _save_ddp_batch_norm(rank: int, size: int, path: str) -> Any:
    """A DDP step with BatchNorm on each rank's own batch, then a save and a load."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(4, 6),
        torch.nn.BatchNorm1d(6),
        torch.nn.Linear(6, 3),
        torch.nn.BatchNorm1d(3),
    )
    fn, state = fdp.make_functional(net)
    ddp = fdp.DistributedDataParallel(state)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(rank))
    torch.autograd.backward(fn(ddp(state), x).square().sum())
    held = detached_copy(state)  # the running statistics of this rank's batch
    fdp.save_checkpoint(path, {"state": state, "step": 1})
    return held, fdp.load_checkpoint(path, {"state": state, "step": 0})


def test_a_ddp_checkpoint_holds_rank_0s_buffers(tmp_path: Path) -> None:
    # Buffers differ across ranks after a step (each rank's batch statistics,
    # broadcast from rank 0 only at the next ddp(state) call); DCP spreads
    # entries every rank holds over the ranks, so a resume took some of rank
    # 1's. What torch's DDP users save is rank 0's state_dict.
    (held0, loaded0), (held1, loaded1) = ranks.world(2).run(_save_ddp_batch_norm, str(tmp_path))
    assert not torch.equal(held0["1.running_mean"], held1["1.running_mean"])
    for loaded in (loaded0, loaded1):
        tree_allclose(loaded["state"], held0, rtol=0, atol=0)
        assert loaded["step"] == 1


# ---------------------------------------------------------------------------
# The data position: a global sample position resumes at another world size.

SAMPLES, GLOBAL_BATCH = 30, 6  # 5 steps an epoch; 6 splits evenly over 2 and 3 ranks


def global_batch(epoch: int, seen: int, rank: int, world: int) -> torch.Tensor:
    """docs/checkpoints.md's rule: this rank's share of the global batch at ``seen``."""
    order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(epoch))
    return order[seen : seen + GLOBAL_BATCH].tensor_split(world)[rank]


def _data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return torch.randn(n, 4, generator=g), torch.randn(n, generator=g)


def _epochs(rank: int, size: int, path: str, until: tuple[int, int]) -> Any:
    """Trains from the checkpoint at ``path`` (if any) to (epoch, seen) ``until``."""
    x, y = _data(SAMPLES)
    state: dict[str, Any] = {"w": torch.zeros(4), "epoch": 0, "seen": 0}
    if os.path.exists(path):
        state = fdp.load_checkpoint(path, state, rng=False)
    ddp = fdp.DistributedDataParallel({"w": state["w"]})
    w, epoch, seen, mine = state["w"], state["epoch"], state["seen"], []
    while (epoch, seen) != until:
        idx = global_batch(epoch, seen, rank, size)
        mine.append((epoch, idx.tolist()))

        def loss(p: dict[str, torch.Tensor], idx: torch.Tensor = idx) -> torch.Tensor:
            return (x[idx] @ ddp(p)["w"] - y[idx]).square().mean()

        g = torch.func.grad(loss)({"w": w})
        w = w - 0.1 * g["w"]
        seen += GLOBAL_BATCH
        if seen == SAMPLES:
            epoch, seen = epoch + 1, 0
    fdp.save_checkpoint(path, {"w": w, "epoch": epoch, "seen": seen}, rng=False)
    return w, mine


def test_a_global_sample_position_resumes_on_3_ranks_of_a_2_rank_run(tmp_path: Path) -> None:
    path = str(tmp_path / "last")
    two = ranks.world(2).run(_epochs, path, (0, 18))  # 3 steps of epoch 0 on 2 ranks
    three = ranks.world(3).run(_epochs, path, (2, 0))  # the rest, and epoch 1, on 3
    seen: dict[int, list[int]] = {0: [], 1: []}
    for _, mine in two + three:
        for epoch, idx in mine:
            seen[epoch] += idx
    for epoch in (0, 1):
        assert sorted(seen[epoch]) == list(range(SAMPLES))  # each sample once an epoch
    # One process over the same global batches, the reference for the weights.
    x, y = _data(SAMPLES)
    w = torch.zeros(4, requires_grad=True)
    for epoch in (0, 1):
        for seen_ in range(0, SAMPLES, GLOBAL_BATCH):
            idx = global_batch(epoch, seen_, 0, 1)
            (g,) = torch.autograd.grad((x[idx] @ w - y[idx]).square().mean(), w)
            w = (w - 0.1 * g).detach().requires_grad_()
    for final, _ in three:
        torch.testing.assert_close(final, w.detach())
    # The rule it replaces: a DataLoader's batch index over a DistributedSampler
    # (batch_size=3 per rank) resumed at 3 ranks points past samples never seen.
    from torch.utils.data import DistributedSampler

    def sampler(world: int, rank: int) -> list[int]:
        data: Any = range(SAMPLES)
        return list(DistributedSampler(data, num_replicas=world, rank=rank, seed=0))

    batch_index, per_rank = 3, 3
    first = [i for r in range(2) for i in sampler(2, r)[: batch_index * per_rank]]
    rest = [i for r in range(3) for i in sampler(3, r)[batch_index * per_rank :]]
    assert len(set(range(SAMPLES)) - set(first + rest)) == 9  # skipped this epoch
