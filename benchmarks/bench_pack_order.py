"""Packing a bucket under inductor: each leaf's logical order against its memory order.

Compiled DDP packs every bucket with ``torch.cat`` of 1-D pieces, each
converted and scaled, which inductor fuses into one copy. Before issue 22
the pieces were each gradient in logical order (``g.reshape(-1)``); now
they are in the parameter's memory order (``g.permute(order).reshape(-1)``),
the order eager DDP and ZeroRedundancy use, so that one bucket layout
serves all three. This measures what the move costs or saves: a
ResNet-like set of ``channels_last`` conv gradients plus biases, packed by
each compiled function, when the gradients arrive in the parameters' layout
(what autograd gives them) and when they arrive contiguous. Ratios of
timings interleaved round by round in one run.

    python benchmarks/bench_pack_order.py
    python benchmarks/bench_pack_order.py --quick
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable

import torch
from timing import interleaved

from fdp import _bucket

CHANNELS = [(64, 64), (128, 64), (128, 128), (256, 128), (256, 256), (512, 256), (512, 512)]


def gradients(layout: torch.memory_format) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = []
    for c_out, c_in in CHANNELS:
        out.append(torch.randn(c_out, c_in, 3, 3, generator=g).to(memory_format=layout))
        out.append(torch.randn(c_out, generator=g))
    return out


def packer(bucket: _bucket.Bucket, *, memory: bool) -> Callable[[list[torch.Tensor]], torch.Tensor]:
    def logical(gs: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([gs[i].reshape(-1) * 0.5 for i in bucket.indices])

    def in_memory_order(gs: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(bucket.pieces([gs[i] for i in bucket.indices], scale=0.5))

    return torch.compile(in_memory_order if memory else logical, fullgraph=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    rounds, repeats = (3, 5) if args.quick else (9, 20)
    params = gradients(torch.channels_last)
    (bucket,) = _bucket.plan(params, cap_bytes=1 << 40)
    mb = bucket.numel * 4 / 2**20
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, bucket {mb:.1f} MB")
    for name, layout in (
        ("channels_last", torch.channels_last),
        ("contiguous", torch.contiguous_format),
    ):
        gs = gradients(layout)
        logical, memory = packer(bucket, memory=False), packer(bucket, memory=True)
        torch.testing.assert_close(logical(gs).sum(), memory(gs).sum())
        t = interleaved(
            {"logical": functools.partial(logical, gs), "memory": functools.partial(memory, gs)},
            rounds=rounds,
            repeats=repeats,
        )
        print(
            f"grads {name:13s}: logical order {t['logical'] * 1e3:.2f} ms, memory order "
            f"{t['memory'] * 1e3:.2f} ms -> memory / logical {t['memory'] / t['logical']:.3f}x"
        )


if __name__ == "__main__":
    main()
