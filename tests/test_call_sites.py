"""A remembered call site under every ``torch.func`` transform: errors on every rank, never a hang.

The public collectives remember a call site once its ranks agree
(``fdp/_comm/_call_sites.py``); eagerly and under ``grad`` a rank whose
arguments change there sends a stand-in of the remembered shape. Under
``vmap`` the others send a batched payload and under ``jvp`` a tangent's
collective too, which no stand-in of the agreed shape pairs with. Each case
calls one site under a transform twice with the same arguments, then once
with a change on one rank (every rank raises fdp's error, naming the
difference), then as before (the site pairs again), and ends with a plain
all-reduce that must pair. Each result, value and derivative, is compared
with one process's computation over every rank's input.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.func import grad, jacfwd, jvp, vmap

import fdp
from tests import ranks

BATCH = 3
# One process's collective over every rank's input: rank r's output.
REFS: dict[str, Callable[[list[torch.Tensor], int], torch.Tensor]] = {
    "all_reduce": lambda xs, r: torch.stack(xs).sum(0),
    "all_gather": lambda xs, r: torch.cat(xs, 0),
}
# Each call with its usual option, or (``other``) another one: a max, a gather along dim 1.
CALLS: dict[str, Callable[[torch.Tensor, bool], torch.Tensor]] = {
    "all_reduce": lambda x, other: fdp.all_reduce(x, "max" if other else "sum"),
    "all_gather": lambda x, other: fdp.all_gather(x, dim=1 if other else 0),
}


def _input(rank: int, step: int, change: str, *, batched: bool) -> torch.Tensor:
    """This rank's input at ``step``: ``change`` applies at step 2 (on rank 1 or on all)."""
    rows = 4
    dtype = torch.float64
    changed = step == 2 and (rank == 1 or change.endswith("every rank"))
    if changed and change.startswith("shape"):
        rows = 2 if change.endswith("every rank") else 6
    if changed and change.startswith("dtype"):
        dtype = torch.float32
    batch = BATCH + 1 if changed and change.startswith("batch") else BATCH
    g = torch.Generator().manual_seed(100 * rank + step)
    shape = (batch, rows, 2) if batched else (rows, 2)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _run(transform: str, name: str, x: torch.Tensor, *, other: bool = False) -> Any:
    """``name``'s collective of ``x`` under ``transform``, at one call site."""

    def call(y: torch.Tensor) -> torch.Tensor:
        return CALLS[name](y, other)

    if transform == "vmap":
        return vmap(call)(x)
    if transform == "jvp":
        return jvp(call, (x,), (torch.ones_like(x),))
    if transform == "jacfwd":
        return jacfwd(call)(x)
    if transform == "vmap(grad)":
        return vmap(grad(lambda y: (call(y) ** 2).sum()))(x)
    if transform == "vmap(vmap)":
        return vmap(vmap(call))(x.unsqueeze(1).expand(-1, 2, -1, -1))
    if transform == "grad":
        return grad(lambda y: (call(y) ** 2).sum())(x)
    raise AssertionError(transform)


def _reference(transform: str, name: str, xs: list[torch.Tensor], r: int) -> Any:
    """What rank ``r`` gets: every rank's input in one process, each rank's derivative
    that of the sum over ranks of every rank's objective."""
    ref = REFS[name]
    w = len(xs)
    if transform in ("vmap", "vmap(vmap)"):
        out = torch.stack([ref([x[b] for x in xs], r) for b in range(BATCH)])
        return out.unsqueeze(1).expand(-1, 2, *out.shape[1:]) if transform == "vmap(vmap)" else out
    if transform == "jvp":
        return ref(xs, r), ref([torch.ones_like(x) for x in xs], r)
    if transform == "jacfwd":  # every rank's input moves along the same basis vector
        return jacfwd(lambda d: ref([x + d for x in xs], r))(torch.zeros_like(xs[r]))

    def objective(ys: list[torch.Tensor]) -> torch.Tensor:
        return sum(((ref(ys, q) ** 2).sum() for q in range(w)), torch.zeros(()))

    if transform == "grad":
        return grad(lambda y: objective([*xs[:r], y, *xs[r + 1 :]]))(xs[r])

    def at(v: list[torch.Tensor]) -> Any:
        return grad(lambda y: objective([*v[:r], y, *v[r + 1 :]]))(v[r])

    return torch.stack([at([x[b] for x in xs]) for b in range(BATCH)])


def _site_under(rank: int, size: int, transform: str, name: str, change: str) -> Any:
    batched = transform.startswith("vmap")
    said: list[Any] = []
    for step in range(4):
        x = _input(rank, step, change, batched=batched)
        other = change == "option on one rank" and step == 2 and rank == 1
        try:
            got = _run(transform, name, x, other=other)  # every step's call: one site
        except (TypeError, ValueError) as e:
            said.append(f"{type(e).__name__}: {e}")
            continue
        xs = [_input(q, step, change, batched=batched) for q in range(size)]
        want = _reference(transform, name, xs, rank)
        got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
        pairs = zip(got, want, strict=True)
        said.append(all(g.shape == v.shape and torch.allclose(g, v) for g, v in pairs))
    after = fdp.all_reduce(torch.ones(2)).tolist()  # the group still pairs
    return said, after


TRANSFORMS = ["vmap", "jvp", "jacfwd", "vmap(grad)", "vmap(vmap)", "grad"]
CHANGES = {
    "shape on one rank": "`x` differs across ranks",
    "dtype on one rank": "`x` differs across ranks",
    "option on one rank": "differs across ranks: rank 0 has",  # `op` or `dim`
}


@pytest.mark.parametrize("change", list(CHANGES))
@pytest.mark.parametrize("name", list(CALLS))
@pytest.mark.parametrize("transform", TRANSFORMS)
def test_a_change_on_one_rank_at_a_remembered_site_under_a_transform_raises_on_every_rank(
    transform: str, name: str, change: str
) -> None:
    results = ranks.world(2).run(_site_under, transform, name, change)
    for rank, (said, after) in enumerate(results):
        assert said[:2] == [True, True], (rank, said)
        assert isinstance(said[2], str), f"rank {rank} did not raise at step 2: {said}"
        assert said[2].startswith("ValueError"), said[2]
        assert CHANGES[change] in said[2], said[2]
        assert said[3] is True, (rank, said)  # the site's old arguments pair again
        assert after == [2.0, 2.0]


@pytest.mark.parametrize("transform", ["vmap", "vmap(grad)"])
def test_a_batch_size_that_differs_on_one_rank_raises_on_every_rank(transform: str) -> None:
    results = ranks.world(2).run(_site_under, transform, "all_gather", "batch on one rank")
    for said, after in results:
        assert said[:2] == [True, True], said
        assert isinstance(said[2], str), said
        assert "batched by vmap" in said[2], said
        assert said[3] is True, said
        assert after == [2.0, 2.0]


@pytest.mark.parametrize("name", list(CALLS))
@pytest.mark.parametrize("transform", TRANSFORMS)
def test_every_rank_changing_alike_under_a_transform_gets_the_new_result(
    transform: str, name: str
) -> None:
    for said, after in ranks.world(2).run(_site_under, transform, name, "shape on every rank"):
        assert said == [True, True, True, True], said
        assert after == [2.0, 2.0]
