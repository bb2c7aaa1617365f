"""fdp._comm._raw and _groups: eager-or-compiled collectives and group ranks, against arithmetic.

Every rank's input is a function of its rank, so the parent computes what
each collective must return; each one runs eagerly and traced
(``torch.compile(fullgraph=True)``), on the world and on a subgroup whose
ranks are not the global ones.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from fdp import _bucket
from fdp._comm import _groups, _raw
from tests import ranks


def _input(rank: int) -> torch.Tensor:
    # 3x4 and transposed: not contiguous, so the eager copy must make it so.
    return (torch.arange(12.0).view(4, 3) + 100.0 * rank).t()


def _collectives(x: torch.Tensor, group: Any, src: int) -> tuple[torch.Tensor, ...]:
    return (
        _raw.all_reduce(x, group=group),
        _raw.all_reduce(x, group=group, op="max"),
        _raw.all_gather(x.reshape(-1), group=group),
        _raw.reduce_scatter(x.reshape(-1)[:6], group=group),
        _raw.broadcast(x, src=src, group=group),
    )


def _expected(members: list[int], src: int, me: int) -> list[torch.Tensor]:
    xs = [_input(r) for r in members]
    total = torch.stack(xs).sum(0)
    part = 6 // len(members)
    mine = members.index(me)
    return [
        total,
        torch.stack(xs).amax(0),
        torch.cat([x.reshape(-1) for x in xs]),
        total.reshape(-1)[:6][mine * part : (mine + 1) * part],
        xs[src],
    ]


def _run(rank: int, size: int, compiled: bool, members: list[int]) -> list[torch.Tensor] | None:
    # Every rank creates the subgroup (torch requires it); its members use it.
    group = None if members == list(range(size)) else dist.new_group(members)
    if rank not in members:
        return None
    x = _input(rank)
    fn = (
        torch.compile(_collectives, backend="aot_eager", fullgraph=True)
        if compiled
        else _collectives
    )
    out = fn(x, group, len(members) - 1)
    assert torch.equal(x, _input(rank))  # the input is left alone
    return [torch.as_tensor(t).clone() for t in out]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("members", [[0, 1, 2], [1, 2]], ids=["world", "subgroup"])
def test_collectives_eager_and_traced_give_the_local_arithmetic(
    compiled: bool, members: list[int]
) -> None:
    results = ranks.world(3).run(_run, compiled, members)
    for rank, got in enumerate(results):
        if rank not in members:
            assert got is None
            continue
        for g, e in zip(got, _expected(members, len(members) - 1, rank), strict=True):
            torch.testing.assert_close(g, e, rtol=0, atol=0)


def _coalesced(rank: int, size: int, compiled: bool) -> list[torch.Tensor | None]:
    group = dist.new_group([1, 2])
    if rank == 0:
        return []
    targets: list[torch.Tensor | None] = [
        torch.full((2, 3), float(rank)),
        None,
        torch.full((4,), 10.0 * rank, dtype=torch.float64),
        torch.full((2, 2), complex(rank, -rank)),
        torch.full((1, 3, 2, 2), float(rank)).to(memory_format=torch.channels_last),
    ]
    buckets = _bucket.plan(targets, cap_bytes=_bucket.BROADCAST_CAP_BYTES)

    def sync(ts: list[torch.Tensor | None]) -> None:
        _raw.broadcast_coalesced(buckets, ts, src=1, group=group)  # group rank 1: global 2

    (torch.compile(sync, backend="aot_eager", fullgraph=True) if compiled else sync)(targets)
    return targets


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_broadcast_coalesced_gives_every_leaf_the_sources_values_in_place(compiled: bool) -> None:
    for rank, got in enumerate(ranks.world(3).run(_coalesced, compiled)):
        if rank == 0:
            continue
        a, none, b, c, d = got
        assert none is None
        torch.testing.assert_close(a, torch.full((2, 3), 2.0), rtol=0, atol=0)
        torch.testing.assert_close(b, torch.full((4,), 20.0, dtype=torch.float64), rtol=0, atol=0)
        torch.testing.assert_close(c, torch.full((2, 2), complex(2, -2)), rtol=0, atol=0)
        assert d is not None
        assert d.is_contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(d, torch.full((1, 3, 2, 2), 2.0), rtol=0, atol=0)


def _ranks(rank: int, size: int) -> list[Any]:
    group = dist.new_group([2, 0])
    return [
        _groups.global_rank(None, 1),
        _groups.global_rank(group, 1),
        _groups.group_rank(group, 2),
        _groups.same(None, dist.group.WORLD),
        _groups.same(group, None),
    ]


def test_group_ranks_and_global_ranks_convert_both_ways() -> None:
    for got in ranks.world(3).run(_ranks):
        # new_group sorts its ranks: [0, 2], so group rank 1 is global rank 2.
        assert got == [1, 2, 1, True, False]
