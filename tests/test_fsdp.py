"""fdp.FullyShardedDataParallel against one process on the full batch.

Every rank builds the same parameters; the reference, computed in the
parent, is plain single-process autograd and ``fdp.optim`` on the whole
tree, with the gradient of the mean over ranks of each rank's loss on its
shard of the batch (the full batch's loss). The tree has odd leaf sizes, a
complex leaf, a ``channels_last`` leaf, tied leaves, a frozen leaf, an
integer buffer and a ``None`` leaf.
"""

from __future__ import annotations

import datetime
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist

import fdp
from tests import ranks
from tests.helpers import tree_allclose

ROWS = 3  # examples per rank
TOL: dict[str, Any] = {"rtol": 1e-5, "atol": 1e-6}


def make_params() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)

    def p(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, dtype=dtype) / 3).requires_grad_()

    embed = p(7, 5)
    conv = p(6, 5, 1, 1).detach().to(memory_format=torch.channels_last).requires_grad_()
    return {
        "embed": embed,
        "blocks": [{"w": p(5, 5), "b": p(5)} for _ in range(3)],
        "conv": conv,  # used as a 6x5 matrix
        "head": {"w": p(6, 3), "phase": p(3, dtype=torch.complex64), "bias": None},
        "frozen": p(3).detach(),  # requires no grad
        "unembed": embed,  # tied to embed
        "count": torch.tensor(4),  # an integer buffer
    }


def model(
    params: dict[str, Any], x: torch.Tensor, order: Sequence[int] = (0, 1, 2)
) -> torch.Tensor:
    h = x @ params["embed"]
    for i in order:
        h = torch.tanh(h @ params["blocks"][i]["w"] + params["blocks"][i]["b"])
    h = torch.tanh(h @ params["conv"].flatten(1).T)
    phase = params["head"]["phase"].abs().to(h.dtype)  # complex leaves keep their dtype
    out: torch.Tensor = h @ params["head"]["w"] + phase + params["frozen"]
    tied: torch.Tensor = (out @ params["unembed"][:3, :3]) * 0.1 * params["count"]
    return out + tied


def data(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(size * ROWS, 7, generator=g), torch.randn(size * ROWS, 3, generator=g)


def mine(t: torch.Tensor, rank: int) -> torch.Tensor:
    return t[rank * ROWS : (rank + 1) * ROWS]


def local_loss(params: dict[str, Any], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(params, x) - y).square().mean()


def no_decay_for_vectors(name: str, t: torch.Tensor) -> str:
    return "no_decay" if t.ndim <= 1 else "decay"


def make_optimizer(kind: str) -> Any:
    """AdamW, or AdamW without weight decay on 1-D leaves (docs/recipes.md's groups), or
    ("mixed") SGD with momentum there: groups with different slots."""
    if kind == "adamw":
        return fdp.optim.adamw(0.05, weight_decay=0.1)
    if kind == "muon":  # Muon on leaves of 2+ dims (the conv kernel: a stack), AdamW elsewhere
        return fdp.optim.param_groups(
            lambda name, t: "muon" if t.ndim >= 2 and t.is_floating_point() else "adamw",
            {"muon": fdp.optim.muon(0.02), "adamw": fdp.optim.adamw(0.05, weight_decay=0.0)},
        )
    vectors: fdp.optim.Optimizer = fdp.optim.adamw(0.05, weight_decay=0.0)
    if kind == "mixed":
        vectors = fdp.optim.sgd(0.05, momentum=0.9)
    return fdp.optim.param_groups(
        no_decay_for_vectors,
        {"decay": fdp.optim.adamw(0.05, weight_decay=0.1), "no_decay": vectors},
    )


def reference(size: int, steps: int, kind: str = "adamw") -> list[Any]:
    """The full-batch loss's parameters after each AdamW step, single process."""
    params = make_params()
    opt = make_optimizer(kind)
    trained = {k: v for k, v in params.items() if k not in ("frozen", "count", "unembed")}
    trained["head"] = {"w": params["head"]["w"], "phase": params["head"]["phase"]}
    state = opt.init(trained)
    x, y = data(size)
    out = []
    for _ in range(steps):

        def full_loss(t: dict[str, Any]) -> torch.Tensor:
            whole = {**params, **t, "unembed": t["embed"], "head": {**t["head"], "bias": None}}
            return sum(local_loss(whole, mine(x, r), mine(y, r)) for r in range(size)) / size  # type: ignore[return-value]

        grads = torch.func.grad(full_loss)(trained)
        trained, state = opt.update(grads, state, trained)
        out.append({**trained, "head": {**trained["head"], "bias": None}})
    return out


# How each rank gets its shards' gradients: one named function per entry point.
Grads = Callable[[fdp.FullyShardedDataParallel, Any, torch.Tensor, torch.Tensor], Any]


Shards = dict[str, tuple[torch.Tensor, ...]]


def _detached(shards: Shards) -> Shards:
    return {k: tuple(t.detach() for t in ts) for k, ts in shards.items()}


def _like(new: Shards, old: Shards) -> Shards:
    """``new`` with ``old``'s requires_grad flags (the frozen shard needs none)."""
    pairs = {k: zip(ts, old[k], strict=True) for k, ts in new.items()}
    return {k: tuple(t.requires_grad_(o.requires_grad) for t, o in p) for k, p in pairs.items()}


def _trained_only(grads: Any, shards: Shards) -> Any:
    """``grads`` with ``None`` for the shards that need no gradient (the frozen leaf's)."""
    pairs = {k: zip(gs, shards[k], strict=True) for k, gs in grads.items()}
    return {k: tuple(g if t.requires_grad else None for g, t in p) for k, p in pairs.items()}


def _by_backward(fsdp: fdp.FullyShardedDataParallel, shards: Shards, x: Any, y: Any) -> Any:
    for ts in shards.values():
        for t in ts:
            t.grad = None
    torch.autograd.backward(local_loss(fsdp(shards), x, y))
    return {k: tuple(t.grad for t in ts) for k, ts in shards.items()}


def _by_autograd_grad(fsdp: fdp.FullyShardedDataParallel, shards: Shards, x: Any, y: Any) -> Any:
    flat = [t for ts in shards.values() for t in ts if t.requires_grad]
    got = iter(torch.autograd.grad(local_loss(fsdp(shards), x, y), flat))
    return {
        k: tuple(next(got) if t.requires_grad else None for t in ts) for k, ts in shards.items()
    }


def _by_func_grad(fsdp: fdp.FullyShardedDataParallel, shards: Shards, x: Any, y: Any) -> Any:
    return torch.func.grad(lambda s: local_loss(fsdp(s), x, y))(_detached(shards))


def _train(
    rank: int, size: int, grads_of: Grads, steps: int, hybrid: bool = False, kind: str = "adamw"
) -> list[Any]:
    params = make_params()
    fsdp = _sharded(params, size, hybrid)
    shards = fsdp.shard(params)
    opt = fsdp.optimizer(make_optimizer(kind))
    state = opt.init(shards)
    x, y = data(size)
    out = []
    for _ in range(steps):
        grads = _trained_only(grads_of(fsdp, shards, mine(x, rank), mine(y, rank)), shards)
        new, state = opt.update(grads, state, _detached(shards))
        shards = _like(new, shards)
        full = fsdp.full(shards)
        out.append({k: full[k] for k in ("embed", "blocks", "conv", "head")})
    return out


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize(
    "grads_of", [_by_backward, _by_autograd_grad, _by_func_grad], ids=lambda f: f.__name__[4:]
)
def test_training_steps_equal_one_process_on_the_full_batch(size: int, grads_of: Grads) -> None:
    steps = 3
    expected = reference(size, steps)
    for per_rank in ranks.world(size).run(_train, grads_of, steps):
        for got, want in zip(per_rank, expected, strict=True):
            tree_allclose(got, want, **TOL)


def reference_grad(
    size: int,
    loss: Callable[..., torch.Tensor],
    edit: Callable[[dict[str, Any]], None] | None = None,
) -> Any:
    """The gradient of the mean over ranks of ``loss(params, x_r, y_r)``, as a params tree
    (``edit``: changes ``make_params()`` in place first)."""
    params = make_params()
    if edit is not None:
        edit(params)
    ranked = "rank" in inspect.signature(loss).parameters  # loss(params, x, y, rank)
    head = {"w": params["head"]["w"], "phase": params["head"]["phase"]}
    variables = {k: params[k] for k in ("embed", "blocks", "conv", "frozen")} | {"head": head}
    variables = torch.utils._pytree.tree_map(lambda t: t.detach(), variables)
    x, y = data(size)

    def mean_loss(v: dict[str, Any]) -> torch.Tensor:
        whole = {**params, **v, "unembed": v["embed"], "head": {**v["head"], "bias": None}}
        rank = [(r,) if ranked else () for r in range(size)]
        total = sum(loss(whole, mine(x, r), mine(y, r), *rank[r]) for r in range(size))
        return total / size  # type: ignore[return-value]

    grads = torch.func.grad(mean_loss)(variables)
    head_grads = {**grads["head"], "bias": None}
    return {**grads, "unembed": grads["embed"], "head": head_grads, "count": params["count"]}


def meanflow_loss(params: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """MeanFlow's pattern: a jvp w.r.t. the inputs, both outputs in the loss."""
    out, tangent = torch.func.jvp(lambda z: model(params, z), (x,), (torch.ones_like(x),))[:2]
    loss: torch.Tensor = (out - y).square().mean() + tangent.square().mean()
    return loss


def _meanflow(rank: int, size: int) -> Any:
    params = make_params()
    fsdp = fdp.FullyShardedDataParallel(params)
    x, y = data(size)

    def loss(s: Shards) -> torch.Tensor:
        return meanflow_loss(fsdp(s), mine(x, rank), mine(y, rank))

    grads = torch.func.grad(loss)(_detached(fsdp.shard(params)))
    shards = fsdp.shard(params)  # and by loss.backward(), with shards that require grad
    torch.autograd.backward(loss(shards))

    def grad(t: torch.Tensor) -> torch.Tensor:  # the frozen shard has no .grad
        return torch.zeros_like(t) if t.grad is None else t.grad

    accumulated = {k: tuple(grad(t) for t in ts) for k, ts in shards.items()}
    return fsdp.full(grads), fsdp.full(accumulated)


@pytest.mark.parametrize("size", [2, 3])
def test_jvp_wrt_inputs_through_the_sharded_model_then_grad_to_the_shards(size: int) -> None:
    expected = reference_grad(size, meanflow_loss)
    for by_func_grad, by_backward in ranks.world(size).run(_meanflow):
        tree_allclose(by_func_grad, expected, **TOL)
        # the frozen shard requires no grad: loss.backward() gives it none
        frozen = {**expected, "frozen": torch.zeros_like(expected["frozen"])}
        tree_allclose(by_backward, frozen, **TOL)


def _random_like(shards: Shards) -> Shards:
    g = torch.Generator().manual_seed(5)  # the same on every rank: a replicated direction
    return {k: tuple(torch.randn(t.shape, generator=g) for t in ts) for k, ts in shards.items()}


def _second_order(rank: int, size: int) -> Any:
    """A Hessian-vector product w.r.t. the shards, forward-over-reverse and reverse-over-reverse."""
    params = make_params()
    fsdp = fdp.FullyShardedDataParallel(params)
    x, y = data(size)
    shards = _detached(fsdp.shard(params))
    v = _random_like(shards)

    def loss(s: Shards) -> torch.Tensor:
        return local_loss(fsdp(s), mine(x, rank), mine(y, rank))

    hvp = torch.func.jvp(torch.func.grad(loss), (shards,), (v,))[1]

    def along_v(s: Shards) -> torch.Tensor:
        g = torch.func.grad(loss)(s)
        dots = [(a * b).sum() for k in g for a, b in zip(g[k], v[k], strict=True)]
        # A dot product of sharded vectors is a sum over ranks of partial dots.
        partial = torch.stack(dots).sum().reshape(1)
        return fdp.all_reduce_grads({"dot": partial}, average=False)["dot"].sum()

    rr = torch.func.grad(along_v)(shards)
    # The direction as a params tree: every rank gathers the same full tangent.
    return fsdp.full(hvp), fsdp.full(rr), fsdp.full(v)


@pytest.mark.parametrize("size", [2, 3])
def test_hessian_vector_products_wrt_the_shards_equal_the_full_trees(size: int) -> None:
    results = ranks.world(size).run(_second_order)
    direction = results[0][2]
    params = make_params()
    head = {"w": params["head"]["w"], "phase": params["head"]["phase"]}
    variables = {
        k: params[k].detach() if k != "blocks" else params[k]
        for k in ("embed", "conv", "frozen", "blocks")
    }
    variables = torch.utils._pytree.tree_map(lambda t: t.detach(), {**variables, "head": head})
    tangent = {k: direction[k] for k in ("embed", "conv", "frozen", "blocks")}
    tangent["head"] = {"w": direction["head"]["w"], "phase": direction["head"]["phase"]}
    x, y = data(size)

    def mean_loss(v: dict[str, Any]) -> torch.Tensor:
        whole = {**params, **v, "unembed": v["embed"], "head": {**v["head"], "bias": None}}
        return sum(local_loss(whole, mine(x, r), mine(y, r)) for r in range(size)) / size  # type: ignore[return-value]

    hvp = torch.func.jvp(torch.func.grad(mean_loss), (variables,), (tangent,))[1]
    expected = {**hvp, "unembed": hvp["embed"], "head": {**hvp["head"], "bias": None}}
    expected["count"] = params["count"]
    for fwd_rev, rev_rev, _ in results:
        tree_allclose(fwd_rev, expected, rtol=1e-4, atol=1e-5)
        tree_allclose(rev_rev, expected, rtol=1e-4, atol=1e-5)


def _per_example(rank: int, size: int) -> Any:
    """Per-example gradients w.r.t. the shards (jacrev: vmap over batched cotangents)."""
    params = make_params()
    fsdp = fdp.FullyShardedDataParallel(params)
    x, y = data(size)

    def losses(s: Shards) -> torch.Tensor:
        out = torch.func.vmap(lambda xi: model(fsdp(s), xi))(mine(x, rank))
        return (out - mine(y, rank)).square().mean(-1)

    jac = torch.func.jacrev(losses)(_detached(fsdp.shard(params)))
    rows = [{k: tuple(t[i] for t in ts) for k, ts in jac.items()} for i in range(ROWS)]
    return [fsdp.full(row) for row in rows]


@pytest.mark.parametrize("size", [2, 3])
def test_per_example_gradients_under_vmap_average_the_ranks_examples(size: int) -> None:
    results = ranks.world(size).run(_per_example)
    for i in range(ROWS):

        def example_loss(params: Any, x: torch.Tensor, y: torch.Tensor, i: int = i) -> torch.Tensor:
            return (model(params, x[i : i + 1]) - y[i : i + 1]).square().mean()

        expected = reference_grad(size, example_loss)  # example i of each rank, averaged
        for per_rank in results:
            tree_allclose(per_rank[i], expected, **TOL)


def _real(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


def _mixed_precision(rank: int, size: int) -> Any:
    params = make_params()
    fsdp = fdp.FullyShardedDataParallel(
        params, param_dtype=torch.bfloat16, reduce_dtype=torch.float32
    )
    x, y = data(size)
    shards = _detached(fsdp.shard(params))
    gathered = fsdp(shards)

    def loss(s: Shards) -> torch.Tensor:
        return local_loss(fsdp(s), mine(x, rank).bfloat16(), mine(y, rank).bfloat16()).float()

    grads = torch.func.grad(loss)(shards)
    dtypes = {
        "master": {t.dtype for ts in shards.values() for t in ts},
        "gathered": {t.dtype for t in torch.utils._pytree.tree_leaves(gathered) if _real(t)},
        "grads": {t.dtype for ts in grads.values() for t in ts},
    }
    return fsdp.full(grads), dtypes


def bf16_loss(params: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The reference for param_dtype=bfloat16: the forward in bfloat16, the master in float32."""

    def low(t: Any) -> Any:  # complex leaves keep their dtype: torch has no bfloat16 complex
        floating = isinstance(t, torch.Tensor) and t.is_floating_point()
        return t.to(torch.bfloat16) if floating else t

    low_params = torch.utils._pytree.tree_map(low, params)
    low_params["unembed"] = low_params["embed"]  # tied: one bfloat16 tensor, as gathered
    return local_loss(low_params, x.bfloat16(), y.bfloat16()).float()


def test_mixed_precision_gathers_in_param_dtype_and_reduces_in_reduce_dtype() -> None:
    size = 2
    expected = reference_grad(size, bf16_loss)
    for grads, dtypes in ranks.world(size).run(_mixed_precision):
        assert dtypes == {
            "master": {torch.float32},
            "gathered": {torch.bfloat16},
            "grads": {torch.float32},
        }
        # Each rank's local gradient is the same bfloat16 computation as the
        # reference's; only the float32 sum over ranks runs in another order.
        tree_allclose(grads, expected, rtol=1e-5, atol=1e-6)


def test_four_ranks_train_as_one_process() -> None:
    expected = reference(4, 2)
    for per_rank in ranks.world(4).run(_train, _by_func_grad, 2):
        for got, want in zip(per_rank, expected, strict=True):
            tree_allclose(got, want, **TOL)


def by_unit(fsdp: fdp.FullyShardedDataParallel, shards: Shards, x: torch.Tensor) -> torch.Tensor:
    """``model`` with each block gathered where it is used (``fsdp.gather``)."""
    rest = fsdp.gather(shards, "embed"), fsdp.gather(shards, "conv")
    head = fsdp.gather(shards, "head")
    h = x @ rest[0]
    for i in range(3):
        block = fsdp.gather(shards, f"blocks.{i}")
        h = torch.tanh(h @ block["w"] + block["b"])
    h = torch.tanh(h @ rest[1].flatten(1).T)
    frozen = fsdp.gather(shards, "frozen")
    out: torch.Tensor = h @ head["w"] + head["phase"].abs() + frozen
    tied: torch.Tensor = (out @ rest[0][:3, :3]) * 0.1 * 4
    return out + tied


def _units(rank: int, size: int) -> Any:
    params = make_params()
    fsdp = fdp.FullyShardedDataParallel(params)
    x, y = data(size)

    def loss(s: Shards) -> torch.Tensor:
        return (by_unit(fsdp, s, mine(x, rank)) - mine(y, rank)).square().mean()

    return fsdp.unit_names, fsdp.full(torch.func.grad(loss)(_detached(fsdp.shard(params))))


def test_units_gathered_where_the_model_uses_them() -> None:
    expected = reference_grad(2, local_loss)
    for names, grads in ranks.world(2).run(_units):
        # Each top-level entry, each element of the top-level list; the tie is embed's.
        assert names == ["blocks.0", "blocks.1", "blocks.2", "conv", "embed", "frozen", "head"]
        tree_allclose(grads, expected, **TOL)


def _bad_input(rank: int, size: int) -> list[str]:
    params = make_params()
    messages = []
    with pytest.raises(ValueError, match=r"`units` names 'blocks.7', which holds no leaf") as e:
        fdp.FullyShardedDataParallel(params, units=["blocks.0", "blocks.7"])
    messages.append(str(e.value))
    with pytest.raises(ValueError, match=r"`units` expected disjoint subtrees; got 'blocks'"):
        fdp.FullyShardedDataParallel(params, units=["blocks", "blocks.1"])
    with pytest.raises(TypeError, match=r"`param_dtype` expected a floating-point dtype"):
        fdp.FullyShardedDataParallel(params, param_dtype=torch.int32)
    flat_mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (size,))
    with pytest.raises(ValueError, match=r"`mesh` expected a 2-D DeviceMesh \(replicate, shard\)"):
        fdp.FullyShardedDataParallel(params, mesh=flat_mesh)
    with pytest.raises(ValueError, match=r"pass `group` or `mesh`, not both"):
        fdp.FullyShardedDataParallel(params, mesh=flat_mesh, group=dist.group.WORLD)
    # A structure that differs on one rank: the same error on every rank, no hang.
    mine_ = {**params, "extra": torch.zeros(2)} if rank == 1 else params
    with pytest.raises(ValueError, match=r"fdp.FullyShardedDataParallel: `params`") as e:
        fdp.FullyShardedDataParallel(mine_)
    messages.append(str(e.value))
    fsdp = fdp.FullyShardedDataParallel(params, units=["blocks"])
    shards = fsdp.shard(params)
    assert sorted(shards) == ["", "blocks"]  # leaves under no named unit form unit ""
    with pytest.raises(ValueError, match=r"`name` expected one of the units \['blocks', ''\]"):
        fsdp.gather(shards, "head")
    with pytest.raises(ValueError, match=r"`shards` expected the dict shard\(\) returns"):
        fsdp({"blocks": shards["blocks"]})
    wrong = {**shards, "blocks": tuple(t[:-1] for t in shards["blocks"])}
    with pytest.raises(ValueError, match=r"`shards` unit 'blocks' expected tensors of shapes"):
        fsdp.full(wrong)
    with pytest.raises(ValueError, match=r"`params` leaf params\['conv'\] expected a tensor"):
        fsdp.shard({**params, "conv": torch.zeros(6, 5)})
    return messages


def test_bad_input_is_refused_alike_on_every_rank() -> None:
    results = ranks.world(2).run(_bad_input)
    assert results[0] == results[1]


def _uneven(rank: int, size: int, prefetch: bool) -> str | None:
    """Rank 1 has one batch more than rank 0, on a group with a 3 s timeout."""
    params = make_params()
    group = dist.new_group(timeout=datetime.timedelta(seconds=3))
    fsdp = fdp.FullyShardedDataParallel(params, group=group, prefetch=prefetch)
    shards = fsdp.shard(params)
    x, y = data(size)
    try:
        for _ in range(1 + rank):
            _by_backward(fsdp, shards, mine(x, rank), mine(y, rank))
    except RuntimeError as err:
        return str(err)
    return None


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "no_prefetch"])
def test_a_rank_with_more_batches_gets_a_clear_error_at_the_timeout(prefetch: bool) -> None:
    finished, waited = ranks.world(2).run(_uneven, prefetch)
    assert finished is None
    assert waited is not None
    assert "fdp.FullyShardedDataParallel: the all-gather of" in waited
    assert "more batches than another (uneven inputs)" in waited
    assert "no join()" in waited


def _block(unit: dict[str, torch.Tensor], h: torch.Tensor, seen: list[Any] | None) -> Any:
    if seen is not None:  # not under torch.func, whose wrappers show no storage
        seen.append(unit["w"].untyped_storage())
    return torch.tanh(h @ unit["w"] + unit["b"])


def applied(
    fsdp: fdp.FullyShardedDataParallel,
    shards: Shards,
    x: Any,
    seen: list[Any] | None,
    order: Sequence[int] = (0, 1, 2),
    block: Callable[..., Any] = _block,
) -> Any:
    """``model`` with each unit run through ``fsdp.apply`` (gathered only for its function)."""

    def stem(p: Any, x: torch.Tensor) -> Any:
        if seen is not None:
            seen.append(p.untyped_storage())
        return x @ p

    h = fsdp.apply(shards, "embed", stem, x)
    for i in order:
        h = fsdp.apply(shards, f"blocks.{i}", block, h, seen)
    h = torch.tanh(h @ fsdp.gather(shards, "conv").flatten(1).T)
    head, frozen = fsdp.gather(shards, "head"), fsdp.gather(shards, "frozen")
    out = h @ head["w"] + head["phase"].abs() + frozen
    return out + (out @ fsdp.gather(shards, "embed")[:3, :3]) * 0.1 * 4


def _zero_if_none(t: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(t) if t.grad is None else t.grad


def _sharded(params: Any, size: int, hybrid: bool) -> fdp.FullyShardedDataParallel:
    if hybrid:  # HSDP: shards across pairs of ranks, replicated across the pairs
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2, size // 2))
        return fdp.FullyShardedDataParallel(params, mesh=mesh)
    return fdp.FullyShardedDataParallel(params)


def _as_params(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Parameters whose ``.grad`` is each of ``grads`` (what clip_grad_norm_ takes)."""
    out = []
    for g in grads:
        p = torch.zeros_like(g, requires_grad=True)
        p.grad = g
        out.append(p)
    return out


# --------------------------------------------------------------- a tensor tied across units


def _tied_params() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(5, 4, generator=g).requires_grad_()
    return {
        "embed": embed,
        "head": {"w": torch.randn(4, 4, generator=g).requires_grad_(), "unembed": embed},
    }


def _tied_loss(embed: Any, head: Any, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    del embed
    out: torch.Tensor = torch.tanh(h @ head["w"]) @ head["unembed"].T
    return (out - y).square().mean()


def _tied_across_units(rank: int, size: int, how: str) -> Any:
    params = _tied_params()
    fsdp = fdp.FullyShardedDataParallel(params)  # units "embed" and "head"
    shards = fsdp.shard(params)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(size * 2, 5, generator=g), torch.randn(size * 2, 5, generator=g)
    x, y = x[rank * 2 : rank * 2 + 2], y[rank * 2 : rank * 2 + 2]
    h = x @ fsdp.gather(shards, "embed")
    if how == "gather":
        loss = _tied_loss(None, fsdp.gather(shards, "head"), h, y)
    else:
        loss = fsdp.apply(shards, "head", lambda u: _tied_loss(None, u, h, y))
    torch.autograd.backward(loss)
    return fsdp.full({k: tuple(t.grad for t in ts) for k, ts in shards.items()})  # type: ignore[misc]


@pytest.mark.parametrize("how", ["gather", "apply"])
def test_a_leaf_tied_across_units_is_gathered_with_its_unit(how: str) -> None:
    # Before, gather(shards, "head") and apply gave None at head.unembed.
    size = 2
    ref = _tied_params()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(size * 2, 5, generator=g), torch.randn(size * 2, 5, generator=g)
    losses = [
        _tied_loss(None, ref["head"], x[r * 2 : r * 2 + 2] @ ref["embed"], y[r * 2 : r * 2 + 2])
        for r in range(size)
    ]
    torch.autograd.backward(torch.stack(losses).mean())
    expected = {
        "embed": ref["embed"].grad,
        "head": {"w": ref["head"]["w"].grad, "unembed": ref["embed"].grad},
    }
    for got in ranks.world(size).run(_tied_across_units, how):
        tree_allclose(got, expected, **TOL)


# --------------------------------------------------------------- a unit one rank leaves unused


def _skipping_loss(params: Any, x: torch.Tensor, y: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank 0's loss ignores blocks.1; rank 1's uses every unit."""
    out: torch.Tensor = model(params, x, (0, 2) if rank == 0 else (0, 1, 2))
    return (out - y).square().mean()


def _leaves_a_unit_unused(rank: int, size: int, how: str, grads_of: str) -> Any:
    params = make_params()
    fsdp = fdp.FullyShardedDataParallel(params)
    x, y = (mine(t, rank) for t in data(size))
    skip = rank == 0
    calls = iter(range(3))

    def block(p: Any, h: torch.Tensor, seen: Any) -> Any:
        return h if next(calls) == 1 and skip else _block(p, h, seen)  # discards blocks.1

    def loss(s: Shards) -> torch.Tensor:
        if how == "ignored":  # the whole tree gathered; the loss leaves blocks.1 out
            return _skipping_loss(fsdp(s), x, y, rank)
        out: torch.Tensor = applied(fsdp, s, x, None, block=block)
        return (out - y).square().mean()

    shards = fsdp.shard(params)
    if grads_of == "backward":
        torch.autograd.backward(loss(shards))
        grads = {k: tuple(t.grad for t in ts) for k, ts in shards.items()}
    elif grads_of == "autograd_grad":
        trained = [t for ts in shards.values() for t in ts if t.requires_grad]
        got = iter(torch.autograd.grad(loss(shards), trained))
        grads = {
            k: tuple(next(got) if t.requires_grad else None for t in ts) for k, ts in shards.items()
        }
    else:
        grads = torch.func.grad(loss)(_detached(shards))
    pairs = {k: zip(gs, shards[k], strict=True) for k, gs in grads.items()}
    return fsdp.full(
        {k: tuple(torch.zeros_like(t) if g is None else g for g, t in p) for k, p in pairs.items()}
    )


@pytest.mark.parametrize("grads_of", ["backward", "autograd_grad", "func_grad"])
@pytest.mark.parametrize("how", ["ignored", "applied_and_discarded"])
def test_a_unit_one_rank_leaves_unused_is_reduced_on_every_rank(how: str, grads_of: str) -> None:
    # Before: a wrong shard gradient on rank 0 (0.43 off), a hang on rank 1.
    expected = reference_grad(2, _skipping_loss)
    for grads in ranks.world(2).run(_leaves_a_unit_unused, how, grads_of, timeout_s=60):
        trained = {k: grads[k] for k in ("embed", "blocks", "conv")}
        tree_allclose(trained, {k: expected[k] for k in trained}, **TOL)
        torch.testing.assert_close(grads["head"]["w"], expected["head"]["w"], **TOL)
