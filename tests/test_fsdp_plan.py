"""Fully sharded units from a module's names (fdp._sharding._fsdp_plan) against one process.

``make_functional`` gives a flat state keyed by dotted names
(``h.0.attn.weight``), as ``named_parameters`` writes them; nested trees give
the same names. Default units are the blocks of a ``ModuleList`` either way,
and ``gather``/``apply`` take them, with the block's own names inside.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import fdp
from fdp import _tree
from tests import ranks
from tests.helpers import tree_allclose


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = h + torch.tanh(self.attn(self.norm(h)))
        return out


class TinyLM(nn.Module):
    """An embedding, a ModuleList of blocks and a head, like a transformer's layout."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(5, 6)
        self.h = nn.ModuleList([Block() for _ in range(3)])
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.h:
            h = block(h)
        out: torch.Tensor = self.head(h)
        return out


UNITS = ["embed", "h.0", "h.1", "h.2", "head"]


def _net() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM()


def _data(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(4 * size, 5, generator=g), torch.randn(4 * size, 2, generator=g)


def _reference(size: int) -> dict[str, torch.Tensor]:
    """The full batch's gradient in one process, by name."""
    net = _net()
    x, y = _data(size)
    torch.autograd.backward((net(x) - y).square().mean())
    return {k: p.grad for k, p in net.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "tree",
    [
        {"h.0.attn.weight": 1, "h.0.norm.bias": 2, "h.1.attn.weight": 3, "embed.weight": 4},
        {"h": [{"attn": {"weight": 1}, "norm": {"bias": 2}}, {"attn": {"weight": 3}}]}
        | {"embed": {"weight": 4}},
    ],
    ids=["flat", "nested"],
)
def test_default_units_are_the_blocks_of_a_list_flat_or_nested(tree: Any) -> None:
    units = sorted({_tree.block(p) for p in _tree.segments(tree)})
    assert units == ["embed", "h.0", "h.1"]
    blocks = [[("blocks", False), (str(i), True)] for i in range(2)]
    assert _tree.segments({"blocks": [1, 2]}) == blocks


def _apply_blocks(rank: int, size: int) -> Any:
    net = _net()
    _fn, state = fdp.make_functional(net)
    fsdp = fdp.FullyShardedDataParallel(state)
    shards = fsdp.shard(state)
    x, y = _data(size)
    x, y = x[4 * rank : 4 * (rank + 1)], y[4 * rank : 4 * (rank + 1)]

    def run(module: nn.Module) -> Any:
        return lambda p, h: torch.func.functional_call(module, p, (h,))

    h = fsdp.apply(shards, "embed", run(net.embed), x)
    for i, block in enumerate(net.h):
        h = fsdp.apply(shards, f"h.{i}", run(block), h)
    head = fsdp.gather(shards, "head")  # the block's own names: weight, bias
    out = h @ head["weight"].T + head["bias"]
    torch.autograd.backward((out - y).square().mean())
    grads = fsdp.full({k: tuple(torch.zeros_like(t) if t.grad is None else t.grad for t in ts)
                       for k, ts in shards.items()})  # fmt: skip
    return fsdp.unit_names, sorted(head), grads


def test_a_flat_state_is_sharded_by_blocks_and_applied_block_by_block() -> None:
    # make_functional's flat state crashed with KeyError: 'transformer' before.
    expected = _reference(2)
    for names, head_keys, grads in ranks.world(2).run(_apply_blocks):
        assert names == UNITS
        assert head_keys == ["bias", "weight"]
        tree_allclose({k: grads[k] for k in expected}, expected, rtol=1e-5, atol=1e-6)


class BatchNormNet(nn.Module):
    """A convolution and BatchNorm, as a ResNet's stem: buffers updated in place."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.conv(x))).mean(dim=(2, 3))
        out: torch.Tensor = self.head(h)
        return out


def _images(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + rank)
    return torch.randn(4, 2, 5, 5, generator=g) * (1 + rank), torch.randn(4, 3, generator=g)


def _bn_steps(rank: int, size: int, how: str) -> Any:
    torch.manual_seed(0)
    net = BatchNormNet()
    fn, state = fdp.make_functional(net)
    fsdp = fdp.FullyShardedDataParallel(state)
    shards = fsdp.shard(state)
    buffers = {k: v for k, v in state.items() if not isinstance(v, nn.Parameter)}
    opt = fdp.optim.sgd(0.1)
    opt_state = opt.init(shards)
    x, y = _images(rank)

    def loss(s: Any, b: dict[str, torch.Tensor]) -> torch.Tensor:
        out: torch.Tensor = (fn({**fsdp(s), **b}, x) - y).square().mean()
        return out

    for _ in range(2):
        if how == "backward":
            torch.autograd.backward(loss(shards, buffers))
            grads = {k: tuple(t.grad for t in ts) for k, ts in shards.items()}
        else:  # torch.func mutates only its inputs' buffers: pass them as one
            grads = torch.func.grad(loss)(shards, buffers)
        with torch.no_grad():
            new, opt_state = opt.update(grads, opt_state, shards)
        shards = {k: tuple(t.requires_grad_() for t in ts) for k, ts in new.items()}
    full = fsdp.full(shards)
    return fsdp.unit_names, {k: v.detach().clone() for k, v in full.items()}


def _grad(p: torch.Tensor) -> torch.Tensor:
    if p.grad is None:
        raise AssertionError("a parameter without a gradient")
    return p.grad


def _bn_reference(size: int) -> list[dict[str, torch.Tensor]]:
    """One process: a copy per rank, each normalising (and tracking) its own batch."""
    nets = []
    for _ in range(size):
        torch.manual_seed(0)
        nets.append(BatchNormNet())
    for _ in range(2):
        grads: list[dict[str, torch.Tensor]] = []
        for rank, net in enumerate(nets):
            x, y = _images(rank)
            net.zero_grad()
            torch.autograd.backward((net(x) - y).square().mean())
            grads.append({k: _grad(p) for k, p in net.named_parameters()})
        with torch.no_grad():
            for net in nets:
                for k, p in net.named_parameters():
                    p.sub_(0.1 * torch.stack([g[k] for g in grads]).mean(0))
    return [dict(net.state_dict()) for net in nets]


@pytest.mark.parametrize("how", ["backward", "func_grad"])
def test_buffers_stay_whole_and_track_each_ranks_batch_as_fully_shard(how: str) -> None:
    # The running statistics were sharded like frozen parameters and never moved.
    expected = _bn_reference(2)
    assert not torch.equal(expected[0]["bn.running_mean"], torch.zeros(4))
    for rank, (names, full) in enumerate(ranks.world(2).run(_bn_steps, how)):
        assert names == ["bn", "conv", "head"]
        tree_allclose(full, expected[rank], rtol=1e-5, atol=1e-6)


def _named_buffers(rank: int, size: int) -> Any:
    params: dict[str, Any] = {"w": torch.ones(3), "stats": {"mean": torch.zeros(3)}}
    try:
        fdp.FullyShardedDataParallel(params, buffers=["stat"])
    except ValueError as e:
        error = str(e)
    fsdp = fdp.FullyShardedDataParallel(params, buffers=["stats"])
    tree = fsdp(fsdp.shard(params))
    # Beside nn.Parameters, a plain tensor that requires grad is trained, so sharded.
    mixed = {"p": torch.nn.Parameter(torch.ones(2)), "t": torch.ones(3, requires_grad=True)}
    assert fdp.FullyShardedDataParallel(mixed).unit_names == ["p", "t"]
    tree["stats"]["mean"].add_(rank + 1)  # lands on this rank's own tensor
    return fsdp.unit_names, params["stats"]["mean"].tolist(), error


def test_named_buffers_stay_whole_and_a_wrong_name_is_refused() -> None:
    for rank, (names, mean, error) in enumerate(ranks.world(2).run(_named_buffers)):
        assert names == ["w"]
        assert mean == [rank + 1.0] * 3
        assert "`buffers` names 'stat', which holds no leaf of `params`" in error


def _full_refused_on_rank_1(rank: int, size: int) -> tuple[str, Any]:
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(5, 3, generator=g), "b": torch.randn(7, generator=g)}
    fsdp = fdp.FullyShardedDataParallel(params)
    shards = fsdp.shard(params)
    try:
        fsdp.full({"nope": ()} if rank == 1 else shards)
        said = "returned"
    except ValueError as e:
        said = str(e)
    return said, fsdp.full(shards)  # the group is still usable


def test_full_refused_on_one_rank_raises_on_every_rank() -> None:
    # Before: rank 1 raised, rank 0 waited in the first all-gather until the group's timeout.
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(5, 3, generator=g), "b": torch.randn(7, generator=g)}
    (said0, full0), (said1, full1) = ranks.world(2).run(_full_refused_on_rank_1)
    expected = "`shards` expected the dict shard() returns, with the units ['b', 'w']; got ['nope']"
    assert said1 == f"fdp.FullyShardedDataParallel.full: {expected}"
    assert said0 == f"fdp.FullyShardedDataParallel.full: rank 1 raised ValueError: {expected}"
    for full in (full0, full1):
        tree_allclose(full, params, rtol=0, atol=0)
