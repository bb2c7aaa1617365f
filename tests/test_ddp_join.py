"""DistributedDataParallel.join: ranks with different numbers of batches (fdp._ddp._join).

Rank 0 trains on 3 batches, rank 1 on 5, rank 2 on none. At every step the
reference is the single-process sum of the gradients of the ranks that
still had data, divided by the initial world size or by their number.
"""

from __future__ import annotations

import contextlib
import datetime
from typing import Any

import optree
import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join
from torch.utils.checkpoint import checkpoint

import fdp
from tests import ranks
from tests.helpers import (
    PER_RANK,
    TINY,
    TOL,
    BufferProbe,
    batch,
    mlp,
    mlp_params,
    shard,
    tensor_leaves,
)

BATCHES = [3, 5, 0]


def loss(params: dict[str, Any], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(mlp(params, x), y)


def flat(params: dict[str, Any]) -> torch.Tensor:
    leaves = [params["head"].first, *(t for layer in params["layers"] for t in layer.values())]
    return torch.cat([t.grad.reshape(-1) for t in leaves if t.grad is not None])


def data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batch(3 * PER_RANK, seed=10 + step)
    return shard(x, rank), shard(y, rank)


def _join(rank: int, size: int, by_initial: bool, micro: int) -> list[torch.Tensor]:
    """Per step: ``micro - 1`` micro-batches under no_sync, then a synchronised one."""
    params = mlp_params(depth=2)
    params["count"] = torch.tensor(rank)  # a buffer: the highest rank training wins
    ddp = fdp.DistributedDataParallel(params)
    out = []
    with ddp.join(divide_by_initial_world_size=by_initial):
        for step in range(BATCHES[rank]):
            for m in range(micro):
                params["count"].fill_(rank)  # each rank's own value before the call
                x, y = data(step * micro + m, rank)
                if m < micro - 1:
                    with ddp.no_sync():
                        torch.autograd.backward(loss(ddp(params), x, y))
                else:
                    torch.autograd.backward(loss(ddp(params), x, y))
                # As torch's Join: the first micro-batch's call broadcasts from the
                # highest rank still training (rank 1 throughout), the others none.
                assert int(params["count"]) == (1 if m == 0 else rank)
            out.append(flat(params))
            for t in optree.tree_leaves(params):  # type: ignore[var-annotated,arg-type]
                if t is not None:
                    t.grad = None
    return out


def expected(step: int, by_initial: bool, micro: int) -> torch.Tensor:
    training = [r for r in range(3) if BATCHES[r] > step]
    params = mlp_params(depth=2)
    for r in training:
        for m in range(micro):
            x, y = data(step * micro + m, r)
            torch.autograd.backward(loss(params, x, y) / (3 if by_initial else len(training)))
    return flat(params)


@pytest.mark.parametrize("by_initial", [True, False], ids=["initial", "training"])
@pytest.mark.parametrize("micro", [1, 2], ids=["sync", "no_sync"])
def test_uneven_batches_average_over_the_ranks_that_have_data(by_initial: bool, micro: int) -> None:
    results = ranks.world(3).run(_join, by_initial, micro)
    for rank, steps in enumerate(results):
        assert len(steps) == BATCHES[rank]
        for step, got in enumerate(steps):
            torch.testing.assert_close(got, expected(step, by_initial, micro), **TOL)


def _join_buffers(rank: int, size: int) -> tuple[list[float], list[float]]:
    """The buffer each forward used, two micro-batches a step: fdp's join, then torch's Join."""
    module = BufferProbe()
    fn, state = fdp.make_functional(module)
    ddp = fdp.DistributedDataParallel(state)
    torch_ddp = torch.nn.parallel.DistributedDataParallel(BufferProbe())
    runs: list[tuple[torch.nn.Module, Any, Any, Any]] = [
        (module, lambda x: fn(ddp(state), x), ddp.no_sync, ddp.join),
        (torch_ddp.module, torch_ddp, torch_ddp.no_sync, lambda: Join([torch_ddp])),
    ]
    seen: tuple[list[float], list[float]] = ([], [])
    for k, (held, forward, no_sync, join) in enumerate(runs):
        with join():
            for _ in range(BATCHES[rank]):
                for m in range(2):
                    held.get_buffer("value").fill_(rank)
                    with no_sync() if m == 0 else contextlib.nullcontext():
                        out = forward(torch.ones(3))
                        seen[k].append(float(out[0] - 1.0))
                        out.sum().backward()
    return seen


def test_buffers_inside_join_come_from_where_torchs_do() -> None:
    # torch's DDP inside Join broadcasts from the highest rank still training
    # (before, fdp took the lowest, and broadcast on synchronised calls only).
    for rank, (fdp_seen, torch_seen) in enumerate(ranks.world(3).run(_join_buffers)):
        assert fdp_seen == torch_seen
        assert fdp_seen == [1.0 if m == 0 else rank for _ in range(BATCHES[rank]) for m in (0, 1)]


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _averaged_later(state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """A user's hook whose division runs in the future's callback (fdp runs such hooks serially)."""
    work = dist.all_reduce(bucket.buffer(), async_op=True)
    world = dist.get_world_size()
    done: torch.futures.Future[torch.Tensor] = work.get_future().then(
        lambda f: f.value()[0].div_(world)
    )
    return done


# torch's register_comm_hook compares the annotations with the types (postponed: strings).
_averaged_later.__annotations__.update(
    {"bucket": getattr(dist, "GradBucket"), "return": torch.futures.Future[torch.Tensor]}  # noqa: B009
)


def _comm_hook(name: str) -> tuple[Any, Any]:
    """A fresh (state, hook) of torch's own, run unmodified by both DDPs."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD

    if name == "powersgd":  # stateful; compresses from its second step, with error feedback
        state = powerSGD.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)
        return state, powerSGD.powerSGD_hook
    hooks = {
        "allreduce": default_hooks.allreduce_hook,
        "fp16": default_hooks.fp16_compress_hook,
        "callback": _averaged_later,
    }
    return None, hooks[name]


def _join_hooked(rank: int, size: int, name: str, plain: bool) -> list[torch.Tensor]:
    """torch's DDP with the hook inside Join, then fdp's: each rank's parameters after.

    ``plain``: fdp's DDP made from tensors that need no grad (a functional
    loop's), while the calls' tensors need it.
    """
    xs = [
        torch.randn(4, 6, generator=torch.Generator().manual_seed(9 * rank + i)) for i in range(8)
    ]
    out = []
    for side in ("torch", "fdp"):
        net = _net()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        if side == "torch":
            model: Any = torch.nn.parallel.DistributedDataParallel(net)
            model.register_comm_hook(*_comm_hook(name))
            joined: Any = Join([model])
        else:
            model, joined, _made = _fdp_hooked(net, name, plain)
        with joined:
            for x in xs[: BATCHES[rank]]:
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
        out.append(torch.cat([p.detach().reshape(-1) for p in net.parameters()]))
    return out


def _fdp_hooked(net: torch.nn.Module, name: str, plain: bool) -> tuple[Any, Any, Any]:
    """fdp's DDP of ``net`` with the hook: the model, its join block, the construction tree.

    The tree is held: a rank that never calls ddp(params) (rank 2) ends the
    block with its final synchronisation (``plain``'s shares the storage).
    """
    fn, state = fdp.make_functional(net)
    made = {k: v.detach() for k, v in state.items()} if plain else state
    ddp = fdp.DistributedDataParallel(made)
    ddp.register_comm_hook(*_comm_hook(name))
    return (lambda x: fn(ddp(state), x)), ddp.join(), made


@pytest.mark.parametrize(
    ("name", "plain"),
    [("allreduce", False), ("allreduce", True), ("fp16", False), ("powersgd", False),
     ("callback", True)],
)  # fmt: skip
def test_a_comm_hook_inside_join_trains_as_torchs_join(name: str, plain: bool) -> None:
    # Before, join refused every hook but the default's own, and with that one
    # hung where the DDP was made from tensors that need no grad: the ranks
    # that left counted the leaves requiring grad at construction (none).
    for torch_params, fdp_params in ranks.world(3).run(_join_hooked, name, plain):
        torch.testing.assert_close(fdp_params, torch_params, rtol=0, atol=0)


def _hook_dividing_by_training_ranks(rank: int, size: int) -> str:
    ddp = fdp.DistributedDataParallel(mlp_params(depth=2))
    ddp.register_comm_hook(None, fdp.allreduce_hook)
    try:
        with ddp.join(divide_by_initial_world_size=False):
            pass
    except ValueError as e:
        return str(e)
    return "entered"


def test_dividing_by_the_ranks_training_under_a_comm_hook_is_refused() -> None:
    # torch's DDP ignores divide_by_initial_world_size under a hook, which divides itself.
    for message in ranks.world(3).run(_hook_dividing_by_training_ranks):
        assert message.startswith(
            "fdp.DistributedDataParallel.join: `divide_by_initial_world_size` expected True "
            "with a comm hook"
        )


def _collective_in_join(rank: int, size: int, path: str, where: str) -> tuple[str, Any]:
    """Each rank's error (or "ok") and the mean losses ``fdp.all_reduce`` gave (steps 0-2)."""
    params = mlp_params(depth=2)
    ddp = fdp.DistributedDataParallel(params)
    means: list[float] = []
    try:
        with ddp.join():
            for step in range(BATCHES[rank]):
                value = loss(ddp(params), *data(step, rank))
                torch.autograd.backward(value)
                if step < 3 and where == "one_left_at_once":  # rank 2 has no batch: it left
                    means.append(float(fdp.all_reduce(value.detach(), "mean")))
                if step == 1 and where == "after_one_left" and rank == 1:
                    fdp.save_checkpoint(path, {"step": step})  # rank 0 is still training
            if where == "after_the_loop":  # inside the block: the others still train
                fdp.save_checkpoint(path, {"done": True})
    except RuntimeError as e:
        return str(e), means
    return "ok", means


@pytest.mark.parametrize("where", ["one_left_at_once", "after_one_left", "after_the_loop"])
def test_a_collective_inside_join_is_made_by_every_rank_or_raises_on_every_rank(
    tmp_path: Any, where: str
) -> None:
    # Before, a rank that had left answered the collective with the join's flags
    # exchange: garbage on one side, and the others waited (240 s, past the process
    # group's timeout, in a group made from garbage flags).
    got = ranks.world(3).run(_collective_in_join, str(tmp_path / "c"), where)
    if where == "one_left_at_once":  # rank 2 has no batch: it left before step 0
        for message, _ in got:
            assert message.startswith("fdp.")
            assert "a collective inside DistributedDataParallel.join that not every rank" in message
        assert got[0][0].startswith("fdp.all_reduce: ")
        assert got[2][0].startswith("fdp.DistributedDataParallel.join: ")
        return
    for rank, (message, _) in enumerate(got):
        assert "not every rank makes at the same point" in message, (rank, message)
    caller = 1 if where == "after_one_left" else 2  # rank 2 has no batch: its loop ends first
    assert got[caller][0].startswith("fdp.save_checkpoint: ")


def _metric_while_every_rank_trains(rank: int, size: int) -> list[float]:
    params = mlp_params(depth=2)
    ddp = fdp.DistributedDataParallel(params)
    means = []
    with ddp.join():
        for step in range([2, 3, 2][rank]):
            value = loss(ddp(params), *data(step, rank))
            torch.autograd.backward(value)
            if step < 2:  # every rank takes steps 0 and 1
                means.append(float(fdp.all_reduce(value.detach(), "mean")))
    return means


def test_a_collective_every_rank_makes_inside_join_gives_its_result() -> None:
    expected = [
        sum(float(loss(mlp_params(depth=2), *data(step, r)).detach()) for r in range(3)) / 3
        for step in range(2)
    ]
    for means in ranks.world(3).run(_metric_while_every_rank_trains):
        torch.testing.assert_close(means, expected)


def twice(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``w`` used in two reentrant checkpoints: its second gradient misses its bucket."""

    def layer(h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(h @ params["w"])

    h = x @ params["v"]
    for _ in range(2):
        h = checkpoint(layer, h, use_reentrant=True)
    return torch.nn.functional.mse_loss(h @ params["u"], y)


def twice_params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    shapes = {"v": (6, 6), "w": (6, 6), "u": (6, 3)}
    return {k: (torch.randn(*s, generator=g) / 3).requires_grad_() for k, s in shapes.items()}


def _join_late(rank: int, size: int) -> list[dict[str, torch.Tensor | None]]:
    params = twice_params()
    ddp = fdp.DistributedDataParallel(params, **TINY)
    out = []
    with ddp.join():
        for step in range(BATCHES[rank]):
            torch.autograd.backward(twice(ddp(params), *data(step, rank)))
            out.append({k: p.grad for k, p in params.items()})
            for p in params.values():
                p.grad = None
    return out


def test_ranks_that_left_mirror_the_reduction_of_late_gradients() -> None:
    """The extra all-reduce of late gradients is mirrored by ranks that ran out of data."""
    results = ranks.world(3).run(_join_late)
    for rank, steps in enumerate(results):
        assert len(steps) == BATCHES[rank]
        for step, got in enumerate(steps):
            params = twice_params()
            for r in (r for r in range(3) if BATCHES[r] > step):
                torch.autograd.backward(twice(params, *data(step, r)) / 3)
            for k, p in params.items():
                msg = f"rank {rank} step {step} {k}"
                torch.testing.assert_close(got[k], p.grad, **TOL, msg=msg)


def _raises(rank: int, size: int) -> None:
    # A group with a short timeout, made once every rank is here: the
    # process group's own (30 s) covers start-up, which a loaded machine
    # can stretch past 5 s (a rank then failed joining, not inside join).
    dist.barrier()
    group = dist.new_group(timeout=datetime.timedelta(seconds=5))
    params = mlp_params(depth=2)
    ddp = fdp.DistributedDataParallel(params, group=group)
    with ddp.join():
        for step in range(BATCHES[rank]):
            if rank == 1 and step == 1:
                raise ValueError("rank 1 fails inside join")
            torch.autograd.backward(loss(ddp(params), *data(step, rank)))


def test_an_exception_inside_join_reaches_the_other_ranks_as_an_error() -> None:
    world = ranks.World(3)
    try:
        with pytest.raises(ranks.RankError) as info:
            world.run(_raises, timeout_s=60)
    finally:
        world.close()
    message = str(info.value)
    assert "rank 1 fails inside join" in message
    # The others fail at the process group's timeout instead of hanging.
    assert message.count("--- rank") == 3


def bn_params() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    p = {
        "w1": torch.randn(6, 8, generator=g) / 6**0.5,
        "gamma": 1 + 0.1 * torch.randn(8, generator=g),
        "beta": 0.1 * torch.randn(8, generator=g),
        "w2": torch.randn(8, 3, generator=g) / 8**0.5,
    }
    return {k: v.requires_grad_() for k, v in p.items()} | {
        "mean": torch.zeros(8),
        "var": torch.ones(8),
    }


def bn_model(p: dict[str, Any], x: torch.Tensor, norm: Any) -> torch.Tensor:
    h = norm(x @ p["w1"], p["mean"], p["var"], p["gamma"], p["beta"])
    out: torch.Tensor = torch.tanh(h) @ p["w2"]
    return out


def _join_bn(rank: int, size: int) -> list[dict[str, torch.Tensor]]:
    p = bn_params()
    ddp = fdp.DistributedDataParallel(p)
    out = []
    with ddp.join():
        for step in range(BATCHES[rank]):
            x, y = data(step, rank)
            pred = bn_model(ddp(p), x, fdp.sync_batch_norm)
            torch.autograd.backward(torch.nn.functional.mse_loss(pred, y))
            out.append({k: v.grad.clone() for k, v in p.items() if v.grad is not None})
            out[-1] |= {"mean": p["mean"].clone(), "var": p["var"].clone()}
            for t in p.values():
                t.grad = None
    return out


def expected_bn(steps: int) -> list[dict[str, torch.Tensor]]:
    """Batch norm over the concatenated batches of the ranks still training."""
    p = bn_params()
    out = []
    for step in range(steps):
        training = [r for r in range(3) if BATCHES[r] > step]
        xs, ys = zip(*(data(step, r) for r in training), strict=True)
        h = torch.cat(xs) @ p["w1"]
        h = torch.nn.functional.batch_norm(
            h, p["mean"], p["var"], p["gamma"], p["beta"], training=True
        )
        pred = torch.tanh(h) @ p["w2"]
        losses = [
            torch.nn.functional.mse_loss(part, y)
            for part, y in zip(pred.split(PER_RANK), ys, strict=True)
        ]
        torch.autograd.backward(torch.stack(losses).sum() / 3)
        out.append({k: v.grad.clone() for k, v in p.items() if v.grad is not None})
        out[-1] |= {"mean": p["mean"].clone(), "var": p["var"].clone()}
        for t in p.values():
            t.grad = None
    return out


def test_sync_batch_norm_inside_join_takes_statistics_over_the_ranks_still_training() -> None:
    results = ranks.world(3).run(_join_bn)
    reference = expected_bn(max(BATCHES))
    for rank, steps in enumerate(results):
        assert len(steps) == BATCHES[rank]
        for step, got in enumerate(steps):
            for key, value in reference[step].items():
                torch.testing.assert_close(got[key], value, **TOL, msg=f"rank {rank} {key}")


def _final_sync(rank: int, size: int, new_tensors: bool) -> dict[str, torch.Tensor]:
    """SGD steps inside join; rank 1 trains longest and the others take its result."""
    params = mlp_params(depth=2)
    params["count"] = torch.tensor(0)  # a buffer each rank bumps at its own steps
    ddp = fdp.DistributedDataParallel(params)
    with ddp.join():
        for step in range(BATCHES[rank]):
            torch.autograd.backward(loss(ddp(params), *data(step, rank)))
            with torch.no_grad():
                params["count"] += 1
                if new_tensors:  # a functional update: the tensors ddp saw are dropped
                    params = optree.tree_map(  # type: ignore[assignment]
                        lambda t: t if not t.requires_grad else (t - 0.1 * t.grad).requires_grad_(),
                        params,  # type: ignore[arg-type]
                    )
                else:
                    for t in optree.tree_leaves(params):  # type: ignore[var-annotated,arg-type]
                        if t is not None and t.requires_grad:
                            t -= 0.1 * t.grad
                            t.grad = None
    return {"flat": torch.cat([t.detach().reshape(-1).float() for t in tensor_leaves(params)])}


def sgd_reference() -> torch.Tensor:
    params = mlp_params(depth=2)
    for step in range(max(BATCHES)):
        for r in (r for r in range(3) if BATCHES[r] > step):
            torch.autograd.backward(loss(params, *data(step, r)) / 3)
        with torch.no_grad():
            for t in tensor_leaves(params):
                assert t.grad is not None
                t -= 0.1 * t.grad
                t.grad = None
    params["count"] = torch.tensor(max(BATCHES))
    return torch.cat([t.detach().reshape(-1).float() for t in tensor_leaves(params)])


@pytest.mark.parametrize("new_tensors", [False, True], ids=["in_place", "new_tensors"])
def test_leaving_join_every_rank_takes_the_last_ranks_parameters(new_tensors: bool) -> None:
    results = ranks.world(3).run(_final_sync, new_tensors)
    reference = sgd_reference()
    torch.testing.assert_close(results[1]["flat"], reference, **TOL)  # rank 1 trained last
    for rank in (0, 2):
        if new_tensors:  # nothing to synchronise: ddp never saw the final tensors
            assert not torch.equal(results[rank]["flat"], reference)
        else:
            torch.testing.assert_close(results[rank]["flat"], results[1]["flat"], rtol=0, atol=0)


def _join_compiled(rank: int, size: int) -> list[torch.Tensor]:
    """As ``_join``, with ``ddp(params)`` inside a compiled loss (run eagerly there)."""
    torch._dynamo.reset()
    params = mlp_params(depth=2)
    ddp = fdp.DistributedDataParallel(params)
    compiled = torch.compile(lambda p, x, y: loss(ddp(p), x, y), backend="aot_eager")
    out = []
    with ddp.join(divide_by_initial_world_size=True):
        for step in range(BATCHES[rank]):
            torch.autograd.backward(compiled(params, *data(step, rank)))
            out.append(flat(params))
            for t in tensor_leaves(params):
                t.grad = None
    return out


def test_ddp_inside_a_compiled_loss_in_a_join_block_runs_eagerly() -> None:
    # Under fullgraph=True dynamo raises instead, with fdp's reason (IN_JOIN).
    for rank, steps in enumerate(ranks.world(3).run(_join_compiled)):
        assert len(steps) == BATCHES[rank]
        for step, got in enumerate(steps):
            torch.testing.assert_close(got, expected(step, True, 1), **TOL)


def _join_func_grad(rank: int, size: int) -> str:
    """Rank 0 has no data (it leaves at once); rank 1 steps with torch.func.grad."""
    tree: dict[str, Any] = optree.tree_map(torch.Tensor.detach, mlp_params())  # type: ignore[arg-type,assignment]
    layers = tree["layers"]  # what torch.func.grad differentiates: no None leaf
    ddp = fdp.DistributedDataParallel(layers)
    x, y = data(0, rank)

    def train() -> None:
        with ddp.join():
            for _ in range(rank):
                torch.func.grad(lambda p: loss({**tree, "layers": ddp(p)}, x, y))(layers)

    with pytest.raises(NotImplementedError) as info:
        train()
    # Every rank raised at the same call: the group still pairs collectives.
    (reduced,) = fdp.all_reduce_grads([torch.full((2,), float(rank))])
    torch.testing.assert_close(reduced, torch.full((2,), (size - 1) / 2))
    return str(info.value)


def test_a_transform_inside_join_raises_on_every_rank() -> None:
    # Before, rank 1 raised and rank 0 waited in join until the group's timeout.
    first, second = ranks.world(2).run(_join_func_grad, timeout_s=20)
    assert first == second
    assert "every rank raises" in first
