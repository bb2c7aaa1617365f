"""DDP's own host work per step, where the kernels cost next to nothing: fdp against torch.

On a GPU a small model's step is bound by the host: the time is the Python
and the launches around the kernels, not the kernels (docs/performance.md,
"On one H200"). This benchmark measures that work on this machine's CPU:
models whose tensors are tiny, so that what each method adds per leaf, per
autograd node and per module shows, at one gloo rank (no communication to
wait for):

- ``mlp160``: 80 ``Linear(16, 16)`` + ``Tanh`` layers (160 leaves), batch 4;
- ``resnet50``: Hugging Face's ResNet-50 from its default config (161
  trained leaves, 159 buffers, 286 modules), two 32x32 images.

Four steps each, forward, backward and ``torch.optim.SGD``, split by phase:
the module alone, torch DDP, ``make_functional`` alone (``fn(state, x)``)
and fdp DDP (``fn(ddp(state), x)``). Every round runs one step of each in
rotating order (three rounds warm up); the figures are medians over rounds. The headline figures:
fdp DDP's step over torch DDP's, and what each DDP adds to its backward
(fdp DDP over ``make_functional`` alone, torch DDP over the module alone).

    python benchmarks/bench_ddp_host.py [--quick] [--models mlp160,resnet50]

The last line is one JSON object: ``{"rows": [...]}``.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings
from collections.abc import Callable
from typing import Any

import results
import torch
import torch.distributed as dist
from bench_ddp_phases import PHASES, Phased, method_rows, phased, rotate

import fdp

MODELS = ("mlp160", "resnet50")
METHODS = ("module alone", "torch DDP", "make_functional alone", "fdp DDP")


def build(name: str) -> tuple[torch.nn.Module, torch.Tensor]:
    """The model (the same weights each time) and its input."""
    torch.manual_seed(0)
    if name == "mlp160":
        layers: list[torch.nn.Module] = []
        for _ in range(80):
            layers += [torch.nn.Linear(16, 16), torch.nn.Tanh()]
        return torch.nn.Sequential(*layers), torch.randn(4, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import transformers
    t: Any = transformers
    model = t.ResNetForImageClassification(t.ResNetConfig())
    return model.train(), torch.randn(2, 3, 32, 32)


def _scalar(out: Any) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out
    return logits.float().sum()  # type: ignore[no-any-return]


def _sgd(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-4)


def methods(name: str) -> dict[str, Phased]:
    """The four steps, each on a model of its own."""
    alone, x = build(name)
    wrapped, _ = build(name)
    torch_ddp: Any = torch.nn.parallel.DistributedDataParallel(wrapped)
    fn, state = fdp.make_functional(build(name)[0])
    fn_ddp, ddp_state = fdp.make_functional(build(name)[0])
    ddp = fdp.DistributedDataParallel(ddp_state)

    def trained(tree: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        return [t for t in tree.values() if t.requires_grad]

    forwards: list[tuple[Callable[[], Any], list[torch.Tensor]]] = [
        (lambda: alone(x), list(alone.parameters())),
        (lambda: torch_ddp(x), list(wrapped.parameters())),
        (lambda: fn(state, x), trained(state)),
        (lambda: fn_ddp(ddp(ddp_state), x), trained(ddp_state)),
    ]
    return {
        method: phased(_losses(forward), params, optimizer=_sgd)
        for method, (forward, params) in zip(METHODS, forwards, strict=True)
    }


def _losses(forward: Callable[[], Any]) -> Callable[[], torch.Tensor]:
    return lambda: _scalar(forward())


def figures(name: str, rows: list[dict[str, Any]]) -> dict[str, float]:
    by = {row["method"]: row for row in rows if row["model"] == name}
    fdp_ddp, torch_ddp = by["fdp DDP"], by["torch DDP"]
    return {
        f"{name}.fdp_vs_torch": fdp_ddp["step_ms"] / torch_ddp["step_ms"],
        f"{name}.fdp_backward_added_ms": (
            fdp_ddp["backward_ms"] - by["make_functional alone"]["backward_ms"]
        ),
        f"{name}.torch_backward_added_ms": (
            torch_ddp["backward_ms"] - by["module alone"]["backward_ms"]
        ),
        f"{name}.fdp_forward_minus_torch_ms": fdp_ddp["forward_ms"] - torch_ddp["forward_ms"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds; records nothing")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated")
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29518")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    rows: list[dict[str, Any]] = []
    recorded: dict[str, float] = {}
    print(f"torch {torch.__version__}, 1 gloo rank, 1 thread; ms a step (median)")
    for name in args.models.split(","):
        rounds = {"mlp160": 300, "resnet50": 60}[name] // (5 if args.quick else 1)
        rows += method_rows(rotate(methods(name), rounds), model=name)
        for row in rows[-len(METHODS) :]:
            cells = "  ".join(f"{p} {row[f'{p}_ms']:8.3f}" for p in (*PHASES, "step"))
            print(f"  {name:9s} {row['method']:22s} {cells}")
        recorded |= figures(name, rows)
    for key, value in recorded.items():
        print(f"  {key}: {value:.3f}")
    if not args.quick and args.models == ",".join(MODELS):
        results.record("bench_ddp_host", recorded)
    dist.destroy_process_group()
    print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
