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
from fdp._sharding import _fsdp_plan
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
    units = sorted({_fsdp_plan._default_unit(p) for p in _tree.segments(tree)})
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
