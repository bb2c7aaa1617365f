"""Entries written once are verified on every rank (fdp._sharding._checkpoint_verify).

``fdp.save_checkpoint`` writes an entry every rank holds once, from rank 0.
Each case saves on 2 gloo ranks a state whose once-written entries differ
(fully sharded shards saved directly, a functional loop's parameters that
trained apart, a per-rank value, a plain tree's buffers) and checks that every
rank raises the same error naming the leaf and the probable cause; states
that agree save and load back to the saved values bitwise. Also here: the
checksum itself (bits, not sums), and a ``make_functional`` state loaded in
place into its module, against a module that loaded ``load_state_dict``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import fdp
from fdp._comm import _agreement
from tests import ranks
from tests.helpers import detached_copy, tree_allclose


def _params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(5, 3, generator=g), "b": torch.randn(7, generator=g)}


def _save(rank: int, path: str, state: Any) -> str:
    try:
        fdp.save_checkpoint(path, state, rng=False)
    except ValueError as e:
        return str(e)
    return "saved"


def _raw_shards(rank: int, size: int, path: str, trained: bool) -> str:
    params = _params()
    if trained:
        params = {k: v.requires_grad_() for k, v in params.items()}
    fsdp = fdp.FullyShardedDataParallel(params)
    return _save(rank, path, {"params": fsdp.shard(params)})


@pytest.mark.parametrize("trained", [False, True], ids=["detached", "requires_grad"])
def test_raw_fully_sharded_shards_are_refused(tmp_path: Path, trained: bool) -> None:
    # Before: detached shards saved rank 0's piece for every rank (fsdp.full of
    # the loaded shards was not the parameters); shards that required grad were
    # refused as "the ranks trained apart".
    messages = ranks.world(2).run(_raw_shards, str(tmp_path / "c"), trained)
    assert messages[0] == messages[1]
    assert "`state` leaf state['params']" in messages[0]
    assert "Probably fully sharded shards" in messages[0]
    assert "fsdp.to_checkpoint(shards)" in messages[0]
    assert not (tmp_path / "c" / ".metadata").exists()


def _functional_loop(rank: int, size: int, path: str, apart: bool) -> Any:
    """docs/checkpoints.md's loop: detached params stepped by fdp.optim."""
    params = _params()
    opt = fdp.optim.adamw(0.1)
    opt_state = opt.init(params)
    ddp = fdp.DistributedDataParallel(params)
    for step in range(2):
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(step * size + rank))

        def loss(p: dict[str, torch.Tensor], x: torch.Tensor = x) -> torch.Tensor:
            q = p if apart else ddp(p)  # apart: the mistake of a loss that read params
            return (x @ q["a"]).square().sum() + q["b"].sum()

        grads = torch.func.grad(loss)(params)
        params, opt_state = opt.update(grads, opt_state, params)
    state = {"params": params, "opt": opt_state, "step": 2}
    message = _save(rank, path, state)
    if message != "saved":
        return message
    like = {"params": _params(), "opt": opt.init(_params()), "step": 0}
    return detached_copy(state), fdp.load_checkpoint(path, like)


def test_a_functional_loop_that_trained_apart_is_refused(tmp_path: Path) -> None:
    # Before: only leaves that required grad were compared, so fdp.optim's
    # plain tensors saved rank 0's without a word.
    messages = ranks.world(2).run(_functional_loop, str(tmp_path / "c"), True)
    assert messages[0] == messages[1]
    assert "`state` leaf state['opt']['exp_avg']['a'] (and " in messages[0]
    assert "state['params']['a']) is written once" in messages[0]  # b's gradient: x-free
    assert (
        "Probably parameters that trained apart: compute the loss from ddp(params)" in (messages[0])
    )


def test_a_functional_loop_in_step_saves_and_loads_bitwise(tmp_path: Path) -> None:
    (saved0, loaded0), (saved1, loaded1) = ranks.world(2).run(
        _functional_loop, str(tmp_path / "c"), False
    )
    tree_allclose(saved0, saved1, rtol=0, atol=0)  # the reference: what was saved
    for loaded in (loaded0, loaded1):
        tree_allclose(loaded, saved0, rtol=0, atol=0)


def _per_rank(rank: int, size: int, path: str, kind: str) -> str:
    state: dict[str, Any] = {"w": torch.ones(3)}
    if kind == "value":
        state["position"] = 10 + rank
    elif kind == "counter":
        state["seen"] = torch.tensor(rank)
    elif kind == "buffers":
        state["buffers"] = {"running_mean": torch.full((4,), float(rank))}
    elif kind == "broadcast":
        state["buffers"] = fdp.broadcast_params({"running_mean": torch.full((4,), float(rank))})
    elif kind == "signed_zero":
        state["w"] = torch.tensor([0.0, -0.0 if rank else 0.0])
    elif kind == "swapped":
        # Positions 0 and 7 swapped: equal sums, and equal sums weighted mod 7.
        w = torch.arange(1.0, 9.0)
        state["w"] = w[[7, 1, 2, 3, 4, 5, 6, 0]] if rank else w
    return _save(rank, path, state)


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("value", "`state` leaf state['position'] is written once, from rank 0"),
        ("counter", "leaf state['seen'] is written once"),
        ("buffers", "fdp.broadcast_params(buffers) before saving"),
        ("broadcast", "saved"),
        ("signed_zero", "leaf state['w'] is written once"),
        ("swapped", "leaf state['w'] is written once"),
    ],
)
def test_values_that_differ_across_ranks_are_refused(
    tmp_path: Path, kind: str, expected: str
) -> None:
    messages = ranks.world(2).run(_per_rank, str(tmp_path / kind), kind)
    assert messages[0] == messages[1]
    assert expected in messages[0]
    if kind == "value":
        assert "a global sample position" in messages[0]


_TOO_LONG = "n" * 300  # a name the file system refuses (ENAMETOOLONG), even to root


_SAME = ("ValueError", "TypeError")  # the kinds the other ranks raise too


@contextlib.contextmanager
def _failing_writes(fail: bool) -> Iterator[None]:
    """DCP's file writes raise on this rank (a full disk) inside the block."""
    from torch.distributed.checkpoint import filesystem

    def full(*args: Any, **kwargs: Any) -> Any:
        raise OSError(28, "No space left on device")

    kept = filesystem._write_item
    if fail:
        filesystem._write_item = full
    try:
        yield
    finally:
        filesystem._write_item = kept


def _fails_on_one_rank(rank: int, size: int, root: str, case: str) -> tuple[str, str]:
    """One rank's local work fails; returns what this rank raised, and its message."""
    state: dict[str, Any] = {"w": torch.ones(3), "step": 3}
    path, failing = os.path.join(root, "c"), case.endswith("rank_0")
    mine = os.path.join(root, _TOO_LONG) if rank == (0 if failing else 1) else path
    try:
        if case == "save_state_rank_1" and rank == 1:
            state["w"] = state["w"].to_sparse()  # refused by this rank's own check
        if case == "save_stage_rank_0":  # the path's parent a file: rank 0 makes the stage
            Path(root, "file").touch()
            path = os.path.join(root, "file", "c")
        if case.startswith("save"):
            with _failing_writes(case == "save_write_rank_1" and rank == 1):  # a full disk
                fdp.save_checkpoint(path, state)
        elif case.startswith("load"):
            fdp.save_checkpoint(path, state)
            like = {"w": torch.ones(4), "step": 0} if rank == 1 else state
            fdp.load_checkpoint(path if case == "load_like_rank_1" else mine, like)
        else:
            fdp.latest_checkpoint(mine)
    except (ValueError, TypeError, RuntimeError, OSError) as e:
        return type(e).__name__, str(e)
    return "returned", ""


@pytest.mark.parametrize(
    ("case", "theirs", "message"),
    [
        ("save_state_rank_1", "TypeError", "`state` leaf state['w'] expected a dense tensor"),
        ("save_stage_rank_0", "NotADirectoryError", "Not a directory"),
        ("save_write_rank_1", "RuntimeError", "could not write `path`"),
        ("load_path_rank_1", "OSError", "File name too long"),
        ("load_like_rank_1", "ValueError", "like['w'] expected shape (4,)"),
        ("latest_rank_0", "OSError", "File name too long"),
    ],
)
def test_a_failure_on_one_rank_raises_on_every_rank(
    tmp_path: Path, case: str, theirs: str, message: str
) -> None:
    # Before: the rank that failed raised, and the others waited in the call's next
    # collective until the process group's timeout (gloo's "Timed out" or "Connection
    # closed" errors there); DCP's own failure escaped `except Exception` (a BaseException).
    got = ranks.world(2).run(_fails_on_one_rank, str(tmp_path), case)
    failing = 0 if case.endswith("rank_0") else 1
    kind, said = got[failing]
    assert kind == theirs
    assert message in said
    other_kind, other_said = got[1 - failing]
    if case == "save_write_rank_1":  # DCP's error, the same on every rank
        assert (other_kind, other_said.split(": rank")[1]) == (kind, said.split(": rank")[1])
        return
    assert other_kind == ("RuntimeError" if "Error" in kind and kind not in _SAME else kind)
    assert other_said.startswith(f"fdp.{case.split('_')[0]}")
    assert f": rank {failing} raised {kind}: " in other_said
    assert message in other_said


def _per_rank_paths(rank: int, size: int, root: str) -> str:
    try:
        fdp.save_checkpoint(os.path.join(root, f"rank{rank}"), {"w": torch.ones(3)})
    except ValueError as e:
        return str(e)
    return "saved"


def test_a_path_per_rank_is_refused_on_every_rank(tmp_path: Path) -> None:
    # torch.save's habit (ckpt/rank{rank}): before, rank 0 wrote a checkpoint without
    # rank 1's pieces and rank 1's files stayed in a staging directory no one switched in.
    messages = ranks.world(2).run(_per_rank_paths, str(tmp_path))
    assert messages[0] == messages[1]
    assert messages[0].startswith(
        "fdp.save_checkpoint: `path` expected the same directory on every rank"
    )
    assert (
        f"got {str(tmp_path / 'rank0')!r} on rank 0 and {str(tmp_path / 'rank1')!r}" in messages[0]
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written


def test_the_checksum_reads_bits_in_logical_order() -> None:
    x = torch.randn(6, 5, dtype=torch.float64)
    same = [x.t().contiguous().t(), x.clone(), x[:, :]]
    for y in same:
        assert torch.equal(_agreement.tensor_fingerprint(y), _agreement.tensor_fingerprint(x))
    nudged = x.clone()
    nudged.view(-1).view(torch.int64)[4] ^= 1  # one bit of one element
    swapped = x.reshape(-1)[[7, 1, 2, 3, 4, 5, 6, 0, *range(8, 30)]].reshape(6, 5)
    for y in (nudged, swapped, x.to(torch.float32)):
        assert not torch.equal(_agreement.tensor_fingerprint(y), _agreement.tensor_fingerprint(x))
    # Every dtype and an odd number of bytes.
    for t in (
        torch.ones(3, dtype=torch.bool),
        torch.ones(3, dtype=torch.bfloat16),
        torch.ones(3, dtype=torch.complex64),
    ):
        assert _agreement.tensor_fingerprint(t).shape == (2,)


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 2)
    )


def test_a_module_state_loads_in_place_into_the_module(tmp_path: Path) -> None:
    # Before: new tensors came back, and a torch optimizer over the module's
    # parameters never changed what fn(loaded, x) used.
    trained = _net()
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(1.0)
    trained(torch.randn(8, 4))  # running statistics
    _, saved = fdp.make_functional(trained)
    fdp.save_checkpoint(tmp_path / "c", {"model": saved, "step": 3})

    net = _net()
    fn, state = fdp.make_functional(net)
    loaded: dict[str, Any] = fdp.load_checkpoint(tmp_path / "c", {"model": state, "step": 0})
    assert all(loaded["model"][k] is state[k] for k in state)  # the module's own tensors
    reference = _net()
    reference.load_state_dict(trained.state_dict())
    tree_allclose(dict(net.state_dict()), dict(reference.state_dict()), rtol=0, atol=0)

    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    outputs = (fn(loaded["model"], x), reference(x))
    for model, out in zip((net, reference), outputs, strict=True):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        out.square().sum().backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        opt.step()
        assert len(grads) == 6
    tree_allclose(dict(net.state_dict()), dict(reference.state_dict()), rtol=0, atol=0)
    tree_allclose({k: p.grad for k, p in net.named_parameters()},
                  {k: p.grad for k, p in reference.named_parameters()}, rtol=0, atol=0)  # fmt: skip


def test_plain_tensors_in_like_still_load_into_new_tensors(tmp_path: Path) -> None:
    fdp.save_checkpoint(tmp_path / "c", {"w": torch.ones(3)}, rng=False)
    like = {"w": torch.zeros(3)}
    loaded = fdp.load_checkpoint(tmp_path / "c", like)
    assert loaded["w"] is not like["w"]
    torch.testing.assert_close(like["w"], torch.zeros(3), rtol=0, atol=0)
    torch.testing.assert_close(loaded["w"], torch.ones(3), rtol=0, atol=0)
