"""fdp._comm._quantized_mean on 2 and 3 gloo ranks against the rounding written out in one
process (2 ranks: one all-gather of the whole vectors; 3: an all-to-all, then an all-gather)."""

from __future__ import annotations

import pytest
import torch

from fdp._comm import _quantized_mean
from tests import ranks
from tests.test_streaming_diloco import mean_over_wire

WIRES = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]


def vector(rank: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(n, generator=g) * torch.logspace(-3, 2, n)  # blocks of unlike scales
    x[:7] = 0.0  # a block's head of zeros
    return x


def _mean(rank: int, size: int, n: int, advance: bool) -> list[torch.Tensor]:
    out = []
    for wire in WIRES:
        pending = _quantized_mean.quantized_mean_start(vector(rank, n), wire=wire, group=None)
        if advance:
            pending.advance()
        out.append(pending.wait())
    return out


@pytest.mark.parametrize(("world", "n"), [(3, 1), (3, 700), (3, 1536), (2, 1), (2, 1000)])
def test_every_rank_gets_the_mean_through_the_wire(world: int, n: int) -> None:
    got = ranks.world(world).run(_mean, n, n == 700)
    for i, wire in enumerate(WIRES):
        expected = mean_over_wire([vector(r, n) for r in range(world)], wire)
        for rank in range(world):
            torch.testing.assert_close(got[rank][i], expected, rtol=1e-6, atol=0)
        # int8: off by at most half a step (max|x| / 127) in each of the two roundings.
        exact = torch.stack([vector(r, n) for r in range(world)]).mean(0)
        if wire == torch.int8:
            bound = max(float(vector(r, n).abs().max()) for r in range(world)) / 127
            assert float((got[0][i] - exact).abs().max()) <= bound


def test_the_wire_carries_a_quarter_of_float32s_bytes() -> None:
    n = 1 << 20
    assert _quantized_mean.packed_bytes(n, torch.int8) / (4 * n) < 0.26
