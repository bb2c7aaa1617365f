"""Train a Hugging Face GPT-2 on 2 ranks with fdp: DDP with a torch optimizer, or fully sharded.

The model is ``transformers.GPT2LMHeadModel`` from a config (random
weights; nothing is downloaded), made a function of its state by
``fdp.make_functional``. The data is a token stream from a fixed random
Markov chain (each token has a few likely successors), so the loss has a
floor to learn towards: the chain's entropy.

- default: ``fdp.DistributedDataParallel`` and ``torch.optim.AdamW`` over the
  module's own parameters; the loss reads ``fn(ddp(state), ...)``.
- ``--fsdp``: ``fdp.FullyShardedDataParallel`` (one unit per block),
  ``run = fsdp.wrap(fn)`` (each block gathered while it runs, the module's
  own copy released), ``fdp.optim.adamw`` with a warm-up and cosine
  schedule over the shards, ``fsdp.clip_grad_norm``; ``--bf16`` gathers and
  computes in bfloat16 (float32 master shards and gradient sums).
- ``--compile``: the loss in one ``torch.compile`` graph.
- checkpoints every ``--checkpoint-every`` steps (``fdp.save_checkpoint``);
  ``--resume`` continues from ``fdp.latest_checkpoint``.
- ``--compare-torch``: the same steps again with torch's ``fully_shard`` on
  each block and the root, for its peak memory.

The last line printed is one JSON object (``summary`` says what it holds).

    torchrun --standalone --nproc_per_node=2 examples/finetune_hf.py --fsdp --compare-torch
    torchrun --standalone --nproc_per_node=2 examples/finetune_hf.py --fsdp --resume --steps 120
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import gc
import json
import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import common
import optree
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import state_dict as dcp_state

import fdp

with warnings.catch_warnings():  # transformers' optional-dependency notices
    warnings.simplefilter("ignore")
    import transformers


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = common.parser(__doc__, "finetune_hf")
    parser.add_argument("--fsdp", action="store_true", help="fully sharded (without: DDP)")
    parser.add_argument("--bf16", action="store_true", help="--fsdp: gather in bfloat16")
    parser.add_argument("--compile", action="store_true", help="the loss in torch.compile")
    parser.add_argument("--steps", type=int, default=80, help="train until this step")
    parser.add_argument("--batch-size", type=int, default=16, help="global, split over ranks")
    parser.add_argument("--context", type=int, default=32, help="tokens per sequence")
    parser.add_argument("--vocab", type=int, default=48, help="the Markov chain's tokens")
    parser.add_argument("--layers", type=int, default=4, help="GPT-2 blocks")
    parser.add_argument("--width", type=int, default=64, help="GPT-2 n_embd")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate")
    parser.add_argument("--warmup", type=int, default=10, help="--fsdp: warm-up steps")
    parser.add_argument("--max-norm", type=float, default=1.0, help="gradient clipping norm")
    parser.add_argument("--seed", type=int, default=0, help="chain, initialisation, batches")
    parser.add_argument(
        "--compare-torch", action="store_true", help="also torch's fully_shard's peak memory"
    )
    parser.add_argument(
        "--loss-threshold", type=float, default=None,
        help="exit 1 unless the final loss is below this (None: the chain's entropy + 0.5)",
    )  # fmt: skip
    common.add_checkpoint_args(parser, "finetune_hf", every=40)
    common.add_launch_args(parser)
    return parser.parse_args(argv)


def chain(vocab: int, seed: int) -> tuple[torch.Tensor, float]:
    """A random transition matrix (3 likely successors a token) and its entropy rate, nats."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.full((vocab, vocab), -6.0)
    for row in range(vocab):
        logits[row, torch.randperm(vocab, generator=g)[:3]] = torch.tensor([2.0, 1.0, 0.0])
    probs = logits.softmax(-1)
    stationary = torch.full((vocab,), 1.0 / vocab)
    for _ in range(200):
        stationary = stationary @ probs
    entropy = -(probs * probs.log()).sum(-1)
    return probs, float(stationary @ entropy)


def batch(probs: torch.Tensor, step: int, args: argparse.Namespace) -> torch.Tensor:
    """This rank's sequences of global step ``step`` (the same on every world size)."""
    g = torch.Generator().manual_seed(args.seed * 100_003 + step)
    tokens = [torch.randint(args.vocab, (args.batch_size,), generator=g)]
    for _ in range(args.context - 1):
        tokens.append(torch.multinomial(probs[tokens[-1]], 1, generator=g).squeeze(1))
    every = torch.stack(tokens, 1)
    per = args.batch_size // dist.get_world_size()
    rank = dist.get_rank()
    return every[rank * per : (rank + 1) * per].to(args.device)


def build(args: argparse.Namespace) -> torch.nn.Module:
    """GPT-2 from a config, the same on every rank. ``loss_type`` set: see docs/models.md."""
    torch.manual_seed(args.seed)
    t: Any = transformers
    config = t.GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=4,
                          n_positions=args.context, vocab_size=args.vocab, bos_token_id=0,
                          eos_token_id=0, use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0,
                          attn_pdrop=0.0)  # fmt: skip
    model: torch.nn.Module = t.GPT2LMHeadModel(config).to(args.device).train()
    # torch.compile(fullgraph=True): without a known loss type the loss warns
    # through transformers' logger.warning_once, where dynamo stops.
    model.loss_type = "ForCausalLM"  # type: ignore[assignment]
    return model


class Trainer:
    """One way of training (DDP or fully sharded): a step, and its checkpoint state."""

    step: Callable[[torch.Tensor], torch.Tensor]
    checkpoint: Callable[[], dict[str, Any]]
    load: Callable[[dict[str, Any]], None]
    kept: Callable[[], list[Any]]  # what it holds between steps: parameters, state, buffers


def ddp_trainer(args: argparse.Namespace) -> Trainer:
    """fdp DDP over the module's own parameters, stepped by torch.optim.AdamW."""
    model = build(args)
    fn, state = fdp.make_functional(model)
    ddp = fdp.DistributedDataParallel(state)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)

    def loss_of(ids: torch.Tensor) -> torch.Tensor:
        loss: torch.Tensor = fn(ddp(state), input_ids=ids, labels=ids).loss
        return loss

    loss_fn = torch.compile(loss_of, fullgraph=True) if args.compile else loss_of
    trainer = Trainer()

    def step(ids: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(ids)
        torch.autograd.backward(loss)
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)
        opt.step()
        opt.zero_grad()
        return loss.detach()

    def load(loaded: dict[str, Any]) -> None:
        dcp_state.set_state_dict(model, opt, model_state_dict=loaded["model"],
                                 optim_state_dict=loaded["optim"])  # fmt: skip

    def checkpoint() -> dict[str, Any]:
        # torch's own helpers: a fresh optimizer's state is made first, so
        # what a restarted job passes as `like` holds every entry.
        model_sd, optim_sd = dcp_state.get_state_dict(model, opt)
        return {"model": model_sd, "optim": optim_sd}

    trainer.step, trainer.checkpoint, trainer.load = step, checkpoint, load
    trainer.kept = lambda: [*model.parameters(), *model.buffers(), *_values(opt)]
    return trainer


def fsdp_trainer(args: argparse.Namespace) -> Trainer:
    """Fully sharded: shards, fsdp.wrap, fdp.optim.adamw with a schedule, clipping."""
    model = build(args)
    fn, state = fdp.make_functional(model)
    dtype = torch.bfloat16 if args.bf16 else None
    fsdp = fdp.FullyShardedDataParallel(state, param_dtype=dtype, reduce_dtype=torch.float32)
    shards = fsdp.shard(state)
    run = fsdp.wrap(fn)  # the model's own parameters are released here
    schedule = fdp.optim.warmup_cosine_decay_schedule(
        0.0, args.lr, warmup_steps=args.warmup, decay_steps=max(args.steps, args.warmup + 1)
    )
    opt = fdp.optim.adamw(schedule, weight_decay=0.01)
    box: dict[str, Any] = {"shards": shards, "opt": opt.init(shards)}

    def loss_of(s: Any, ids: torch.Tensor) -> torch.Tensor:
        loss: torch.Tensor = run(s, input_ids=ids, labels=ids).loss
        return loss

    loss_fn = torch.compile(loss_of, fullgraph=True) if args.compile else loss_of
    trainer = Trainer()

    def step(ids: torch.Tensor) -> torch.Tensor:
        s = {k: tuple(t.detach().requires_grad_() for t in ts) for k, ts in box["shards"].items()}
        loss = loss_fn(s, ids)
        torch.autograd.backward(loss)
        grads, _ = fsdp.clip_grad_norm({k: tuple(t.grad for t in ts) for k, ts in s.items()},
                                       args.max_norm)  # fmt: skip
        plain = {k: tuple(t.detach() for t in ts) for k, ts in s.items()}
        # In place (donate): no second copy of the shards and state at the step's peak.
        box["shards"], box["opt"] = opt.update(grads, box["opt"], plain, donate=True)
        return loss.detach()

    def checkpoint() -> dict[str, Any]:
        return {k: fsdp.to_checkpoint(v) for k, v in box.items()}

    def load(loaded: dict[str, Any]) -> None:
        box.update({k: fsdp.from_checkpoint(v) for k, v in loaded.items()})

    trainer.step, trainer.checkpoint, trainer.load = step, checkpoint, load
    trainer.kept = lambda: [box, *model.buffers()]
    return trainer


def torch_fully_shard_peak(args: argparse.Namespace, probs: torch.Tensor) -> float:
    """torch's fully_shard on each block and the root, the same steps: its peak, measured alike."""
    from torch.distributed.fsdp import fully_shard

    model = build(args)
    blocks: Any = model.get_submodule("transformer.h")
    for block in blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)

    def step(ids: torch.Tensor) -> torch.Tensor:
        loss: torch.Tensor = model(input_ids=ids, labels=ids).loss
        torch.autograd.backward(loss)
        opt.step()
        opt.zero_grad()
        return loss.detach()

    peak = 0.0
    for index in range(4):
        ids = batch(probs, index, args)
        if index >= 2:
            kept = [*model.parameters(), *model.buffers(), *_values(opt)]
            peak = max(peak, measured(step, ids, kept))
        else:
            step(ids)
    return peak


def _values(opt: torch.optim.Optimizer) -> list[Any]:
    """A torch optimizer's state tensors (its state is keyed by the parameters themselves)."""
    return [v for per in opt.state.values() for v in per.values()]


def kept_bytes(kept: list[Any]) -> int:
    """Bytes of the tensors in ``kept`` (a DTensor's local one), each storage once."""
    seen: dict[int, int] = {}
    leaves: list[Any] = optree.tree_leaves(kept, none_is_leaf=False)  # type: ignore[arg-type]
    for obj in leaves:
        t = getattr(obj, "_local_tensor", obj)
        if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def measured(step: Callable[[torch.Tensor], Any], ids: torch.Tensor, kept: list[Any]) -> float:
    """MiB at ``step``'s peak: what the method keeps between steps (parameters or shards,
    optimizer state, buffers), plus how far the allocator's bytes in use rise in the step
    (on CUDA: torch's caching allocator's own count)."""
    gc.collect()
    if ids.is_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step(ids)
        torch.cuda.synchronize()
        return (kept_bytes(kept) + torch.cuda.max_memory_allocated() - before) / 2**20
    with Peak() as sampled:
        start = sampled.peak
        step(ids)
    rise: int = sampled.peak - start
    return (kept_bytes(kept) + rise) / 2**20


class _Mallinfo(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]  # fmt: skip


def in_use() -> int:
    """glibc's bytes in use (where CPU tensors live); 0 where there is no glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return 0
    libc.mallinfo2.restype = _Mallinfo
    info = libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


class Peak:
    """The allocator's peak bytes in use while the block runs, read by a polling thread
    (whenever it holds the GIL, which ops release; compiled steps too)."""

    def __enter__(self) -> Peak:
        self.peak = in_use()
        self._running = True
        self._interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-5)
        self._thread = threading.Thread(target=self._poll)
        self._thread.start()
        return self

    def _poll(self) -> None:
        while self._running:
            self.peak = max(self.peak, in_use())
            time.sleep(0)

    def __exit__(self, *exc: Any) -> None:
        self._running = False
        self._thread.join()
        sys.setswitchinterval(self._interval)
        self.peak = max(self.peak, in_use())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.device = common.launch(args, __file__)
    try:
        return train(args)
    finally:
        dist.destroy_process_group()


def train(args: argparse.Namespace) -> int:
    probs, entropy = chain(args.vocab, args.seed)
    losses, peak = fit(args, fsdp_trainer(args) if args.fsdp else ddp_trainer(args), probs)
    torch_peak = torch_fully_shard_peak(args, probs) if args.compare_torch else None
    return summary(args, losses, entropy, peak, torch_peak)


def fit(
    args: argparse.Namespace, trainer: Trainer, probs: torch.Tensor
) -> tuple[list[float], float]:
    """Trains from the start or ``--resume``'s checkpoint; the losses and the peak (MiB)."""
    step = 0
    found = common.resume_from(args)
    if found is not None:
        loaded = fdp.load_checkpoint(found, {**trainer.checkpoint(), "step": 0})
        step = loaded.pop("step")
        trainer.load(loaded)
    mode = ("fully sharded" + (", bf16" if args.bf16 else "")) if args.fsdp else "DDP"
    common.log(f"GPT-2 ({args.layers} blocks, width {args.width}), {mode}, "
               f"{dist.get_world_size()} ranks, from step {step}")  # fmt: skip
    losses: list[float] = []
    peak = 0.0
    progress = common.Progress(range(step, args.steps), unit="step")
    for index in progress:
        ids = batch(probs, step, args)
        out: list[torch.Tensor] = []
        if index - progress.steps.start in (2, 3):  # warm: the peak, measured as torch's
            peak = max(
                peak, measured(functools.partial(_into, out, trainer.step), ids, trainer.kept())
            )
        else:
            out.append(trainer.step(ids))
        step += 1
        total = out[0].float().clone()
        dist.all_reduce(total)
        losses.append(float(total) / dist.get_world_size())
        progress.step(args.batch_size)
        progress.show(loss=losses[-1])
        if step % args.checkpoint_every == 0 or step == args.steps:
            path = args.checkpoint_dir / f"step_{step}"
            fdp.save_checkpoint(path, {**trainer.checkpoint(), "step": step})
            common.log(f"checkpoint written: {path}")
    return losses, peak


def _into(out: list[torch.Tensor], step: Callable[[torch.Tensor], torch.Tensor], ids: Any) -> None:
    out.append(step(ids))


def summary(
    args: argparse.Namespace,
    losses: list[float],
    entropy: float,
    peak: float,
    torch_peak: float | None,
) -> int:
    """Prints one JSON line; 0 if the loss is below its threshold.

    - ``final_loss``: the mean over ranks and the last 10 steps of the
      training loss (nats per token; fresh batches every step).
    - ``loss_threshold``: the chain's entropy (the best any model can do)
      plus 0.5 nats (``--loss-threshold``); the run exits 1 above it.
    - ``peak_mib``: each rank's peak in its third and fourth steps: the
      bytes of what it keeps between steps (parameters or shards, optimizer
      state, buffers), plus how far glibc's bytes in use rise during the
      step (a thread polls them); ``torch_fully_shard_peak_mib``: the same
      for torch's ``fully_shard`` on the same model (``--compare-torch``).
    """
    final = sum(losses[-10:]) / max(len(losses[-10:]), 1) if losses else float("nan")
    threshold = args.loss_threshold if args.loss_threshold is not None else entropy + 0.5
    device = args.device  # nccl gathers device tensors
    peaks = [torch.zeros(1, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(peaks, torch.tensor([peak], device=device))
    report: dict[str, Any] = {
        "final_loss": round(final, 4),
        "loss_threshold": round(threshold, 4),
        "peak_mib": [round(float(p), 2) for p in peaks],
        "mode": "fsdp" if args.fsdp else "ddp",
        "steps": args.steps,
    }
    if torch_peak is not None:
        theirs = [torch.zeros(1, device=device) for _ in range(dist.get_world_size())]
        dist.all_gather(theirs, torch.tensor([torch_peak], device=device))
        report["torch_fully_shard_peak_mib"] = [round(float(p), 2) for p in theirs]
    common.log(f"final loss {final:.4f} (the chain's entropy {entropy:.4f}; must be below "
               f"{threshold:.4f})")  # fmt: skip
    common.log(json.dumps(report))
    return 0 if final < threshold else 1


if __name__ == "__main__":
    sys.exit(main())
