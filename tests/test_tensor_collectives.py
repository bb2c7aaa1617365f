"""fdp.all_reduce / all_gather / reduce_scatter / all_to_all / broadcast against one process.

Every rank ``r`` holds its own ``x_r``; one process computes every rank's
output from all of them (the reference ``G``). A rank's derivative is that
of the sum over ranks of every rank's objective with respect to its own
input, so each transform's reference comes from ``G`` with ``torch.func``
and autograd: gradients, vjps, jvps, vmaps, jacobians, hessians and nests
of them, eager and compiled, on 2 and 3 ranks and on a subgroup whose
ranks are not the global ones.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

import fdp
from tests import ranks

Fn = Callable[[torch.Tensor, Any], torch.Tensor]


def _cat_ref(dim: int) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
    return lambda xs: [torch.cat(xs, dim)] * len(xs)


def _reduce_ref(op: str) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
    def ref(xs: list[torch.Tensor]) -> list[torch.Tensor]:
        stacked = torch.stack(xs)
        out = {
            "sum": lambda: stacked.sum(0),
            "mean": lambda: stacked.mean(0),
            "max": lambda: stacked.max(0).values,
            "min": lambda: stacked.min(0).values,
        }[op]()
        return [out] * len(xs)

    return ref


def _scatter_ref(op: str, dim: int) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
    def ref(xs: list[torch.Tensor]) -> list[torch.Tensor]:
        return list(_reduce_ref(op)(xs)[0].chunk(len(xs), dim))

    return ref


def _a2a_ref(split: int, concat: int) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
    def ref(xs: list[torch.Tensor]) -> list[torch.Tensor]:
        w = len(xs)
        return [torch.cat([xs[i].chunk(w, split)[j] for i in range(w)], concat) for j in range(w)]

    return ref


def _bcast_ref(src: int) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
    return lambda xs: [xs[src]] * len(xs)


# name: (the call on a rank, the reference over every rank's input)
SPECS: dict[str, tuple[Fn, Callable[[list[torch.Tensor]], list[torch.Tensor]]]] = {
    "all_reduce sum": (lambda x, g: fdp.all_reduce(x, group=g), _reduce_ref("sum")),
    "all_reduce mean": (lambda x, g: fdp.all_reduce(x, "mean", group=g), _reduce_ref("mean")),
    "all_reduce max": (lambda x, g: fdp.all_reduce(x, "max", group=g), _reduce_ref("max")),
    "all_reduce min": (lambda x, g: fdp.all_reduce(x, "min", group=g), _reduce_ref("min")),
    "all_gather dim 1": (lambda x, g: fdp.all_gather(x, dim=1, group=g), _cat_ref(1)),
    "reduce_scatter sum dim 0": (
        lambda x, g: fdp.reduce_scatter(x, group=g),
        _scatter_ref("sum", 0),
    ),
    "reduce_scatter mean dim -1": (
        lambda x, g: fdp.reduce_scatter(x.transpose(0, 1), "mean", dim=-1, group=g),
        lambda xs: _scatter_ref("mean", -1)([x.transpose(0, 1) for x in xs]),
    ),
    "reduce_scatter max": (
        lambda x, g: fdp.reduce_scatter(x, "max", group=g),
        _scatter_ref("max", 0),
    ),
    "all_to_all 0 -> 1": (
        lambda x, g: fdp.all_to_all(x, split_dim=0, concat_dim=1, group=g),
        _a2a_ref(0, 1),
    ),
    "broadcast src 1": (lambda x, g: fdp.broadcast(x, 1, group=g), _bcast_ref(1)),
}

TOPOLOGIES = {"2 ranks": (2, None), "3 ranks": (3, None), "ranks 1, 2 of 3": (3, [1, 2])}
_GROUPS: dict[tuple[int, ...], Any] = {}


def _group(members: list[int] | None) -> tuple[Any, int, int] | None:
    """(group, group rank, group size) on members; None elsewhere (every rank calls new_group)."""
    if members is None:
        return None, dist.get_rank(), dist.get_world_size()
    key = tuple(members)
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(members)
    if dist.get_rank() not in members:
        return None
    group = _GROUPS[key]
    return group, dist.get_rank(group), dist.get_world_size(group)


def _random(shape: Any, r: int, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * salt + r)
    return torch.randn(shape, generator=g, dtype=torch.float64)


def _inputs(r: int, w: int, salt: int) -> torch.Tensor:
    """Rank ``r``'s input: rows that every group size here divides."""
    return _random((2 * w, 3), r, salt)


def _objective(r: int) -> Callable[[torch.Tensor], torch.Tensor]:
    w = 0.5 + 0.25 * r  # each rank's objective differs

    def loss(out: torch.Tensor) -> torch.Tensor:
        return (torch.sin(out * w) * (out + r)).sum()

    return loss


Ref = Callable[[list[torch.Tensor]], list[torch.Tensor]]


def _total(ref: Ref, *xs: torch.Tensor) -> torch.Tensor:
    """The sum over ranks of every rank's objective, from every rank's input."""
    return torch.stack([_objective(q)(o) for q, o in enumerate(ref(list(xs)))]).sum()


def _output(ref: Ref, q: int, *xs: torch.Tensor) -> torch.Tensor:
    return ref(list(xs))[q]


def _modes(name: str, r: int, w: int, group: Any) -> dict[str, tuple[Any, Any]]:
    """Per mode, (this rank's result, the reference computed in one process)."""
    fn, ref = SPECS[name]
    xs = [_inputs(q, w, 0) for q in range(w)]
    x, every = xs[r], tuple(range(w))
    total = functools.partial(_total, ref)

    def coll(t: torch.Tensor) -> torch.Tensor:
        return fn(t, group)

    def mine(t: torch.Tensor) -> torch.Tensor:
        return _objective(r)(coll(t))

    out: dict[str, tuple[Any, Any]] = {"forward": (coll(x), ref(xs)[r])}
    leaf = x.clone().requires_grad_()
    torch.autograd.backward(mine(leaf))
    ref_grads = torch.func.grad(total, argnums=every)(*xs)
    out["autograd"] = (leaf.grad, ref_grads[r])
    out["grad"] = (torch.func.grad(mine)(x), ref_grads[r])
    vs = [_random(ref(xs)[q].shape, q, 1) for q in range(w)]
    ref_vjp = torch.func.vjp(lambda *a: tuple(ref(list(a))), *xs)[1](tuple(vs))
    out["vjp"] = (torch.func.vjp(coll, x)[1](vs[r])[0], ref_vjp[r])
    ts = [_inputs(q, w, 2) for q in range(w)]
    ref_jvp = torch.func.jvp(lambda *a: tuple(ref(list(a))), tuple(xs), tuple(ts))[1]
    out["jvp"] = (torch.func.jvp(coll, (x,), (ts[r],))[1], ref_jvp[r])
    batch = [torch.stack([_inputs(q, w, 3 + b) for b in range(3)]) for q in range(w)]
    ref_vmap = torch.stack([ref([bq[b] for bq in batch])[r] for b in range(3)])
    out["vmap"] = (torch.func.vmap(coll)(batch[r]), ref_vmap)
    jac = [
        torch.func.jacrev(functools.partial(_output, ref, q), argnums=every)(*xs) for q in range(w)
    ]
    out["jacrev"] = (torch.func.jacrev(coll)(x), torch.stack([jac[q][r] for q in every]).sum(0))
    out["jacfwd"] = (torch.func.jacfwd(coll)(x), torch.stack([jac[r][q] for q in every]).sum(0))
    hess = torch.func.hessian(total, argnums=every)(*xs)
    out["hessian"] = (torch.func.hessian(mine)(x), torch.stack([hess[r][q] for q in every]).sum(0))
    # Nests: a batch of gradients, and forward over reverse.
    grad_r = torch.func.grad(total, argnums=r)
    ref_vgrad = torch.stack([grad_r(*[bq[b] for bq in batch]) for b in range(3)])
    out["vmap(grad)"] = (torch.func.vmap(torch.func.grad(mine))(batch[r]), ref_vgrad)
    ref_fwd_rev = torch.func.jvp(grad_r, tuple(xs), tuple(ts))[1]
    out["jvp(grad)"] = (torch.func.jvp(torch.func.grad(mine), (x,), (ts[r],))[1], ref_fwd_rev)
    return out


def _compiled_modes(name: str, r: int, w: int, group: Any) -> dict[str, tuple[Any, Any]]:
    fn, ref = SPECS[name]
    xs = [_inputs(q, w, 0) for q in range(w)]
    ref_grads = torch.func.grad(functools.partial(_total, ref), argnums=tuple(range(w)))(*xs)

    def mine(t: torch.Tensor) -> torch.Tensor:
        return _objective(r)(fn(t, group))

    torch._dynamo.reset()
    # No transform: the collective and its backward in one graph.
    leaf = xs[r].clone().requires_grad_()
    torch.autograd.backward(torch.compile(mine, backend="aot_eager", fullgraph=True)(leaf))
    out = {"compiled autograd (fullgraph)": (leaf.grad, ref_grads[r])}
    # Under a transform the call runs eagerly (a graph break): still right.
    compiled_grad = torch.compile(torch.func.grad(mine), backend="aot_eager")
    out["compiled grad"] = (compiled_grad(xs[r]), ref_grads[r])

    def coll(t: torch.Tensor) -> torch.Tensor:
        return fn(t, group)

    def tangent_out(t: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        tangent: torch.Tensor = torch.func.jvp(coll, (t,), (d,))[1]
        return tangent

    ts = [_inputs(q, w, 2) for q in range(w)]
    ref_jvp = torch.func.jvp(lambda *a: tuple(ref(list(a))), tuple(xs), tuple(ts))[1]
    out["compiled jvp"] = (
        torch.compile(tangent_out, backend="aot_eager")(xs[r], ts[r]),
        ref_jvp[r],
    )
    batch = [torch.stack([_inputs(q, w, 3 + b) for b in range(3)]) for q in range(w)]
    ref_vmap = torch.stack([ref([bq[b] for bq in batch])[r] for b in range(3)])
    out["compiled vmap"] = (
        torch.compile(torch.func.vmap(coll), backend="aot_eager")(batch[r]),
        ref_vmap,
    )
    return out


def _run_all(rank: int, size: int, name: str, members: list[int] | None, compiled: bool) -> Any:
    got = _group(members)
    if got is None:
        return None
    group, r, w = got
    modes = (_compiled_modes if compiled else _modes)(name, r, w, group)
    bad = {}
    for mode, (mine, want) in modes.items():
        if mine.shape != want.shape or not torch.allclose(mine, want, atol=1e-9, rtol=1e-7):
            bad[mode] = (
                f"got {mine.shape} {mine.flatten()[:4]}, want {want.shape} {want.flatten()[:4]}"
            )
    return bad


@pytest.mark.parametrize("topology", list(TOPOLOGIES))
@pytest.mark.parametrize("name", list(SPECS))
def test_every_transform_matches_one_process(name: str, topology: str) -> None:
    size, members = TOPOLOGIES[topology]
    results = ranks.world(size).run(_run_all, name, members, False)
    assert [r for r in results if r] == []


@pytest.mark.parametrize("topology", list(TOPOLOGIES))
@pytest.mark.parametrize("name", list(SPECS))
def test_compiled_matches_one_process(name: str, topology: str) -> None:
    size, members = TOPOLOGIES[topology]
    results = ranks.world(size).run(_run_all, name, members, True)
    assert [r for r in results if r] == []


def _refused(rank: int, size: int, case: str) -> Any:
    """Every rank's error (or None) for one rank's bad call; then a collective still pairs."""
    x = torch.ones(4, 3)
    calls: dict[str, Callable[[], Any]] = {
        "an unknown op on one rank": lambda: fdp.all_reduce(x, "prod" if rank == 1 else "sum"),
        "an unknown op everywhere": lambda: fdp.all_reduce(x, "prod"),
        "ops differ": lambda: fdp.all_reduce(x, "max" if rank == 1 else "sum"),
        "dims differ": lambda: fdp.all_gather(x, dim=rank),
        "dtypes differ": lambda: fdp.all_gather(x.double() if rank == 1 else x),
        "a non-gathered dim differs": lambda: fdp.all_gather(torch.ones(4, 3 + rank)),
        "a size not divisible on one rank": lambda: fdp.reduce_scatter(torch.ones(4 + rank, 3)),
        "split_dim not divisible": lambda: fdp.all_to_all(torch.ones(3, 2)),
        "src outside the group on one rank": lambda: fdp.broadcast(x, 2 if rank == 0 else 0),
        "a dim out of range": lambda: fdp.all_gather(x, dim=2),
        "not a tensor": lambda: fdp.all_reduce([1.0]),  # type: ignore[arg-type]
        "a tree": lambda: fdp.all_gather({"a": x, "b": [x]}),  # type: ignore[arg-type]
    }
    error = None
    try:
        calls[case]()
    except (ValueError, TypeError) as e:
        error = f"{type(e).__name__}: {e}"
    after = fdp.all_reduce(torch.ones(2)).tolist()  # the ranks are still paired
    return error, after


# Per case, what rank 0's and rank 1's errors say: the argument that differs, by name.
REFUSALS = {
    "an unknown op on one rank": ("`op` differs across ranks", "`op` expected one of"),
    "an unknown op everywhere": ("`op` expected one of", "`op` expected one of"),
    "ops differ": ("`op` differs across ranks: rank 0 has 'sum', rank 1 has 'max'",) * 2,
    "dims differ": ("`dim` differs across ranks: rank 0 has 0, rank 1 has 1",) * 2,
    "dtypes differ": ("`x` differs across ranks", "`x` differs across ranks"),
    "a non-gathered dim differs": ("`x` differs across ranks", "`x` differs across ranks"),
    "a size not divisible on one rank": ("`x` differs across ranks", "the group's size 2 divides"),
    "split_dim not divisible": ("the group's size 2 divides", "the group's size 2 divides"),
    "src outside the group on one rank": ("`src` expected a rank of the group", "`src` differs"),
    "a dim out of range": ("`dim` expected a dimension of x", "`dim` expected a dimension"),
    "not a tensor": ("`x` expected a torch.Tensor", "`x` expected a torch.Tensor"),
    "a tree": ("`x` expected a torch.Tensor; got a dict of 2 leaves (one tensor a call",) * 2,
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_bad_call_on_any_rank_raises_on_every_rank(case: str) -> None:
    results = ranks.world(2).run(_refused, case)
    for rank, (error, after) in enumerate(results):
        assert error is not None, f"rank {rank} did not raise"
        assert REFUSALS[case][rank] in error, error
        assert error.startswith(("ValueError", "TypeError")), error
        assert after == [2.0, 2.0]


def _a_tree_compiled(rank: int, size: int) -> tuple[str, list[float]]:
    torch._dynamo.reset()

    @torch.compile(backend="eager", fullgraph=True)
    def compiled(t: torch.Tensor) -> torch.Tensor:
        return fdp.all_reduce({"a": t})  # type: ignore[arg-type]

    # dynamo's Unsupported with fdp's error inside (or that error, as it raises it)
    with pytest.raises((torch._dynamo.exc.Unsupported, TypeError)) as e:
        compiled(torch.ones(3))
    return str(e.value), fdp.all_reduce(torch.ones(2)).tolist()


@pytest.mark.compile
def test_a_tree_inside_a_fullgraph_compile_is_refused_with_fdps_message() -> None:
    # The message once printed the tree, which dynamo cannot do for a tensor: it
    # stopped at "repr() on tensor" instead of fdp's error.
    for message, after in ranks.world(2).run(_a_tree_compiled):
        assert "fdp.all_reduce: `x` expected a torch.Tensor; got a dict of 1 leaf" in message
        assert after == [2.0, 2.0]


def _outside(rank: int, size: int) -> Any:
    pair = _group([1, 2])
    if pair is not None:
        return fdp.all_gather(torch.full((1,), float(rank)), group=pair[0]).tolist()
    try:
        fdp.all_reduce(torch.ones(1), group=_GROUPS[(1, 2)])
    except ValueError as e:
        return str(e)
    return None


def test_a_rank_outside_the_group_is_refused_and_the_group_gathers_in_group_rank_order() -> None:
    outside, one, two = ranks.world(3).run(_outside)
    assert "`group` expected a process group that contains this process" in outside
    assert one == two == [1.0, 2.0]


def _contrastive(rank: int, size: int) -> Any:
    """docs/collectives.md's loss: InfoNCE over fdp.all_gather'd keys, ddp(params) averaging."""
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(8, 4, generator=g, dtype=torch.float64).requires_grad_()}
    views = torch.randn(2, 4 * size, 8, generator=g, dtype=torch.float64)
    ddp = fdp.DistributedDataParallel(params)
    rows = slice(4 * rank, 4 * (rank + 1))
    p = ddp(params)
    queries = torch.nn.functional.normalize(views[0, rows] @ p["w"], dim=1)
    keys = fdp.all_gather(torch.nn.functional.normalize(views[1, rows] @ p["w"], dim=1))
    positives = torch.arange(4) + 4 * rank
    torch.autograd.backward(torch.nn.functional.cross_entropy(queries @ keys.T / 0.1, positives))
    return params["w"].grad, views


@pytest.mark.parametrize("size", [2, 3])
def test_a_contrastive_loss_with_ddp_has_the_single_process_gradient(size: int) -> None:
    for grad, views in ranks.world(size).run(_contrastive):
        g = torch.Generator().manual_seed(0)
        w = torch.randn(8, 4, generator=g, dtype=torch.float64).requires_grad_()
        queries = torch.nn.functional.normalize(views[0] @ w, dim=1)
        keys = torch.nn.functional.normalize(views[1] @ w, dim=1)
        loss = torch.nn.functional.cross_entropy(queries @ keys.T / 0.1, torch.arange(4 * size))
        (want,) = torch.autograd.grad(loss, w)
        torch.testing.assert_close(grad, want)


# ---------------------------------------------------------------------------
# Agreeing once per call site: a remembered site's flag travels in the payload.


_SITE_CALLS: dict[str, Callable[[Any, str, int], torch.Tensor]] = {
    "all_reduce": lambda x, op, dim: fdp.all_reduce(x, op),
    "all_gather": lambda x, op, dim: fdp.all_gather(x, dim=dim),
    "reduce_scatter": lambda x, op, dim: fdp.reduce_scatter(x, op, dim=dim),
    "all_to_all": lambda x, op, dim: fdp.all_to_all(x, split_dim=dim, concat_dim=1 - dim),
    "broadcast": lambda x, op, dim: fdp.broadcast(x, 1),
}


def _site_args(case: str, rank: int, step: int) -> tuple[Any, str, int]:
    """Steps 0-1 agree (the site is remembered); at step 2 ``case`` changes on some ranks."""
    change = case.split(":")[1]
    # 1.2 MB: a flag beside the payload, but a sum's in it still (a max's beside).
    rows, cols = (512, 300) if change.startswith("large") else (4, 6)
    change = change.removeprefix("large, ")
    x: Any = _random((rows, cols), rank, step)
    op, dim = "sum", 0
    if step != 2:
        return x, op, dim
    on = rank == 1
    if change == "shape on one rank" and on:
        x = _random((2 * rows, cols), rank, step)
    elif change == "dtype on one rank" and on:
        x = x.float()
    elif change == "op on one rank" and on:
        op = "max"
    elif change == "dim on one rank" and on:
        dim = 1
    elif change == "an error on one rank" and on:
        x = _random((5, 6), rank, step)  # not divisible by 2 ranks
    elif change == "not a tensor on one rank" and on:
        x = x.tolist()
    elif change == "shape on every rank":
        x = _random((rows // 2, cols), rank, step)
    return x, op, dim


def _site_reference(case: str, step: int, w: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``r``'s output, and its gradient of the sum over ranks of every output's sum."""
    name = case.split(":")[0]
    xs = [_site_args(case, q, step)[0].clone().requires_grad_() for q in range(w)]
    refs: dict[str, Ref] = {
        "all_reduce": _reduce_ref("sum"),
        "all_gather": _cat_ref(0),
        "reduce_scatter": _scatter_ref("sum", 0),
        "all_to_all": _a2a_ref(0, 1),
        "broadcast": _bcast_ref(1),
    }
    outs = refs[name](xs)
    torch.autograd.backward(torch.stack([o.sum() for o in outs]).sum())
    grad = xs[r].grad  # None: this rank's input reaches no output (a broadcast's)
    return outs[r].detach(), torch.zeros_like(xs[r]) if grad is None else grad


def _changed_site(rank: int, size: int, case: str) -> Any:
    """Per step, this rank's error or whether its output and gradient are the reference's."""
    call = _SITE_CALLS[case.split(":")[0]]
    said: list[Any] = []
    for step in range(4):
        x, op, dim = _site_args(case, rank, step)
        leaf = x.clone().requires_grad_() if isinstance(x, torch.Tensor) else x
        try:
            out = call(leaf, op, dim)  # every step's call from this one line: one site
        except (TypeError, ValueError) as e:
            said.append(f"{type(e).__name__}: {e}")
            continue
        torch.autograd.backward(out.sum())  # a backward through the fast path pairs too
        want, grad = _site_reference(case, step, size, rank)
        close = out.shape == want.shape and torch.allclose(out, want)
        assert isinstance(leaf, torch.Tensor)
        assert leaf.grad is not None
        said.append(bool(close and torch.allclose(leaf.grad, grad)))
    after = fdp.all_reduce(torch.ones(2)).tolist()  # still paired
    return said, after


SITE_CHANGES = {
    "all_gather:shape on one rank": "`x` differs across ranks",
    "all_reduce:dtype on one rank": "`x` differs across ranks",
    "all_reduce:op on one rank": "`op` differs across ranks: rank 0 has 'sum', rank 1 has 'max'",
    "all_gather:dim on one rank": "`dim` differs across ranks: rank 0 has 0, rank 1 has 1",
    "reduce_scatter:an error on one rank": "the group's size 2 divides",
    "broadcast:not a tensor on one rank": "`x` expected a torch.Tensor",
    "all_to_all:shape on one rank": "`x` differs across ranks",
    "all_gather:large, shape on one rank": "`x` differs across ranks",
    "all_reduce:large, op on one rank": "`op` differs across ranks",
}


@pytest.mark.parametrize("case", list(SITE_CHANGES))
def test_arguments_that_change_on_one_rank_at_a_remembered_site_raise_on_every_rank(
    case: str,
) -> None:
    results = ranks.world(2).run(_changed_site, case)
    for rank, (said, after) in enumerate(results):
        assert said[:2] == [True, True], said  # agreed, then remembered
        assert isinstance(said[2], str), f"rank {rank} did not raise at step 2: {said}"
        assert said[2].startswith(("ValueError", "TypeError")), said[2]
        assert SITE_CHANGES[case] in said[2] or rank == 0, said[2]
        assert said[3] is True, said  # the site's old arguments pair again
        assert after == [2.0, 2.0]


@pytest.mark.parametrize("size", ["", "large, "])
@pytest.mark.parametrize("name", list(_SITE_CALLS))
def test_every_rank_changing_alike_at_a_remembered_site_gets_the_new_result(
    name: str, size: str
) -> None:
    # A last, smaller batch: every rank's flag is set, all agree, the call runs again.
    for said, _ in ranks.world(2).run(_changed_site, f"{name}:{size}shape on every rank"):
        assert said == [True, True, True, True], said


def _alternating(rank: int, size: int) -> Any:
    from fdp._comm import _call_sites

    ok = []
    for step in range(8):
        x = _random((2 + 2 * (step % 2), 3), rank, step).requires_grad_()
        out = fdp.all_gather(x)
        torch.autograd.backward((out * (rank + 1)).sum())
        want = torch.cat([_random(x.shape, q, step) for q in range(size)])
        # Each rank's output scaled by rank + 1, summed: d/dx = sum over ranks of (q + 1).
        grad = torch.full_like(want[: x.shape[0]], size * (size + 1) / 2)
        assert x.grad is not None
        ok.append(bool(torch.equal(out, want) and torch.equal(x.grad, grad)))
    sites = _call_sites.SITES._of(None)
    mine = [k for k in sites if k[0] == "fdp.all_gather" and k[1][0][1] == "_alternating"]
    return ok, [sites[k] is None for k in mine]


def test_a_site_whose_shapes_alternate_agrees_before_each_call_again() -> None:
    for ok, forgotten in ranks.world(3).run(_alternating):
        assert all(ok), ok
        assert forgotten == [True]  # two misses in 8 calls: agree first from then on


def _dtypes_at_sites(rank: int, size: int) -> Any:
    """Remembered sites in dtypes whose flag travels in the payload or beside it."""
    ok = []
    for step in range(3):
        z = torch.complex(_random((4, 3), rank, step), _random((4, 3), rank, 9 + step))
        leaf = z.to(torch.complex64).requires_grad_()
        out = fdp.all_reduce(leaf)  # complex: the flag in the payload
        torch.autograd.backward(out.real.sum() + 2 * out.imag.sum())
        zs = [
            torch.complex(_random((4, 3), q, step), _random((4, 3), q, 9 + step))
            .to(torch.complex64)
            .requires_grad_()
            for q in range(size)
        ]
        want = torch.stack(zs).sum(0)
        # Every rank's loss of the same sum: the one-process reference's gradient.
        torch.autograd.backward(size * (want.real.sum() + 2 * want.imag.sum()))
        grad = zs[rank].grad
        assert leaf.grad is not None
        assert grad is not None
        ok.append(bool(torch.allclose(out, want.detach()) and torch.allclose(leaf.grad, grad)))
        b = torch.arange(6).remainder(rank + 2) == 0
        got = fdp.all_gather(b)  # bool: in the payload
        ok.append(
            bool(
                torch.equal(
                    got, torch.cat([torch.arange(6).remainder(q + 2) == 0 for q in range(size)])
                )
            )
        )
        i8 = torch.full((5,), rank + step, dtype=torch.int8)
        summed = fdp.all_reduce(i8)  # int8: beside (a sum of flags could wrap)
        ok.append(
            bool(
                torch.equal(
                    summed, torch.full((5,), sum(range(size)) + size * step, dtype=torch.int8)
                )
            )
        )
    return ok


def test_remembered_sites_in_complex_bool_and_int8_match_one_process() -> None:
    for ok in ranks.world(2).run(_dtypes_at_sites):
        assert all(ok), ok


# Each result takes in-place ops and second-order derivatives, as any output does:
# at a remembered site the eager all-gather and sum/mean all-reduce fill their
# buffer after the Function that carries the derivative is made
# (fdp/_comm/_differentiable.py), and a raw all-gather's view of its buffer made
# inside a Function refused in-place ops on the result.
_IN_PLACE: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], Ref]] = {
    "all_gather dim 0": (lambda x: fdp.all_gather(x), _cat_ref(0)),
    "all_gather dim 1": (lambda x: fdp.all_gather(x, dim=1), _cat_ref(1)),
    "all_reduce sum": (lambda x: fdp.all_reduce(x), _reduce_ref("sum")),
    "all_reduce mean": (lambda x: fdp.all_reduce(x, "mean"), _reduce_ref("mean")),
    "all_reduce max": (lambda x: fdp.all_reduce(x, "max"), _reduce_ref("max")),
    "reduce_scatter sum": (lambda x: fdp.reduce_scatter(x), _scatter_ref("sum", 0)),
    "all_to_all": (lambda x: fdp.all_to_all(x, concat_dim=1), _a2a_ref(0, 1)),
    "broadcast": (lambda x: fdp.broadcast(x, 1), _bcast_ref(1)),
}


def _second_order(outs: list[torch.Tensor], xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """d/dx of the sum of dL/dx; L sums over ranks each output, doubled in place, squared."""
    for out in outs:
        out.mul_(2)
    loss = torch.stack([(out**2).sum() for out in outs]).sum()
    # A broadcast's input on another rank than ``src`` reaches no output.
    grads = torch.autograd.grad(loss, xs, create_graph=True, allow_unused=True)
    used = [g.sum() for g in grads if g is not None and g.requires_grad]
    if used:  # linear collectives: the first derivatives may be constants
        torch.autograd.backward(torch.stack(used).sum())
    return [x.grad if x.grad is not None else torch.zeros_like(x) for x in xs]


def _in_place(rank: int, size: int, name: str) -> list[bool]:
    call, ref = _IN_PLACE[name]
    ok = []
    for step in range(3):  # agreed, then remembered: the last two take the fast path
        x = _random((4, 4), rank, step).requires_grad_()
        out = call(x)  # one line: one site
        mine = _second_order([out], [x])[0]
        xs = [_random((4, 4), q, step).requires_grad_() for q in range(size)]
        refs = [o.clone() for o in ref(xs)]  # the reference repeats one tensor per rank
        want = _second_order(refs, xs)[rank]
        ok.append(bool(torch.allclose(out, refs[rank]) and torch.allclose(mine, want)))
    return ok


@pytest.mark.parametrize("name", list(_IN_PLACE))
def test_a_result_takes_in_place_ops_and_second_derivatives(name: str) -> None:
    for ok in ranks.world(2).run(_in_place, name):
        assert ok == [True, True, True], ok


def _bool_dim_at_a_site(rank: int, size: int) -> list[str]:
    said = []
    for dim in (1, 1, True):  # True == 1, but is no dimension
        try:
            fdp.all_gather(torch.ones(2, 3), dim=dim)  # one line: one site
            said.append("ok")
        except TypeError as e:
            said.append(str(e))
    return said


def test_a_bool_dim_at_a_site_that_agreed_on_an_int_is_refused() -> None:
    for said in ranks.world(2).run(_bool_dim_at_a_site):
        assert said[:2] == ["ok", "ok"]
        assert "`dim` expected an int; got True" in said[2], said
