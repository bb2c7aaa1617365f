"""fdp.data_parallel benchmarks: ratios of side-by-side timings taken in one run.

The machine this runs on may be shared and noisy, so every figure is a ratio
(or a difference) of two measurements interleaved round by round, and the
median over rounds is reported.

    python benchmarks/bench_data_parallel.py            # all three
    python benchmarks/bench_data_parallel.py --quick    # fewer rounds

1. step: forward + backward of a 6-layer 512-wide MLP at batch 512,
   data_parallel over two replicas vs one direct call (target <= 1.15x), and
   vs the same chunks run one after another without fdp (what splitting the
   batch costs by itself, which no data-parallel library can avoid).
2. overhead: data_parallel on a tiny function with two replicas, minus the
   direct call (target <= 150 us).
3. replicate: 1000 leaves vs 10 leaves of the same total bytes (target <= 2x).
   Copies happen only across devices, so this needs a GPU; on a CPU-only
   machine the replicas share the leaves and only fdp's per-leaf bookkeeping
   is measured, which is reported but has no target.
4. compiled: the step of 1 under torch.compile (inductor), vs eager.
"""

from __future__ import annotations

import argparse
from typing import Any

import results
import torch
from timing import side_by_side

import fdp


def mlp(params: list[tuple[torch.Tensor, torch.Tensor]], x: torch.Tensor) -> torch.Tensor:
    for w, b in params:
        x = torch.tanh(x @ w + b)
    return x


Layers = list[tuple[torch.Tensor, torch.Tensor]]


def step_inputs() -> tuple[Layers, list[torch.Tensor], torch.Tensor]:
    """A 6-layer 512-wide MLP, its leaves, and a batch of 512."""
    g = torch.Generator().manual_seed(0)
    width, depth, batch = 512, 6, 512
    params = [
        (
            (torch.randn(width, width, generator=g) / width**0.5).requires_grad_(),
            torch.zeros(width, requires_grad=True),
        )
        for _ in range(depth)
    ]
    leaves = [t for layer in params for t in layer]
    return params, leaves, torch.randn(batch, width, generator=g)


def bench_step(rounds: int, devices: list[str]) -> dict[str, float]:
    params, leaves, x = step_inputs()

    def direct() -> None:
        torch.autograd.grad(mlp(params, x).square().mean(), leaves)

    def parallel() -> None:
        out = fdp.data_parallel(mlp, params, x, devices=devices)
        torch.autograd.grad(out.square().mean(), leaves)

    def halves() -> None:
        # The same split without fdp: one thread, chunk after chunk.
        chunks = torch.tensor_split(x, len(devices))
        out = torch.cat([mlp(params, c) for c in chunks])
        torch.autograd.grad(out.square().mean(), leaves)

    t_direct, t_parallel = side_by_side(direct, parallel, rounds=rounds, repeats=10)
    t_loop, t_parallel2 = side_by_side(halves, parallel, rounds=rounds, repeats=10)
    return {
        "direct_ms": 1e3 * t_direct,
        "fdp_ms": 1e3 * t_parallel,
        "ratio": t_parallel / t_direct,
        "loop_ms": 1e3 * t_loop,
        "vs_loop": t_parallel2 / t_loop,
    }


def bench_compiled(rounds: int, devices: list[str]) -> dict[str, float]:
    """The step of bench_step, eager vs torch.compile (inductor), same model and data."""
    params, leaves, x = step_inputs()

    def loss(params: Layers, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = fdp.data_parallel(mlp, params, x, devices=devices)
        return out.square().mean()

    compiled = torch.compile(loss)

    def eager_step() -> None:
        torch.autograd.grad(loss(params, x), leaves)

    def compiled_step() -> None:
        torch.autograd.grad(compiled(params, x), leaves)

    t_eager, t_compiled = side_by_side(eager_step, compiled_step, rounds=rounds, repeats=10)
    return {
        "eager_ms": 1e3 * t_eager,
        "compiled_ms": 1e3 * t_compiled,
        "ratio": t_compiled / t_eager,
    }


def bench_overhead(rounds: int, devices: list[str]) -> dict[str, float]:
    params = {"w": torch.randn(4, requires_grad=True)}
    x = torch.randn(8, 4)

    def tiny(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return x * p["w"]

    t_direct, t_parallel = side_by_side(
        lambda: tiny(params, x),
        lambda: fdp.data_parallel(tiny, params, x, devices=devices),
        rounds=rounds,
        repeats=300,
    )
    return {
        "direct_us": 1e6 * t_direct,
        "fdp_us": 1e6 * t_parallel,
        "overhead_us": 1e6 * (t_parallel - t_direct),
    }


def bench_replicate(rounds: int) -> dict[str, Any]:
    total = 1 << 22  # 4 Mi float32 = 16 MiB in both trees
    if torch.cuda.device_count() >= 2:
        source, devices = "cuda:0", ["cuda:0", "cuda:1"]
    elif torch.cuda.is_available():
        source, devices = "cpu", ["cuda:0"]
    else:
        source, devices = "cpu", ["cpu", "cpu"]
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    many = [torch.randn(total // 1000, device=source, requires_grad=True) for _ in range(1000)]
    few = [torch.randn(total // 10, device=source, requires_grad=True) for _ in range(10)]
    t_many, t_few = side_by_side(
        lambda: fdp.replicate(many, devices),
        lambda: fdp.replicate(few, devices),
        rounds=rounds,
        repeats=10,
        sync=sync,
    )
    return {
        "devices": f"{source} -> {devices}",
        "copies": source not in devices or len(set(devices)) > 1,
        "1000_leaves_ms": 1e3 * t_many,
        "10_leaves_ms": 1e3 * t_few,
        "ratio": t_many / t_few,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--devices", default="cpu,cpu")
    args = parser.parse_args()
    rounds = 5 if args.quick else 15
    devices = args.devices.split(",")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, devices {devices}"
    )

    step = bench_step(rounds, devices)
    print(
        f"step      6x512 MLP fwd+bwd, batch 512: direct {step['direct_ms']:.2f} ms, "
        f"data_parallel {step['fdp_ms']:.2f} ms -> {step['ratio']:.3f}x (target <= 1.15x)"
    )
    print(
        f"          same chunks in a plain loop {step['loop_ms']:.2f} ms: data_parallel / loop "
        f"-> {step['vs_loop']:.3f}x"
    )
    over = bench_overhead(rounds, devices)
    print(
        f"overhead  tiny fn: direct {over['direct_us']:.1f} us, data_parallel "
        f"{over['fdp_us']:.1f} us -> {over['overhead_us']:.1f} us per call "
        "(target <= 60 us, then 30 us)"
    )
    comp = bench_compiled(rounds, devices)
    print(
        f"compiled  same step, torch.compile (inductor) {comp['compiled_ms']:.2f} ms vs eager "
        f"{comp['eager_ms']:.2f} ms -> {comp['ratio']:.3f}x"
    )
    rep = bench_replicate(rounds)
    target = "(target <= 2x)" if rep["copies"] else "(no copy on one device: no target)"
    print(
        f"replicate {rep['devices']}: 1000 leaves {rep['1000_leaves_ms']:.3f} ms, 10 leaves "
        f"{rep['10_leaves_ms']:.3f} ms -> {rep['ratio']:.2f}x {target}"
    )
    figures = {"step_vs_direct": step["ratio"], "step_vs_loop": step["vs_loop"]}
    figures |= {"overhead_us": over["overhead_us"], "compiled_vs_eager": comp["ratio"]}
    results.record("bench_data_parallel", figures)


if __name__ == "__main__":
    main()
