"""Hugging Face models fully sharded: fdp's ``fsdp.wrap`` against torch's ``fully_shard`` and DDP.

GPT-2 and Llama from configs (``transformers``, random weights), 2 and 4
gloo ranks, one AdamW step per iteration. Per rank 0, for each method:

- held between steps: the bytes of what the method keeps (parameters or
  shards, optimizer state, buffers), each storage once;
- peak in the step: that, plus how far the allocator's bytes in use
  (glibc's ``mallinfo2``, read after every op by a dispatch mode, as
  ``fsdp_memory.py`` does) rise during one step over its start;
- step time: median of interleaved rounds (the methods alternate).

Methods: fdp fully sharded (``make_functional``, ``FullyShardedDataParallel``
with the default units, ``fsdp.wrap(fn)``: each block gathered while it
runs; ``fdp.optim.adamw`` in place); torch ``fully_shard`` on each block,
then the root; torch ``DistributedDataParallel``. The same model, batch
and optimizer settings for every method.

    python benchmarks/bench_models.py [--quick]

The last line is one JSON object: ``{"rows": [...]}``.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import json
import multiprocessing as mp
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

import optree
import results
import torch
import torch.distributed as dist
from fsdp_memory import in_use, peak_of
from timing import interleaved

import fdp

MB = 2**20
BLOCKS = {"gpt2": "transformer.h", "llama": "model.layers"}


def build(name: str, quick: bool) -> torch.nn.Module:
    """The model from a config, the same on every rank (one seed, no dropout)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import transformers
    t: Any = transformers
    torch.manual_seed(0)
    layers, width, vocab = (4, 256, 4000) if quick else (8, 512, 8000)
    if name == "gpt2":
        config = t.GPT2Config(n_layer=layers, n_embd=width, n_head=8, n_positions=128,
                              vocab_size=vocab, resid_pdrop=0.0, embd_pdrop=0.0,
                              attn_pdrop=0.0, use_cache=False)  # fmt: skip
        model: torch.nn.Module = t.GPT2LMHeadModel(config)
    else:
        config = t.LlamaConfig(hidden_size=width, intermediate_size=2 * width,
                               num_hidden_layers=layers, num_attention_heads=8,
                               num_key_value_heads=4, vocab_size=vocab, use_cache=False,
                               max_position_embeddings=128)  # fmt: skip
        model = t.LlamaForCausalLM(config)
    model.loss_type = "ForCausalLM"  # type: ignore[assignment]  # no warning_once per call
    return model.train()


def batch(rank: int, quick: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    vocab = 4000 if quick else 8000
    return torch.randint(0, vocab, (4, 64), generator=g)


def fdp_step(name: str, ids: torch.Tensor, quick: bool) -> tuple[Callable[[], None], Any]:
    model = build(name, quick)
    fn, state = fdp.make_functional(model)
    fsdp = fdp.FullyShardedDataParallel(state)
    shards = {k: tuple(t.requires_grad_() for t in ts) for k, ts in fsdp.shard(state).items()}
    run = fsdp.wrap(fn)  # the module's own copy released
    del state
    opt = fdp.optim.adamw(1e-4)
    box = [opt.init(shards)]

    def step() -> None:
        run(shards, input_ids=ids, labels=ids).loss.backward()
        grads = {k: tuple(t.grad for t in ts) for k, ts in shards.items()}
        plain = {k: tuple(t.detach() for t in ts) for k, ts in shards.items()}
        _, box[0] = opt.update(grads, box[0], plain, donate=True)  # in place: the shards
        for ts in shards.values():
            for t in ts:
                t.grad = None

    return step, (model, shards, box)


def torch_step(
    name: str, ids: torch.Tensor, quick: bool, *, sharded: bool
) -> tuple[Callable[[], None], Any]:
    from torch.distributed.fsdp import fully_shard

    model = build(name, quick)
    if sharded:
        blocks: Any = model.get_submodule(BLOCKS[name])  # a ModuleList
        for block in blocks:
            fully_shard(block)
        fully_shard(model)
        wrapped: torch.nn.Module = model
    else:
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        wrapped(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    return step, (model, wrapped, opt)


METHODS = ("fdp fully sharded (wrap)", "torch fully_shard", "torch DDP")


def make(method: str, name: str, ids: torch.Tensor, quick: bool) -> tuple[Callable[[], None], Any]:
    if method == METHODS[0]:
        return fdp_step(name, ids, quick)
    return torch_step(name, ids, quick, sharded=method == METHODS[1])


def state_bytes(keep: Any) -> int:
    """Bytes of what a method keeps between steps: its parameters or shards (a DTensor's
    local tensor), optimizer state and the model's buffers, each storage once."""
    model = keep[0]
    tensors = [*model.parameters(), *model.buffers()]
    if isinstance(keep[-1], torch.optim.Optimizer):
        tensors += [t for s in keep[-1].state.values() for t in s.values()]
    else:  # fdp: the shards and the fdp.optim state
        tensors += optree.tree_leaves(keep[1:], none_is_leaf=False)
    seen: dict[int, int] = {}
    for obj in tensors:
        t = getattr(obj, "_local_tensor", obj)
        if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def measure(rank: int, name: str, quick: bool, rounds: int) -> dict[str, Any]:
    ids = batch(rank, quick)
    memory: dict[str, tuple[float, float]] = {}
    # Imports, and the caches a first model and step fill, before any base is taken.
    warm, keep = make(METHODS[2], name, ids, quick)
    warm()
    del warm, keep
    for method in METHODS:  # one at a time: nothing of another method is alive
        step, keep = make(method, name, ids, quick)
        step()
        step()
        held = state_bytes(keep)
        gc.collect()
        start = in_use()
        peak = held + peak_of(step) - start
        memory[method] = (held / MB, peak / MB)
        del step, keep
    steps = {m: make(m, name, ids, quick) for m in METHODS}
    times = interleaved({m: s for m, (s, _) in steps.items()}, rounds=rounds, repeats=2)
    return {"memory": memory, "times": times}


def serve(rank: int, size: int, port: int, args: Any, out: Any) -> None:
    # Every allocation over 64 KiB its own mapping, counted wherever it is made:
    # glibc otherwise raises that threshold as blocks are freed and serves later
    # tensors from per-thread arenas, which mallinfo2 does not count (gloo's
    # threads allocate too), so identical steps read apart by a model's size.
    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
        timeout=datetime.timedelta(seconds=600),
    )  # fmt: skip
    try:
        for name in args.models:
            got = measure(rank, name, args.quick, args.rounds)
            if rank == 0:
                out.put((name, got))
    finally:
        dist.destroy_process_group()


def rows_of(size: int, name: str, got: dict[str, Any]) -> list[dict[str, Any]]:
    ref_mem, ref_time = got["memory"][METHODS[1]], got["times"][METHODS[1]]
    rows = []
    for method in METHODS:
        held, peak = got["memory"][method]
        ms = got["times"][method] * 1e3
        rows.append({
            "model": name, "ranks": size, "method": method, "held_mib": round(held, 1),
            "peak_mib": round(peak, 1), "step_ms": round(ms, 1),
            "held_vs_fully_shard": round(held / ref_mem[0], 3),
            "peak_vs_fully_shard": round(peak / ref_mem[1], 3),
            "step_vs_fully_shard": round(ms / (ref_time * 1e3), 3),
        })  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model, fewer rounds")
    parser.add_argument("--ranks", default="2,4", help="world sizes, comma-separated")
    parser.add_argument("--models", default="gpt2,llama", type=lambda s: s.split(","))
    args = parser.parse_args()
    args.rounds = 3 if args.quick else 7
    rows: list[dict[str, Any]] = []
    ctx = mp.get_context("spawn")
    for size in (int(s) for s in args.ranks.split(",")):
        out = ctx.Queue()
        port = 29000 + os.getpid() % 1000 + size
        procs = [ctx.Process(target=serve, args=(r, size, port, args, out)) for r in range(size)]
        for p in procs:
            p.start()
        for _ in args.models:
            name, got = out.get(timeout=1800)
            rows += rows_of(size, name, got)
            for row in rows[-len(METHODS) :]:
                print(f"{name} x{size} {row['method']:>26}: held {row['held_mib']:7.1f} MiB "
                      f"({row['held_vs_fully_shard']:.2f}x), peak {row['peak_mib']:7.1f} MiB "
                      f"({row['peak_vs_fully_shard']:.2f}x), step {row['step_ms']:7.1f} ms "
                      f"({row['step_vs_fully_shard']:.2f}x)", file=sys.stderr)  # fmt: skip
        for p in procs:
            p.join(120)
    print(json.dumps({"rows": rows}))
    results.record("bench_models", {k: v for row in rows for k, v in figures(row).items()})


def figures(row: dict[str, Any]) -> dict[str, float]:
    """One row's figures the pages quote, as ``gpt2_2.fdp.peak_vs_fully_shard``."""
    slug = {METHODS[0]: "fdp", METHODS[1]: "fully_shard", METHODS[2]: "ddp"}[row["method"]]
    prefix = f"{row['model']}_{row['ranks']}.{slug}"
    measured = ("held", "peak", "step")
    names = [f"{m}_{unit}" for m, unit in zip(measured, ("mib", "mib", "ms"), strict=True)]
    names += [f"{m}_vs_fully_shard" for m in measured]
    return {f"{prefix}.{name}": row[name] for name in names}


if __name__ == "__main__":
    main()
