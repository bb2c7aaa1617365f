"""Training steps on Hugging Face models: torch DDP against fdp DDP and fdp's pure loop.

GPT-2 and Llama from configs (``transformers``, random weights; 4 layers,
width 128, 52 and 38 leaves), 2 gloo ranks, forward + backward + AdamW step.
All methods of one model are interleaved round by round in the same
processes; the figures are ratios to torch DDP's eager step:

- torch DDP: ``DistributedDataParallel(model)``, ``loss.backward()``,
  ``torch.optim.AdamW`` (foreach);
- fdp DDP + torch AdamW: ``fn(ddp(state))`` (``make_functional``),
  ``loss.backward()``, the same optimizer;
- fdp pure: ``fdp.grad`` of the loss, ``fdp.optim.adamw`` (pure: new
  parameters every step); the same with ``torch.func.grad`` (the loop
  before ``fdp.grad``), and with ``donate=True`` (the step writes into the
  parameters and state it is given);
- compiled: torch ``torch.compile(DDP(model))``; fdp's ``fn(ddp(state))``
  loss compiled with the same optimizer; fdp's pure loop with the loss and
  ``fdp.optim``'s update compiled. Their first step (the compile) runs
  before the timing; ``bench_compile_time.py`` times it, each method in
  processes of its own, with a cold and a warm cache.

The comparisons with targets (fdp DDP and fdp's pure loop against torch
DDP eager; fdp's pure loop compiled against torch's compiled DDP) are then
timed again head to head, each pair alone, alternating, four times the
rounds (``timing.paired``: the median of each round's ratio; the eight-way
rotation above puts other methods, and their memory, between the two, and
moves a ratio by up to 10% from run to run).

Also per rank, without DDP: one gradient by ``loss.backward()``,
``fdp.grad`` and ``torch.func.grad``; and one optimizer step,
``fdp.optim.adamw`` against ``torch.optim.AdamW(foreach=True)`` on the
model's leaves.

    python benchmarks/bench_models_step.py [--quick] [--models gpt2,llama]

The last line is one JSON object: ``{"rows": [...]}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import results
import torch
import torch.distributed as dist
from timing import interleaved, paired

import fdp

Step = Callable[[], Any]
SIZE = 2
BASE = "torch DDP"
# The targets' comparisons, timed again head to head (timing.paired): (reference, method).
HEAD_TO_HEAD = (
    (BASE, "fdp DDP + torch AdamW"),
    (BASE, "fdp pure (fdp.grad + fdp.optim)"),
    (BASE, "fdp pure, donate=True"),
    ("torch DDP compiled", "fdp pure compiled"),
)


def build(name: str) -> torch.nn.Module:
    """The model from a config, the same on every rank (one seed, no dropout)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import transformers
    t: Any = transformers
    torch.manual_seed(0)
    ids = {"vocab_size": 1000, "bos_token_id": 0, "eos_token_id": 0, "use_cache": False}
    if name == "gpt2":
        config = t.GPT2Config(n_layer=4, n_embd=128, n_head=4, n_positions=128, resid_pdrop=0.0,
                              embd_pdrop=0.0, attn_pdrop=0.0, **ids)  # fmt: skip
        model: torch.nn.Module = t.GPT2LMHeadModel(config)
    else:
        config = t.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=128, **ids)  # fmt: skip
        model = t.LlamaForCausalLM(config)
    model.loss_type = "ForCausalLM"  # type: ignore[assignment]  # no warning_once per call
    return model.train()


def batch(rank: int) -> torch.Tensor:
    return torch.randint(0, 1000, (4, 64), generator=torch.Generator().manual_seed(rank))


def split(state: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, Any]]:
    """make_functional's state as (parameters, buffers), detached: fdp.grad takes the first."""
    params = {k: v.detach() for k, v in state.items() if v.requires_grad}
    return params, {k: v for k, v in state.items() if not v.requires_grad}


def torch_ddp(name: str, ids: torch.Tensor, *, compiled: bool) -> Step:
    model = build(name)
    ddp: Any = torch.nn.parallel.DistributedDataParallel(model)
    run = torch.compile(ddp) if compiled else ddp
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

    def step() -> None:
        run(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    return step


def fdp_ddp_torch_optim(name: str, ids: torch.Tensor, *, compiled: bool = False) -> Step:
    fn, state = fdp.make_functional(build(name))
    ddp = fdp.DistributedDataParallel(state)
    opt = torch.optim.AdamW([t for t in state.values() if t.requires_grad], lr=1e-4, foreach=True)

    def loss(s: dict[str, Any]) -> torch.Tensor:
        out: torch.Tensor = fn(ddp(s), input_ids=ids, labels=ids).loss
        return out

    run = torch.compile(loss) if compiled else loss

    def step() -> None:
        torch.autograd.backward(run(state))
        opt.step()
        opt.zero_grad()

    return step


def fdp_pure(
    name: str,
    ids: torch.Tensor,
    *,
    grad: Any,
    compiled: bool = False,
    donate: bool = False,
) -> Step:
    fn, state = fdp.make_functional(build(name))
    ddp = fdp.DistributedDataParallel(state)
    params, buffers = split(state)

    def loss(p: dict[str, Any], b: dict[str, Any]) -> torch.Tensor:
        out: torch.Tensor = fn(ddp({**p, **b}), input_ids=ids, labels=ids).loss
        return out

    opt = fdp.optim.adamw(torch.tensor(1e-4) if compiled else 1e-4)
    update = torch.compile(opt.update, fullgraph=True) if compiled else opt.update
    run = grad(torch.compile(loss) if compiled else loss)
    box = [params, opt.init(params)]

    def step() -> None:
        grads = run(box[0], buffers)
        box[0], box[1] = update(grads, box[1], box[0], donate=donate)

    return step


def methods(name: str, ids: torch.Tensor) -> dict[str, Callable[[], Step]]:
    return {
        BASE: lambda: torch_ddp(name, ids, compiled=False),
        "fdp DDP + torch AdamW": lambda: fdp_ddp_torch_optim(name, ids),
        "fdp pure (fdp.grad + fdp.optim)": lambda: fdp_pure(name, ids, grad=fdp.grad),
        "fdp pure, torch.func.grad": lambda: fdp_pure(name, ids, grad=torch.func.grad),
        "fdp pure, donate=True": lambda: fdp_pure(name, ids, grad=fdp.grad, donate=True),
        "torch DDP compiled": lambda: torch_ddp(name, ids, compiled=True),
        "fdp DDP compiled + torch AdamW": lambda: fdp_ddp_torch_optim(name, ids, compiled=True),
        "fdp pure compiled": lambda: fdp_pure(name, ids, grad=fdp.grad, compiled=True),
    }


def local_parts(name: str, ids: torch.Tensor) -> dict[str, Step]:
    """One gradient three ways, one optimizer step two ways: no DDP, this rank alone."""
    model = build(name)
    fn, state = fdp.make_functional(model)
    params, buffers = split(state)

    def loss(p: dict[str, Any]) -> torch.Tensor:
        out: torch.Tensor = fn({**p, **buffers}, input_ids=ids, labels=ids).loss
        return out

    def backward() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad()

    leaves = [t.clone().requires_grad_() for t in params.values()]  # not the model's
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    for t, g in zip(leaves, grads.values(), strict=True):
        t.grad = g
    reference = torch.optim.AdamW(leaves, lr=1e-4, foreach=True)
    opt = fdp.optim.adamw(1e-4)
    box = [params, opt.init(params)]

    def fdp_update() -> None:
        box[0], box[1] = opt.update(grads, box[1], box[0])

    return {
        "grad: loss.backward()": backward,
        "grad: fdp.grad": lambda: fdp.grad(loss)(params),
        "grad: torch.func.grad": lambda: torch.func.grad(loss)(params),
        "optim: torch.optim.AdamW foreach": reference.step,
        "optim: fdp.optim.adamw": fdp_update,
    }


def measure(rank: int, name: str, args: Any) -> dict[str, float]:
    rounds = args.rounds
    ids = batch(rank)
    steps: dict[str, Step] = {}
    for method, make in methods(name, ids).items():
        steps[method] = make()
        steps[method]()  # the first step: compiles, where the method compiles
    times = interleaved(steps, rounds=rounds, repeats=3, sync=dist.barrier)
    for reference, method in HEAD_TO_HEAD:  # alone: no other method between the two
        ratio, _, mine = paired(steps[reference], steps[method], rounds=4 * rounds, repeats=3,
                                sync=dist.barrier)  # fmt: skip
        times[f"head to head: {method}"] = mine
        times[f"head to head ratio: {method}"] = ratio
    parts = local_parts(name, ids)
    return times | interleaved(parts, rounds=rounds, repeats=3)


Measure = Callable[[int, str, Any], Any]  # (rank, model, the parsed command line)


def join_group(rank: int, size: int, port: int) -> None:
    """This rank's gloo group on the loopback, one intra-op thread; a hang times out."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
        timeout=datetime.timedelta(seconds=900),
    )  # fmt: skip


def serve(rank: int, size: int, port: int, args: Any, out: Any, measure: Measure) -> None:
    """One rank: ``measure(rank, model, args)`` for each of ``args.models``; rank 0
    sends each model's figures to ``out``."""
    join_group(rank, size, port)
    try:
        for name in args.models:
            got = measure(rank, name, args)
            if rank == 0:
                out.put((name, got))
    finally:
        dist.destroy_process_group()


def rows_of(name: str, times: dict[str, float]) -> list[dict[str, Any]]:
    base = times[BASE]
    rows = []
    for method, seconds in times.items():
        if method.startswith("head to head ratio: "):
            continue
        if method.startswith("head to head: "):
            ratio = round(times[method.replace(":", " ratio:", 1)], 3)
            ms = round(seconds * 1e3, 2)
            rows.append({"model": name, "ranks": SIZE, "method": method, "ms": ms,
                         "vs_reference": ratio})  # fmt: skip
            continue
        if method.startswith("grad: "):
            ref = times["grad: loss.backward()"]
        elif method.startswith("optim: "):
            ref = times["optim: torch.optim.AdamW foreach"]
        else:
            ref = base
        rows.append({"model": name, "ranks": SIZE, "method": method,
                     "ms": round(seconds * 1e3, 2),
                     "vs_reference": round(seconds / ref, 3)})  # fmt: skip
    return rows


SLUGS = {
    BASE: "torch_ddp",
    "fdp DDP + torch AdamW": "fdp_ddp_torch_optim",
    "fdp pure (fdp.grad + fdp.optim)": "fdp_pure",
    "fdp pure, torch.func.grad": "fdp_pure_func_grad",
    "fdp pure, donate=True": "fdp_pure_donated",
    "torch DDP compiled": "torch_ddp_compiled",
    "fdp DDP compiled + torch AdamW": "fdp_ddp_compiled_torch_optim",
    "fdp pure compiled": "fdp_pure_compiled",
    "grad: loss.backward()": "grad_backward",
    "grad: fdp.grad": "grad_fdp",
    "grad: torch.func.grad": "grad_func",
    "optim: torch.optim.AdamW foreach": "optim_torch",
    "optim: fdp.optim.adamw": "optim_fdp",
    "head to head: fdp DDP + torch AdamW": "head_to_head.fdp_ddp_torch_optim",
    "head to head: fdp pure (fdp.grad + fdp.optim)": "head_to_head.fdp_pure",
    "head to head: fdp pure, donate=True": "head_to_head.fdp_pure_donated",
    "head to head: fdp pure compiled": "head_to_head.fdp_pure_compiled",
}


def figures(row: dict[str, Any]) -> dict[str, float]:
    """One row's figures, as ``gpt2.fdp_pure.vs_reference``."""
    prefix = f"{row['model']}.{SLUGS[row['method']]}"
    return {f"{prefix}.{k}": row[k] for k in ("ms", "vs_reference")}


def over_ranks(measure: Measure, args: Any) -> list[Any]:
    """``measure`` on SIZE spawned ranks: rank 0's ``(model, figures)`` for each of
    ``args.models``."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    procs = [
        ctx.Process(target=serve, args=(r, SIZE, port, args, out, measure)) for r in range(SIZE)
    ]
    for p in procs:
        p.start()
    got = [received(out, procs) for _ in args.models]
    for p in procs:
        p.join(120)
    return got


def received(out: Any, procs: list[Any]) -> Any:
    """The next model's figures from rank 0; exits if a rank died first (no hang)."""
    import queue

    deadline = time.monotonic() + 1800
    while time.monotonic() < deadline:
        try:
            return out.get(timeout=5)
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                break
    for p in procs:
        p.kill()
    sys.exit(f"a rank failed or timed out: exit codes {[p.exitcode for p in procs]}")


def parsed(doc: str, *, rounds: tuple[int, int]) -> argparse.Namespace:
    """The command line every two-rank model benchmark takes; ``rounds`` is
    (quick, full)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--models", default="gpt2,llama", type=lambda s: s.split(","))
    args, _ = parser.parse_known_args()  # nox -s bench passes every script the same flags
    args.rounds = rounds[0] if args.quick else rounds[1]
    return args


def main() -> None:
    args = parsed(__doc__, rounds=(5, 11))
    rows = [row for got in over_ranks(measure, args) for row in rows_of(*got)]
    for row in rows:
        print(f"{row['model']} {row['method']:>34}: {row['ms']:8.2f} ms "
              f"({row['vs_reference']:.2f}x)", file=sys.stderr)  # fmt: skip
    print(json.dumps({"rows": rows}))
    results.record("bench_models_step", {k: v for row in rows for k, v in figures(row).items()})


if __name__ == "__main__":
    main()
