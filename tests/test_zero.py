"""fdp.ZeroRedundancy on 2-4 gloo ranks against one process running torch.optim.

Each rank's local gradient is a fixed function of the step, the rank and
the current parameters; the reference averages the ranks' gradients in one
process and steps ``torch.optim`` (foreach), which is DDP plus the same
optimizer. Leaf sizes do not divide by the world size; the tree mixes
dtypes, a complex leaf, a ``channels_last`` leaf, a ``None`` leaf and a
leaf without gradient on odd steps.
"""

from __future__ import annotations

import collections
import unittest.mock
from collections.abc import Callable
from typing import Any

import optree
import pytest
import torch

import fdp
from tests import ranks
from tests.helpers import PER_RANK, batch, mlp, mlp_params, shard, tensor_leaves

STEPS = 10
SKIPPED = 1  # leaf index (tensor_leaves order) without gradient on odd steps
SMALL_CAP = 200 / 2**20  # 200 bytes: several buckets, slices that cut leaves

OPTIMIZERS: dict[str, tuple[Callable[..., Any], type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adamw": (fdp.optim.adamw, torch.optim.AdamW, {"lr": 0.01}),
    "adam_amsgrad": (
        fdp.optim.adam,
        torch.optim.Adam,
        {"lr": 0.01, "weight_decay": 0.1, "amsgrad": True},
    ),
    "sgd": (fdp.optim.sgd, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
}


def tree() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)

    def p(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    return {
        "w": p(7, 5),
        "b": p(3),
        "h": p(11, dtype=torch.float64),
        "z": p(5, dtype=torch.complex64),
        "conv": p(2, 3, 2, 2).contiguous(memory_format=torch.channels_last),
        "none": None,
        "list": [p(1), p(13)],
    }


def local_grad(step: int, rank: int, i: int, p: torch.Tensor) -> torch.Tensor | None:
    if i == SKIPPED and step % 2 == 1:
        return None
    g = torch.sin(p * (step + 1)) + 0.1 * (i + 1) + 0.05 * rank * torch.cos(p)
    # Multiples of 2**-10: any order of summing the ranks' gradients is exact,
    # so both sides see the same average and differ only in the update.
    if g.is_complex():
        return torch.complex(torch.round(g.real * 1024), torch.round(g.imag * 1024)) / 1024
    return torch.round(g * 1024) / 1024


def grads_tree(params: Any, step: int, rank: int) -> Any:
    leaves, spec = optree.tree_flatten(params, none_is_leaf=True)
    out: list[torch.Tensor | None] = []
    i = 0
    for t in leaves:
        if t is None:
            out.append(None)
        else:
            out.append(local_grad(step, rank, i, t.detach()))
            i += 1
    return optree.tree_unflatten(spec, out)


def reference(name: str, world: int) -> list[torch.Tensor]:
    """One process: torch.optim on the ranks' averaged gradients."""
    _, torch_cls, hyper = OPTIMIZERS[name]
    params = tensor_leaves(tree())
    opt = torch_cls(params, foreach=True, **hyper)  # type: ignore[call-arg]
    for step in range(STEPS):
        for i, p in enumerate(params):
            local = [local_grad(step, r, i, p.detach()) for r in range(world)]
            p.grad = None if local[0] is None else sum(local) / world  # type: ignore[assignment,arg-type]
        opt.step()
    return [p.detach() for p in params]


def _zero_steps(
    rank: int, size: int, name: str, stage: int, cap: float, nccl_path: bool = False
) -> list[torch.Tensor]:
    if nccl_path:  # the collectives fdp uses on NCCL (reduce-scatter, all-gather), on gloo
        with unittest.mock.patch.object(fdp._sharding._zero_comm, "is_gloo", return_value=False):
            return _zero_steps(rank, size, name, stage, cap)
    make, _, hyper = OPTIMIZERS[name]
    params = tree()
    zero = fdp.ZeroRedundancy(make(**hyper), params, stage=stage, bucket_cap_mb=cap)
    state = zero.init(params)
    for step in range(STEPS):
        params, state = zero.step(grads_tree(params, step, rank), state, params)
    return tensor_leaves(params)


@pytest.mark.parametrize(
    ("world", "name", "stage", "cap", "nccl_path"),
    [
        (2, "adamw", 2, SMALL_CAP, False),
        (2, "adamw", 1, 25.0, False),
        (2, "adamw", 2, SMALL_CAP, True),
        (3, "adam_amsgrad", 2, SMALL_CAP, False),
        (3, "sgd", 1, SMALL_CAP, True),
        (3, "sgd", 2, SMALL_CAP, True),
        (4, "adamw", 2, 25.0, False),
        (4, "sgd", 2, SMALL_CAP, False),
    ],
)
def test_ten_steps_equal_one_process_with_averaged_grads(
    world: int, name: str, stage: int, cap: float, nccl_path: bool
) -> None:
    expected = reference(name, world)
    results = ranks.world(world).run(_zero_steps, name, stage, cap, nccl_path)
    for got in results:  # every rank holds the same, full parameters
        for g, e in zip(got, expected, strict=True):
            assert g.dtype == e.dtype
            assert g.stride() == e.stride()
            torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-7)


def _state_bytes(rank: int, size: int, cap: float) -> tuple[int, int, int]:
    params = mlp_params(inputs=37, depth=3)  # 37x8 + 8 + 8x8 + ... : nothing divides evenly
    zero = fdp.ZeroRedundancy(fdp.optim.adamw(1e-3), params, bucket_cap_mb=cap)
    state = zero.init(params)
    slots = [t for k in ("exp_avg", "exp_avg_sq") for ts in state.slots[k] for t in ts]
    mine = sum(t.numel() * t.element_size() for t in slots)
    total = sum(2 * t.numel() * t.element_size() for t in tensor_leaves(params))
    return mine, total, len(zero.shards.parts)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("cap", [25.0, SMALL_CAP])
def test_optimizer_state_per_rank_is_a_world_th(world: int, cap: float) -> None:
    results = ranks.world(world).run(_state_bytes, cap)
    total, buckets = results[0][1], results[0][2]
    assert sum(mine for mine, _, _ in results) == total  # every element once, no copies
    # Off by at most each bucket's padding: fewer than `world` float32 elements, 2 slots.
    for mine, _, _ in results:
        assert abs(mine - total / world) <= (world - 1) * 2 * 4 * buckets


def _mlp_steps(rank: int, size: int, compiled: bool) -> list[torch.Tensor]:
    x, y = batch(PER_RANK * size)
    params = optree.tree_map(torch.Tensor.detach, mlp_params(head_bias=True))  # type: ignore[arg-type]
    zero = fdp.ZeroRedundancy(fdp.optim.adamw(0.05), params, bucket_cap_mb=SMALL_CAP)

    def loss(p: Any, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(mlp(p, xb), yb)

    def train_step(p: Any, state: Any) -> tuple[Any, Any]:
        grads = torch.func.grad(loss)(p, shard(x, rank), shard(y, rank))
        return zero.step(grads, state, p)

    step = (
        torch.compile(train_step, backend="aot_eager", fullgraph=True) if compiled else train_step
    )
    state = zero.init(params)
    for _ in range(5):
        params, state = step(params, state)
    return tensor_leaves(params)


def mlp_reference(world: int) -> list[torch.Tensor]:
    """One process, the full batch (the mean of equal shards' means), torch.optim.AdamW."""
    x, y = batch(PER_RANK * world)
    params = mlp_params(head_bias=True)
    opt = torch.optim.AdamW(tensor_leaves(params), lr=0.05, foreach=True)
    for _ in range(5):
        opt.zero_grad()
        torch.autograd.backward(torch.nn.functional.mse_loss(mlp(params, x), y))
        opt.step()
    return [p.detach() for p in tensor_leaves(params)]


@pytest.mark.parametrize(
    "compiled", [False, pytest.param(True, marks=pytest.mark.compile)], ids=["eager", "compiled"]
)
def test_func_grad_training_equals_full_batch_adamw(compiled: bool) -> None:
    expected = mlp_reference(2)
    for got in ranks.world(2).run(_mlp_steps, compiled):
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


def _backward_steps(rank: int, size: int) -> tuple[list[torch.Tensor], bool]:
    x, y = batch(PER_RANK * size)
    params = mlp_params()
    zero = fdp.ZeroRedundancy(fdp.optim.sgd(0.1, momentum=0.9), params, stage=1)
    state = zero.init(params)
    for _ in range(3):
        loss = torch.nn.functional.mse_loss(mlp(params, shard(x, rank)), shard(y, rank))
        torch.autograd.backward(loss)
        grads = optree.tree_map(lambda p: p if p is None else p.grad, params, none_is_leaf=True)  # type: ignore[arg-type]
        params, state = zero.step(grads, state, params)
    leaves = tensor_leaves(params)
    return [p.detach() for p in leaves], all(p.is_leaf and p.requires_grad for p in leaves)


def test_backward_loop_gets_leaves_that_require_grad() -> None:
    x, y = batch(PER_RANK * 2)
    params = mlp_params()
    opt = torch.optim.SGD(tensor_leaves(params), lr=0.1, momentum=0.9, foreach=True)
    for _ in range(3):
        opt.zero_grad()
        torch.autograd.backward(torch.nn.functional.mse_loss(mlp(params, x), y))
        opt.step()
    for got, leaves_ok in ranks.world(2).run(_backward_steps):
        assert leaves_ok
        for g, e in zip(got, tensor_leaves(params), strict=True):
            torch.testing.assert_close(g, e.detach(), rtol=1e-5, atol=1e-6)


def _disagreeing_none(rank: int, size: int) -> str:
    params = {"a": torch.ones(3), "b": torch.ones(2)}
    zero = fdp.ZeroRedundancy(fdp.optim.sgd(0.1), params)
    state = zero.init(params)
    grads = {"a": torch.ones(3), "b": None if rank == 1 else torch.ones(2)}
    try:
        zero.step(grads, state, params)
    except ValueError as e:
        return str(e)
    return "no error"


def test_ranks_disagreeing_on_none_grads_all_raise() -> None:
    for message in ranks.world(2).run(_disagreeing_none):
        assert "fdp.ZeroRedundancy.step: `grads` differs across ranks" in message
        assert "grads['b']" in message


def _one_rank_wrong(rank: int, size: int, how: str) -> list[str]:
    params = {"a": torch.ones(3), "b": torch.ones(2)}
    messages = []
    for stage in (1, 2):
        zero = fdp.ZeroRedundancy(fdp.optim.sgd(0.1), params, stage=stage)
        state = zero.init(params)
        grads: Any = {"a": torch.ones(3), "b": torch.ones(2)}
        if rank == 1:
            grads = {
                "structure": {"a": torch.ones(3)},
                "shape": {"a": torch.ones(3), "b": torch.ones(4)},
                "state": grads,
            }[how]
        try:
            given: Any = state if rank == 0 or how != "state" else {}
            zero.step(grads, given, params)
            messages.append("no error")
        except ValueError as e:
            messages.append(str(e))
        # The world is usable afterwards: a good step agrees.
        good = {"a": torch.ones(3), "b": torch.ones(2)}
        new, _ = zero.step(good, state, params)
        messages.append(str(float(new["a"][0])))
    return messages


@pytest.mark.parametrize("how", ["structure", "shape", "state"])
def test_one_rank_with_bad_input_makes_every_rank_raise_the_same_error(how: str) -> None:
    # Before: that rank raised, the others waited in the reduction until the timeout.
    results = ranks.world(2).run(_one_rank_wrong, how)
    for messages in results:
        for error, after in zip(messages[::2], messages[1::2], strict=True):
            # the first difference: a leaf of another shape, or rank 1's own error
            # (what it found wrong)
            if how != "shape":
                assert error.startswith("fdp.ZeroRedundancy.step: rank 1 raised ValueError: ")
                assert {"structure": "missing grads['b']", "state": "`state` expected"}[
                    how
                ] in error
            else:
                assert error.startswith("fdp.ZeroRedundancy.step: `grads` differs across ranks")
                assert "rank 1 has" in error
            assert after == str(float(torch.tensor(1.0) - 0.1))
    assert results[0] == results[1]


def _bad_input(rank: int, size: int) -> None:
    params = {"a": torch.ones(3), "b": [torch.ones(2, 2)]}
    zero = fdp.ZeroRedundancy(fdp.optim.adam(0.1), params)
    state = zero.init(params)
    with pytest.raises(ValueError, match=r"`stage` expected 1 or 2; got 3"):
        fdp.ZeroRedundancy(fdp.optim.adam(0.1), params, stage=3)
    with pytest.raises(TypeError, match=r"`optimizer` expected an fdp.optim optimizer"):
        fdp.ZeroRedundancy(torch.optim.SGD, params)  # type: ignore[arg-type]

    class NoSlots:  # init and update, but no slots: its state's entries are unknown
        def init(self, params: Any) -> dict[str, Any]:
            return {}

        def update(self, grads: Any, state: Any, params: Any) -> tuple[Any, Any]:
            return params, state

    with pytest.raises(TypeError, match=r"`optimizer` expected .*OptimizerProtocol\); got"):
        fdp.ZeroRedundancy(NoSlots(), params)  # type: ignore[arg-type]

    class WrongSlots(NoSlots):
        slots: tuple[str, ...] = ("momentum",)

    with pytest.raises(TypeError, match=r"gave a state with entries \[\]; expected \['momentum'"):
        fdp.ZeroRedundancy(WrongSlots(), params).init(params)
    with pytest.raises(
        ValueError, match=r"`grads` leaf grads\['b'\]\[0\] expected a tensor of shape \(2, 2\)"
    ):
        zero.step({"a": torch.ones(3), "b": [torch.ones(4)]}, state, params)
    csr = {"a": torch.ones(3), "b": [torch.ones(2, 2).to_sparse_csr()]}
    with pytest.raises(ValueError, match=r"`grads` leaf grads\['b'\]\[0\] expected a dense .*"
                       r"sparse COO tensor; got .* layout torch.sparse_csr"):  # fmt: skip
        zero.step(csr, state, params)
    with pytest.raises(ValueError, match=r"`params` leaf params\['a'\] expected a tensor of shape"):
        zero.step(params, state, {"a": torch.ones(4), "b": [torch.ones(2, 2)]})
    with pytest.raises(ValueError, match=r"`state` expected the ZeroState this ZeroRedundancy"):
        zero.step(params, fdp.optim.adam(0.1).init(params), params)  # type: ignore[arg-type]


def test_bad_input_is_refused_with_the_argument_and_leaf_path() -> None:
    ranks.world(2).run(_bad_input)


def _sparse_table(step: int, rank: int, p: dict[str, torch.Tensor]) -> torch.Tensor:
    """An embedding looked up with sparse gradients (no rows on rank 1 at step 1), and a weight."""
    ids = (
        torch.tensor([], dtype=torch.long)
        if (step, rank) == (1, 1)
        else torch.tensor([rank, 3, step])
    )
    rows = torch.nn.functional.embedding(ids, p["embed"], sparse=True)
    return (torch.tanh(rows) * p["w"]).sum() + (p["w"] ** 2).sum()


def _sparse_params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"embed": torch.randn(6, 4, generator=g), "w": torch.randn(4, generator=g)}


def _sparse_grads(step: int, rank: int, params: dict[str, torch.Tensor]) -> Any:
    p = {k: v.detach().requires_grad_() for k, v in params.items()}
    torch.autograd.backward(_sparse_table(step, rank, p))
    return {k: v.grad for k, v in p.items()}


def _sparse_steps(rank: int, size: int, stage: int, name: str) -> list[torch.Tensor]:
    params = _sparse_params()
    zero = fdp.ZeroRedundancy(_SPARSE_OPT[name](), params, stage=stage)
    state = zero.init(params)
    for step in range(3):
        params, state = zero.step(_sparse_grads(step, rank, params), state, params)
    return list(params.values())


_SPARSE_OPT: dict[str, Callable[[], Any]] = {
    "sgd": lambda: fdp.optim.sgd(0.1, momentum=0.9),
    "adamw": lambda: fdp.optim.adamw(0.1),
}


@pytest.mark.parametrize("name", ["sgd", "adamw"])
@pytest.mark.parametrize("stage", [1, 2])
def test_sparse_gradients_step_as_one_process_on_their_mean(stage: int, name: str) -> None:
    # nn.Embedding(sparse=True) under ZeRO (before: "reshape is not implemented for sparse
    # tensors" from the packing). Reduced as the dense tensors they stand for: SGD steps
    # to what one process's sparse step gives, AdamW (which has no sparse kernels, as
    # torch's) to its step on the dense mean.
    opt, params = _SPARSE_OPT[name](), _sparse_params()
    state = opt.init(params)
    for step in range(3):
        parts = [_sparse_grads(step, r, params) for r in range(2)]
        mean = {k: (parts[0][k] + parts[1][k]) / 2 for k in params}
        assert mean["embed"].is_sparse
        if name == "adamw":
            mean = {k: g.to_dense() for k, g in mean.items()}
        params, state = opt.update(mean, state, params)
    for got in ranks.world(2).run(_sparse_steps, stage, name):
        for t, expected in zip(got, params.values(), strict=True):
            torch.testing.assert_close(t, expected)


def _kept_results(rank: int, size: int, stage: int) -> tuple[bool, int]:
    """Keeps every third step's results and drops the others, so buffers get reused."""
    params = tree()
    zero = fdp.ZeroRedundancy(fdp.optim.sgd(0.1, momentum=0.9), params, stage=stage)
    state = zero.init(params)
    kept, storages = [], set()
    for step in range(9):
        params, state = zero.step(grads_tree(params, step, rank), state, params)
        storages.add(tensor_leaves(params)[0].untyped_storage().data_ptr())
        if step % 3 == 0:
            snapshot = optree.tree_map(torch.clone, (params, state.slots))  # type: ignore[arg-type]
            kept.append((params, state, snapshot))
    same = all(
        optree.tree_all(optree.tree_map(torch.equal, (p, s.slots), snapshot))  # type: ignore[arg-type]
        for p, s, snapshot in kept
    )
    return same, len(storages)


@pytest.mark.parametrize("stage", [1, 2])
def test_reused_buffers_never_change_results_the_caller_holds(stage: int) -> None:
    for same, buffers in ranks.world(2).run(_kept_results, stage):
        assert same
        assert buffers < 9  # some step reused a buffer


def _subgroup_steps(rank: int, size: int, path: str) -> list[torch.Tensor] | None:
    """ZeRO on ranks 0 and 2 of 3 (group ranks 0 and 1), with a checkpoint round trip."""
    pair = torch.distributed.new_group([0, 2])  # every rank calls new_group
    if rank == 1:
        return None
    params = tree()
    make, _, hyper = OPTIMIZERS["adamw"]
    zero = fdp.ZeroRedundancy(make(**hyper), params, group=pair, bucket_cap_mb=SMALL_CAP)
    state = zero.init(params)
    mine = 0 if rank == 0 else 1  # the rank within the pair: the gradients of a 2-rank world
    for step in range(STEPS):
        params, state = zero.step(grads_tree(params, step, mine), state, params)
        if step == STEPS // 2:
            fdp.save_checkpoint(path, {"params": params, "opt": state}, group=pair)
            like: dict[str, Any] = {"params": params, "opt": zero.init(params)}
            loaded = fdp.load_checkpoint(path, like, group=pair)
            params, state = loaded["params"], loaded["opt"]
    return tensor_leaves(params)


def test_a_subgroup_trains_and_checkpoints_like_a_world_of_its_size(tmp_path: Any) -> None:
    expected = reference("adamw", 2)
    results = ranks.world(3).run(_subgroup_steps, str(tmp_path / "c"))
    assert results[1] is None
    for got in (results[0], results[2]):
        assert got is not None
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-7)


def _donated_vs_pure(rank: int, size: int, stage: int) -> bool:
    runs = []
    for donate in (False, True):
        params = tree()
        zero = fdp.ZeroRedundancy(fdp.optim.adamw(0.01, amsgrad=True), params, stage=stage)
        state = zero.init(params)
        for step in range(4):
            grads = grads_tree(params, step, rank)
            params, state = zero.step(grads, state, params, donate=donate)
        runs.append(tensor_leaves(params) + [t for v in state.slots.values() for b in v for t in b])
    return all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


@pytest.mark.parametrize("stage", [1, 2])
def test_a_donated_step_gives_the_pure_steps_results(stage: int) -> None:
    assert all(ranks.world(2).run(_donated_vs_pure, stage))


def _tied_donated_vs_pure(rank: int, size: int, stage: int) -> list[list[torch.Tensor]]:
    runs = []
    for donate in (False, True):
        w = torch.zeros(3)
        params = {"a": w, "b": w, "c": torch.ones(5)}  # a and b in one rank's slice
        zero = fdp.ZeroRedundancy(fdp.optim.sgd(1.0), params, stage=stage)
        state = zero.init(params)
        grads = {"a": torch.ones(3), "b": torch.ones(3), "c": torch.full((5,), float(rank))}
        params, state = zero.step(grads, state, params, donate=donate)
        runs.append([params["a"].clone(), params["b"].clone(), params["c"].clone()])
    return runs


@pytest.mark.parametrize("stage", [1, 2])
def test_a_donated_step_steps_a_tied_tensor_once(stage: int) -> None:
    # The pure step (and torch) give -1 at both leaves; stepped twice in place, -2.
    for pure, donated in ranks.world(2).run(_tied_donated_vs_pure, stage):
        assert torch.equal(pure[0], torch.full((3,), -1.0))
        for a, b in zip(pure, donated, strict=True):
            assert torch.equal(a, b)


MAX_NORM = 0.05  # below the MLP's gradient norms: every step clips


def _no_decay(name: str, t: torch.Tensor) -> str:
    return "no_decay" if t.ndim <= 1 else "decay"


def _grouped_adamw() -> fdp.optim.ParamGroups:
    return fdp.optim.param_groups(
        _no_decay,
        {
            "decay": fdp.optim.adamw(0.05, weight_decay=0.1),
            "no_decay": fdp.optim.adamw(0.02, weight_decay=0.0),
        },
    )


def _clipped_grouped_steps(
    rank: int, size: int, stage: int, compiled: bool
) -> tuple[list[torch.Tensor], list[float]]:
    x, y = batch(PER_RANK * size)
    params = optree.tree_map(torch.Tensor.detach, mlp_params(head_bias=True))  # type: ignore[arg-type]
    zero = fdp.ZeroRedundancy(_grouped_adamw(), params, stage=stage, bucket_cap_mb=SMALL_CAP)

    def loss(p: Any, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(mlp(p, xb), yb)

    def train_step(p: Any, state: Any) -> tuple[Any, Any]:
        grads = torch.func.grad(loss)(p, shard(x, rank), shard(y, rank))
        return zero.step(grads, state, p, max_norm=MAX_NORM)

    step = (
        torch.compile(train_step, backend="aot_eager", fullgraph=True) if compiled else train_step
    )
    state, norms = zero.init(params), []
    for _ in range(4):
        params, state = step(params, state)
        assert zero.last_grad_norm is not None
        norms.append(float(zero.last_grad_norm))
    return tensor_leaves(params), norms


def clipped_grouped_reference(world: int) -> tuple[list[torch.Tensor], list[float]]:
    """One process, the full batch: clip_grad_norm_ and AdamW with two parameter groups."""
    x, y = batch(PER_RANK * world)
    params = mlp_params(head_bias=True)
    leaves = tensor_leaves(params)
    groups = [
        {"params": [p for p in leaves if p.ndim > 1], "lr": 0.05, "weight_decay": 0.1},
        {"params": [p for p in leaves if p.ndim <= 1], "lr": 0.02, "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, foreach=True)
    norms = []
    for _ in range(4):
        opt.zero_grad()
        torch.autograd.backward(torch.nn.functional.mse_loss(mlp(params, x), y))
        norms.append(float(torch.nn.utils.clip_grad_norm_(leaves, MAX_NORM)))
        opt.step()
    return [p.detach() for p in leaves], norms


@pytest.mark.parametrize(
    ("world", "stage", "compiled"),
    [
        (2, 2, False),
        (3, 1, False),
        (3, 2, False),
        pytest.param(2, 2, True, marks=pytest.mark.compile),
    ],
)
def test_max_norm_and_param_groups_equal_torchs_clip_and_groups(
    world: int, stage: int, compiled: bool
) -> None:
    """``step(..., max_norm=)`` is clip_grad_norm_ on DDP's gradients; groups are torch's."""
    expected, expected_norms = clipped_grouped_reference(world)
    assert all(n > MAX_NORM for n in expected_norms)  # the test clips at every step
    for got, norms in ranks.world(world).run(_clipped_grouped_steps, stage, compiled):
        torch.testing.assert_close(norms, expected_norms, rtol=1e-5, atol=0)
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


def _bad_max_norm(rank: int, size: int) -> str:
    params = {"w": torch.ones(3)}
    zero = fdp.ZeroRedundancy(fdp.optim.sgd(0.1), params)
    with pytest.raises(ValueError, match=r"ZeroRedundancy.step: `max_norm` expected") as err:
        zero.step({"w": torch.ones(3)}, zero.init(params), params, max_norm=-1.0)
    return str(err.value)


def test_a_negative_max_norm_raises_the_same_error_on_every_rank() -> None:
    messages = ranks.world(2).run(_bad_max_norm)
    assert messages[0] == messages[1]


def _differentiable_clip(rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    params = {"w": torch.linspace(-1.0, 1.0, 7)}
    lr = torch.tensor(0.1, requires_grad=True)
    zero = fdp.ZeroRedundancy(fdp.optim.sgd(lr), params, bucket_cap_mb=SMALL_CAP)
    grads = {"w": torch.linspace(0.0, 1.0, 7) * (rank + 1)}
    new, _ = zero.step(grads, zero.init(params), params, max_norm=0.5)
    (d_lr,) = torch.autograd.grad(new["w"].square().sum(), lr)
    assert zero.last_grad_norm is not None
    return new["w"].detach(), d_lr, zero.last_grad_norm.detach()


def test_max_norm_in_a_differentiable_step_gives_the_clipped_hypergradient() -> None:
    """A hypergradient (lr requires grad) through a clipped step: the ranks' shares average
    to the single-process derivative (docs/transforms.md's rule for ZeroRedundancy)."""
    world = 2
    lr = torch.tensor(0.1, requires_grad=True)
    w = torch.linspace(-1.0, 1.0, 7)
    avg = torch.linspace(0.0, 1.0, 7) * sum(r + 1 for r in range(world)) / world
    (clipped,), norm = fdp.optim.clip_by_global_norm([avg], 0.5)
    new = w - lr * clipped
    (expected,) = torch.autograd.grad(new.square().sum(), lr)
    results = ranks.world(world).run(_differentiable_clip)
    for got_w, _, got_norm in results:
        torch.testing.assert_close(got_w, new.detach())
        torch.testing.assert_close(got_norm, norm)
    torch.testing.assert_close(torch.stack([d for _, d, _ in results]).mean(), expected)


def _custom_node_compiled(rank: int, size: int) -> str:
    params = {"w": collections.deque([torch.ones(2)])}
    zero = fdp.ZeroRedundancy(fdp.optim.sgd(0.5), params)
    state = zero.init(params)
    grads = {"w": collections.deque([torch.full((2,), float(rank + 1))])}
    step = torch.compile(zero.step, backend="eager", fullgraph=True)
    with pytest.raises(Exception, match=r"inside torch.compile the tree") as info:
        step(grads, state, params)
    new, _ = zero.step(grads, state, params)  # eagerly: the averaged step
    torch.testing.assert_close(new["w"][0], 1 - 0.5 * torch.full((2,), (1 + size) / 2))
    return str(info.value)


def test_a_node_compiled_code_cannot_flatten_is_refused_inside_compile_only() -> None:
    for message in ranks.world(2).run(_custom_node_compiled):
        assert "the tree this ZeroRedundancy was planned for must be built" in message


# --------------------------------------------------------------- uneven inputs

UNEVEN = [2, 4, 0]  # batches per rank: rank 2 has none, rank 0 leaves before rank 1


def _mlp_loss(p: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(mlp(p, x), y)


def _plain(params: Any) -> Any:
    """The MLP's float leaves, detached (torch.func.grad takes no None leaf)."""
    return {
        "layers": optree.tree_map(torch.Tensor.detach, params["layers"]),
        "head": params["head"].first.detach(),
    }


def _as_mlp(p: Any) -> Any:
    return {"layers": p["layers"], "head": (p["head"], None)}


def _uneven_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batch(len(UNEVEN) * PER_RANK, seed=20 + step)
    return shard(x, rank), shard(y, rank)


def _joined_steps(rank: int, size: int, scaled: bool) -> Any:
    params = _plain(mlp_params())
    zero = fdp.ZeroRedundancy(fdp.optim.adamw(0.05), params)
    state = zero.init(params)
    # A power of two: scaling and unscaling are exact, so results are unscaled ones.
    scaler = fdp.optim.GradScaler(init_scale=1024.0)
    scale = scaler.init()
    with zero.join(params, state) as joined:
        for step in range(UNEVEN[rank]):
            batch_now = _uneven_batch(step, rank)
            grads = torch.func.grad(lambda p, b=batch_now: _mlp_loss(_as_mlp(p), *b))(params)
            if scaled:  # unscale's default sync stays local in join: ranks that left skip it
                grads, found = scaler.unscale(scaler.scale(grads, scale), scale)
                assert not found
            params, state = zero.step(grads, state, params)
    # Every rank, also those that left early, holds the last step's parameters.
    return joined.params


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "grad_scaler"])
def test_join_steps_ranks_with_different_numbers_of_batches(scaled: bool) -> None:
    # Before, the rank with more batches blocked, then got gloo's bare timeout.
    params = _plain(mlp_params())
    opt = fdp.optim.adamw(0.05)
    state = opt.init(params)
    for step in range(max(UNEVEN)):
        active = [r for r in range(len(UNEVEN)) if step < UNEVEN[r]]

        batches = [_uneven_batch(step, r) for r in active]

        def total(p: Any, batches: list[Any] = batches) -> torch.Tensor:
            per_rank = [_mlp_loss(_as_mlp(p), *b) for b in batches]
            return torch.stack(per_rank).sum() / len(UNEVEN)  # the initial world size

        params, state = opt.update(torch.func.grad(total)(params), state, params)
    for got in ranks.world(len(UNEVEN)).run(_joined_steps, scaled):
        for g, e in zip(tensor_leaves(got), tensor_leaves(params), strict=True):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


def _save_in_join(rank: int, size: int, path: str, every_rank: bool) -> str:
    """A checkpoint after step 0 (``every_rank``: a step every rank takes), or after step 2."""
    params = _plain(mlp_params())
    zero = fdp.ZeroRedundancy(fdp.optim.adamw(0.05), params)
    state = zero.init(params)
    at = 0 if every_rank else 2
    try:
        with zero.join(params, state):
            for step in range([2, 4, 3][rank]):  # every rank takes steps 0 and 1
                batch_now = _uneven_batch(step, rank)
                grads = torch.func.grad(lambda p, b=batch_now: _mlp_loss(_as_mlp(p), *b))(params)
                params, state = zero.step(grads, state, params)
                if step == at:
                    fdp.save_checkpoint(path, {"params": params, "opt": state}, rng=False)
    except RuntimeError as e:
        return str(e)
    return "saved"


@pytest.mark.parametrize("every_rank", [True, False], ids=["all_there", "after_one_left"])
def test_a_checkpoint_inside_join_is_saved_by_every_rank_or_refused_on_every_rank(
    tmp_path: Any, every_rank: bool
) -> None:
    # Before, a save after a rank had left met its mirrored step: a hang.
    messages = ranks.world(len(UNEVEN)).run(_save_in_join, str(tmp_path / "c"), every_rank)
    if every_rank:
        assert messages == ["saved"] * len(UNEVEN)
        assert (tmp_path / "c" / ".metadata").exists()
        return
    for message in messages:
        assert "a collective inside ZeroRedundancy.join that not every rank makes" in message
    assert sum(m.startswith("fdp.save_checkpoint: ") for m in messages) >= 1


def _mixed_groups(kind: str) -> fdp.optim.ParamGroups:
    """Groups with different slots: AdamW's moments on matrices, SGD's momentum elsewhere;
    or ("muon") Muon's momentum on matrices (each on one owner rank), AdamW's elsewhere."""
    if kind == "muon":
        decay: fdp.optim.Optimizer = fdp.optim.muon(0.02)
        rest: fdp.optim.Optimizer = fdp.optim.adamw(0.05, weight_decay=0.0, fused=False)
    else:
        decay = fdp.optim.adamw(0.05, weight_decay=0.1, fused=False)
        rest = fdp.optim.sgd(0.02, momentum=0.9, fused=False)
    return fdp.optim.param_groups(_no_decay, {"decay": decay, "no_decay": rest})


def _mixed_reference(world: int, steps: int, kind: str) -> list[torch.Tensor]:
    x, y = batch(PER_RANK * world)
    params = mlp_params(head_bias=True)
    leaves = tensor_leaves(params)
    matrices, vectors = [p for p in leaves if p.ndim > 1], [p for p in leaves if p.ndim <= 1]
    opts: list[Any] = [
        torch.optim.AdamW(matrices, lr=0.05, weight_decay=0.1),
        torch.optim.SGD(vectors, lr=0.02, momentum=0.9),
    ]
    if kind == "muon":
        opts = [
            torch.optim.Muon(matrices, lr=0.02),
            torch.optim.AdamW(vectors, lr=0.05, weight_decay=0.0),
        ]
    for _ in range(steps):
        for p in leaves:
            p.grad = None
        torch.autograd.backward(torch.nn.functional.mse_loss(mlp(params, x), y))
        for o in opts:
            o.step()
    return [p.detach() for p in leaves]


def _mixed_steps(
    rank: int, size: int, path: str, steps: tuple[int, int], resume_world: int, kind: str
) -> list[torch.Tensor]:
    """``steps[0]`` steps on every rank and a save; ranks below ``resume_world`` resume on a
    group of that size from the checkpoint and take ``steps[1]`` more (the same batch)."""
    x, y = batch(PER_RANK * size)
    params = optree.tree_map(torch.Tensor.detach, mlp_params(head_bias=True))  # type: ignore[arg-type]

    def run(p: Any, state: Any, zero: Any, n: int, r: int, world: int) -> tuple[Any, Any]:
        def loss(q: Any, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.mse_loss(mlp(q, xb), yb)

        for _ in range(n):
            rows = slice(r * len(x) // world, (r + 1) * len(x) // world)
            grads = torch.func.grad(loss)(p, x[rows], y[rows])
            p, state = zero.step(grads, state, p)
        return p, state

    zero = fdp.ZeroRedundancy(_mixed_groups(kind), params, bucket_cap_mb=SMALL_CAP)
    state = zero.init(params)
    params, state = run(params, state, zero, steps[0], rank, size)
    fdp.save_checkpoint(path, {"params": params, "opt": state}, rng=False)
    group = torch.distributed.new_group(list(range(resume_world)))
    if rank >= resume_world:
        return []
    zero = fdp.ZeroRedundancy(_mixed_groups(kind), params, group=group, bucket_cap_mb=SMALL_CAP)
    like = {"params": params, "opt": zero.init(params)}
    loaded = fdp.load_checkpoint(path, like, group=group, rng=False)
    params, _ = run(loaded["params"], loaded["opt"], zero, steps[1], rank, resume_world)
    return tensor_leaves(params)


@pytest.mark.parametrize("kind", ["sgd", "muon"])
def test_groups_with_different_slots_resume_on_another_world_size(tmp_path: Any, kind: str) -> None:
    """AdamW + SGD(momentum), or Muon + AdamW, groups under ZeRO: each slice keeps only its
    group's slots (None in the other's); 3 steps on 3 ranks, saved, 2 more on 2 ranks
    equal torch's two optimizers on the whole batch (each step's mean gradient is the
    whole batch's). Muon's owners are planned again for the new world."""
    want = _mixed_reference(3, 5, kind)
    got = ranks.world(3).run(_mixed_steps, str(tmp_path / "c"), (3, 2), 2, kind)
    for leaves in got[:2]:
        for g, w in zip(leaves, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    assert got[2] == []
