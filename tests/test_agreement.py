"""Cross-rank agreement: every rank holds the same tree, or every rank raises the same error.

Each body runs on spawned gloo ranks (tests/ranks.py); results are compared
with plain single-process computations of the average over ranks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

import fdp
from tests import ranks


def _grads_of(rank: int, what: str) -> dict[str, Any]:
    if rank == 0:
        return {"a": torch.ones(2, 3)}
    trees: dict[str, dict[str, Any]] = {
        "other_shape": {"a": torch.ones(3, 2)},  # same numel
        "other_key": {"b": torch.ones(2, 3)},
        "other_size": {"a": torch.ones(7)},  # used to abort the process in gloo
        "other_dtype": {"a": torch.ones(2, 3, dtype=torch.float64)},
        "other_layout": {"a": torch.arange(6.0).view(3, 2).t()},  # packed in memory order
        # refused by rank 1's own checks: the other rank used to wait for the group's timeout
        "a_str_leaf": {"a": "x"},
        "an_int_tensor": {"a": torch.ones(2, 3, dtype=torch.int64)},
    }
    return trees[what]


def _all_reduce_mismatch(rank: int, size: int, what: str) -> tuple[str, list[float]]:
    with pytest.raises(ValueError, match="differs across ranks") as info:
        fdp.all_reduce_grads(_grads_of(rank, what))
    # The group is still usable, and a matching tree is reduced correctly.
    (ok,) = fdp.all_reduce_grads([torch.full((3,), float(rank))])
    return str(info.value), ok.tolist()


@pytest.mark.parametrize(
    "what",
    [
        "other_shape",
        "other_key",
        "other_size",
        "other_dtype",
        "other_layout",
        "a_str_leaf",
        "an_int_tensor",
    ],
)
def test_all_reduce_grads_refuses_trees_that_differ_across_ranks(what: str) -> None:
    results = ranks.world(2).run(_all_reduce_mismatch, what)
    messages = {m for m, _ in results}
    assert len(messages) == 1, messages  # the same error on every rank
    (message,) = messages
    assert message.startswith("fdp.all_reduce_grads: `grads` differs across ranks at leaf 0")
    assert "rank 0 has grads['a'] = a tensor of shape (2, 3), dtype torch.float32" in message
    for _, ok in results:
        assert ok == [0.5, 0.5, 0.5]


def _refused_on_rank_1(rank: int, size: int, what: str) -> tuple[str, str, list[float]]:
    """``what`` built with an argument only rank 1's own checks refuse; what each rank raised."""
    params: dict[str, Any] = {"w": torch.ones(2, 3), "b": torch.zeros(3)}
    bad = rank == 1
    leaf = {**params, "s": "x"} if bad else params
    cap = -1.0 if bad else 25.0
    try:
        if what == "ddp_leaf":
            fdp.DistributedDataParallel(leaf)
        elif what == "ddp_option":
            fdp.DistributedDataParallel(params, bucket_cap_mb=cap)
        elif what == "zero_option":
            fdp.ZeroRedundancy(fdp.optim.sgd(0.1), params, bucket_cap_mb=cap)
        elif what == "fsdp_leaf":
            fdp.FullyShardedDataParallel(leaf)
        else:
            fdp.broadcast_params(leaf)
    except (TypeError, ValueError) as e:
        error = (type(e).__name__, str(e))
    else:
        error = ("returned", "")
    (ok,) = fdp.all_reduce_grads([torch.full((3,), float(rank))])  # the group is still usable
    return *error, ok.tolist()


@pytest.mark.parametrize(
    ("what", "kind", "message"),
    [
        ("ddp_leaf", "TypeError", "`params` leaf params['s'] expected a tensor or None"),
        ("ddp_option", "ValueError", "`bucket_cap_mb` expected a finite number of MiB > 0"),
        ("zero_option", "ValueError", "`bucket_cap_mb` expected a finite number of MiB > 0"),
        ("fsdp_leaf", "TypeError", "`params` leaf params['s'] expected a tensor or None"),
        ("broadcast_leaf", "TypeError", "`tree` leaf tree['s'] expected a tensor or None"),
    ],
)
def test_a_constructor_refused_on_one_rank_raises_on_every_rank(
    what: str, kind: str, message: str
) -> None:
    # Before: rank 1 raised, and rank 0 waited in the agreement until the group's timeout.
    (kind0, said0, ok0), (kind1, said1, ok1) = ranks.world(2).run(_refused_on_rank_1, what)
    assert kind1 == kind
    assert message in said1
    call = said1.split(":")[0]
    assert kind0 == "ValueError"
    assert said0.startswith(f"{call}: rank 1 raised {kind}: ")
    assert message in said0
    assert ok0 == ok1 == [0.5, 0.5, 0.5]


def _two_threads_two_groups(rank: int, size: int, steps: int) -> list[str]:
    groups = [dist.new_group(list(range(size))) for _ in range(2)]
    failures: list[str] = []
    start = threading.Barrier(2, timeout=30)

    def run(t: int) -> None:
        start.wait()
        for step in range(steps):
            value = float(100 * t + 10 * step + rank)
            out = fdp.all_reduce_grads({"w": torch.full((64,), value)}, group=groups[t])
            expected = 100 * t + 10 * step + (size - 1) / 2
            if not torch.all(out["w"] == expected):
                failures.append(f"thread {t} step {step}: {out['w'][:2].tolist()} != {expected}")

    threads = [threading.Thread(target=run, args=(t,)) for t in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    if any(th.is_alive() for th in threads):
        failures.append("a thread hung")
    return failures


def test_all_reduce_grads_from_two_threads_on_two_groups() -> None:
    # Same leaf shapes in both threads: the buffers must never be shared.
    for failures in ranks.world(2).run(_two_threads_two_groups, 40):
        assert failures == []


def _requires_grad_mismatch(rank: int, size: int) -> str:
    params = {"w": torch.ones(3, requires_grad=True), "b": torch.ones(2, requires_grad=rank == 0)}
    with pytest.raises(ValueError, match="differs across ranks") as info:
        fdp.DistributedDataParallel(params)
    return str(info.value)


def test_ddp_refuses_requires_grad_on_some_ranks_only() -> None:
    messages = set(ranks.world(2).run(_requires_grad_mismatch))
    assert len(messages) == 1, messages
    (message,) = messages
    assert "params['b']" in message
    assert "requires_grad=True" in message
    assert "requires_grad=False" in message


def _params_of(rank: int, what: str) -> dict[str, torch.Tensor]:
    params = {"conv": torch.ones(4, 3, 2, 2), "bias": torch.ones(4)}
    if rank == 1:
        if what == "other_shape":  # same numel
            params["bias"] = torch.ones(2, 2)
        elif what == "other_count":
            params["extra"] = torch.ones(1)
        elif what == "other_layout":  # same shape, other memory order
            params["conv"] = params["conv"].to(memory_format=torch.channels_last)
        elif what == "other_dtype":
            params["bias"] = params["bias"].double()
        elif what == "other_key":
            params["b"] = params.pop("bias")
    return {k: v.requires_grad_() for k, v in params.items()}


def _mismatch_found(rank: int, size: int, what: str) -> tuple[bool, str]:
    """(torch's DDP check refuses, fdp's error or "") for the same trees."""
    params = _params_of(rank, what)
    world = dist.group.WORLD
    if world is None:
        raise RuntimeError("no default group")
    try:
        dist._verify_params_across_processes(world, list(params.values()), None)  # type: ignore[attr-defined]
        torch_refuses = False
    except RuntimeError:
        torch_refuses = True
    try:
        fdp.DistributedDataParallel(params)
        return torch_refuses, ""
    except ValueError as e:
        return torch_refuses, str(e)


@pytest.mark.parametrize(
    "what", ["same", "other_shape", "other_count", "other_layout", "other_dtype", "other_key"]
)
def test_ddp_refuses_at_least_what_torchs_ddp_check_refuses(what: str) -> None:
    # torch's own check (shapes, strides, count) is the reference; fdp also
    # compares dtypes and pytree paths, which torch has no names for.
    results = ranks.world(2).run(_mismatch_found, what)
    torch_refuses = any(t for t, _ in results)  # torch raises on the ranks unlike rank 0
    assert torch_refuses == (what in {"other_shape", "other_count", "other_layout"})
    messages = {m for _, m in results}  # fdp: the same error on every rank
    assert len(messages) == 1, messages
    if what == "same":
        assert messages == {""}
    else:
        assert "`params` differs across ranks" in messages.pop()


def _group_and_empty_errors(rank: int, size: int) -> list[str]:
    pair = dist.new_group([0, 1])  # every rank must call new_group; rank 2 is outside
    messages = []
    if rank == 2:
        for call in (
            lambda: fdp.all_reduce_grads({"w": torch.ones(2)}, group=pair),
            lambda: fdp.broadcast_params({"w": torch.ones(2)}, group=pair),
            lambda: fdp.DistributedDataParallel({"w": torch.ones(2)}, group=pair),
        ):
            with pytest.raises(ValueError, match=r"`group` expected a process group that contains"):
                call()
    for empty in ({}, {"steps": torch.tensor(3)}):
        with pytest.raises(ValueError, match=r"`params` expected at least one floating-point") as e:
            fdp.DistributedDataParallel(empty)
        messages.append(str(e.value))
    return messages


def test_groups_without_this_rank_and_trees_without_params_are_refused() -> None:
    results = ranks.world(3).run(_group_and_empty_errors)
    assert all(r == results[0] for r in results)


@pytest.mark.parametrize(
    ("cap", "error", "match"),
    [
        (float("inf"), ValueError, r"`bucket_cap_mb` expected a finite number of MiB > 0; got inf"),
        (float("nan"), ValueError, r"`bucket_cap_mb` expected a finite number of MiB > 0; got nan"),
        (0, ValueError, r"`bucket_cap_mb` expected a finite number of MiB > 0; got 0"),
        ("25", TypeError, r"`bucket_cap_mb` expected a number of MiB > 0; got '25'"),
        (None, TypeError, r"`bucket_cap_mb` expected a number of MiB > 0; got None"),
        (True, TypeError, r"`bucket_cap_mb` expected a number of MiB > 0; got True"),
    ],
)
def test_bad_bucket_caps_are_refused_before_any_collective(
    cap: Any, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=r"fdp.all_reduce_grads: " + match):
        fdp.all_reduce_grads({"w": torch.ones(1)}, bucket_cap_mb=cap)
    with pytest.raises(error, match=r"fdp.DistributedDataParallel: " + match):
        fdp.DistributedDataParallel({"w": torch.ones(1)}, bucket_cap_mb=cap)
    with pytest.raises(error, match=match.replace("bucket_cap_mb", "first_bucket_cap_mb")):
        fdp.DistributedDataParallel({"w": torch.ones(1)}, first_bucket_cap_mb=cap)
    assert not dist.is_initialized()


# --------------------------------------------------------------- initial values


def _sharded(kind: str, params: dict[str, torch.Tensor]) -> object:
    if kind == "zero":
        return fdp.ZeroRedundancy(fdp.optim.adamw(1e-3), params)
    return fdp.FullyShardedDataParallel(params)


def _differing_start(rank: int, size: int, kind: str) -> str:
    g = torch.Generator().manual_seed(rank)
    params = {"w": torch.randn(4, 3, generator=g), "b": torch.zeros(3)}
    with pytest.raises(ValueError, match="expected the same values on every rank") as info:
        _sharded(kind, params)
    fdp.broadcast_params(params)  # the fix the message names
    _sharded(kind, params)
    return str(info.value)


@pytest.mark.parametrize("kind", ["zero", "fsdp"])
def test_sharded_constructors_refuse_ranks_that_start_apart(kind: str) -> None:
    # No rank-0 copy is made there (each rank keeps a shard): before, each rank
    # stepped its own slice of a different model, silently.
    messages = ranks.world(2).run(_differing_start, kind)
    assert messages[0] == messages[1]
    assert "leaf params['w']" in messages[0]
    assert "fdp.broadcast_params(params)" in messages[0]
    assert "params['b']" not in messages[0]


def _shards_to_tree_collectives(rank: int, size: int) -> dict[str, Any]:
    params = {"w": torch.arange(8.0), "v": torch.ones(8)}
    fsdp = fdp.FullyShardedDataParallel(params)
    shards = fsdp.shard(params)
    grads = fdp.grad(lambda s: (fsdp(s)["w"] ** 2).sum() + fsdp(s)["v"].sum())(shards)
    same_ranks = dist.new_group(list(range(size)))  # another group object, the same ranks
    calls: list[tuple[str, Callable[[], Any]]] = [
        ("broadcast", lambda: fdp.broadcast_params(shards)),
        ("all_reduce", lambda: fdp.all_reduce_grads(grads)),
        ("all_reduce_same_ranks", lambda: fdp.all_reduce_grads(grads, group=same_ranks)),
    ]
    out: dict[str, Any] = {}
    for name, call in calls:
        with pytest.raises(ValueError, match="each rank holds other elements") as info:
            call()
        out[name] = str(info.value)
    out["shards"] = fsdp.full(shards)  # untouched
    # Sharded over a group of one rank each (a hybrid layout's shard groups),
    # every rank holds the same elements: reduced over the world as asked.
    alone = [dist.new_group([r]) for r in range(size)][rank]
    whole = fdp.FullyShardedDataParallel(params, group=alone)
    mine = whole.shard(params)
    local = fdp.grad(lambda s: ((rank + 1) * whole(s)["w"] ** 2).sum())(mine)
    out["replicas"] = whole.full(fdp.all_reduce_grads(local))
    return out


def test_tree_collectives_over_the_shards_own_ranks_are_refused() -> None:
    # Before: broadcast_params gave every rank rank 0's shards (the full
    # parameters became [w[:4], w[:4]]), and all_reduce_grads averaged
    # different elements together, silently.
    for out in ranks.world(2).run(_shards_to_tree_collectives):
        assert "fdp.broadcast_params: `tree` are the shards of" in out["broadcast"]
        assert "rank 0's would replace" in out["broadcast"]
        assert "broadcast the parameters before fsdp.shard(params)" in out["broadcast"]
        for name in ("all_reduce", "all_reduce_same_ranks"):
            assert "fdp.all_reduce_grads: `grads` are the shards' gradients of" in out[name]
        torch.testing.assert_close(out["shards"]["w"], torch.arange(8.0), rtol=0, atol=0)
        # the ranks' gradients 2w and 4w, averaged
        torch.testing.assert_close(out["replicas"]["w"], 3 * torch.arange(8.0))
