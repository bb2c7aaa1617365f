"""Train a small transformer language model fully sharded (fdp.FullyShardedDataParallel).

An 8-block, pre-norm, causal transformer over characters, written as a pure
function of its parameter tree, on text the example generates (sentences
of a small grammar, so there is something to learn). Launched with
torchrun: every rank keeps only its shards of the parameters, gradients and
AdamW state; each block is gathered in bfloat16 just for its own forward
(``fsdp.apply``), freed, and gathered again by backward; gradients are
reduce-scattered in float32 and clipped by their global norm. Every
``--checkpoint-every`` steps the shards, the AdamW state and the step are
saved (``fdp.save_checkpoint``); ``--resume`` continues from the newest
complete checkpoint, on any number of ranks. The last line printed is one
JSON object, described where it is printed (``summary``).

    torchrun --standalone --nproc_per_node=2 examples/train_lm_fsdp.py --plot
    torchrun --standalone --nproc_per_node=2 examples/train_lm_fsdp.py --resume --steps 300
    torchrun --standalone --nproc_per_node=2 --max-restarts=3 examples/train_lm_fsdp.py --resume
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import sys
import time
from typing import Any

import common
import optree
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fdp

WORDS = {
    "subject": ["the cat", "a dog", "my friend", "the old man", "a bird", "the child"],
    "verb": ["sees", "likes", "finds", "follows", "hears", "draws"],
    "object": ["the moon", "a red ball", "the river", "an apple", "the small house"],
    "end": [".", " today.", " again.", " at night."],
}


def make_text(sentences: int, seed: int) -> str:
    g = torch.Generator().manual_seed(seed)

    def pick(kind: str) -> str:
        options = WORDS[kind]
        return options[int(torch.randint(len(options), (1,), generator=g))]

    return " ".join(
        f"{pick('subject')} {pick('verb')} {pick('object')}{pick('end')}" for _ in range(sentences)
    )


def init_params(vocab: int, dim: int, blocks: int, context: int, seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) / math.sqrt(shape[0])

    def block() -> dict[str, torch.Tensor]:
        return {
            "norm1": torch.ones(dim),
            "qkv": w(dim, 3 * dim),
            "proj": w(dim, dim) / math.sqrt(2 * blocks),
            "norm2": torch.ones(dim),
            "up": w(dim, 4 * dim),
            "down": w(4 * dim, dim) / math.sqrt(2 * blocks),
        }

    return {
        "embed": {"tokens": w(vocab, dim) * math.sqrt(vocab), "positions": w(context, dim) * 0.1},
        "blocks": [block() for _ in range(blocks)],
        "head": {"norm": torch.ones(dim), "out": w(dim, vocab)},
    }


def attention_block(p: dict[str, torch.Tensor], h: torch.Tensor, heads: int) -> torch.Tensor:
    batch, time, dim = h.shape
    x = F.rms_norm(h, (dim,), p["norm1"])
    q, k, v = torch.split(x @ p["qkv"], dim, dim=-1)
    q, k, v = (t.view(batch, time, heads, dim // heads).transpose(1, 2) for t in (q, k, v))
    att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    h = h + att.transpose(1, 2).reshape(batch, time, dim) @ p["proj"]
    x = F.rms_norm(h, (dim,), p["norm2"])
    return h + F.gelu(x @ p["up"]) @ p["down"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = common.parser(__doc__, "lm_fsdp")
    parser.add_argument("--steps", type=int, default=150, help="train until this step")
    parser.add_argument(
        "--batch-size", type=int, default=32, help="global batch of sequences, split over ranks"
    )
    parser.add_argument("--context", type=int, default=48, help="sequence length, characters")
    parser.add_argument("--dim", type=int, default=64, help="model width")
    parser.add_argument("--blocks", type=int, default=8, help="transformer blocks")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    parser.add_argument(
        "--optimizer", choices=("adamw", "muon"), default="adamw",
        help="muon: Muon on the blocks' matrices (each on one owner rank), AdamW elsewhere",
    )  # fmt: skip
    parser.add_argument("--muon-lr", type=float, default=0.02, help="Muon's learning rate")
    parser.add_argument("--max-norm", type=float, default=1.0, help="gradient clipping norm")
    parser.add_argument("--seed", type=int, default=0, help="text, initialisation, batches")
    common.add_checkpoint_args(parser, "lm_fsdp", every=50)
    parser.add_argument(
        "--loss-threshold", type=float, default=None,
        help="exit 1 unless the final loss is below this (None: half of log(vocab))",
    )  # fmt: skip
    common.add_launch_args(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = common.launch(args, __file__)
    try:
        return train(args, device)
    finally:
        dist.destroy_process_group()


def train(args: argparse.Namespace, device: torch.device) -> int:
    world = dist.get_world_size()
    text = make_text(4000, args.seed)
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], device=device)
    params = init_params(len(chars), args.dim, args.blocks, args.context, args.seed)
    params = optree.tree_map(lambda t: t.to(device), params)  # type: ignore[arg-type,assignment]
    fsdp = fdp.FullyShardedDataParallel(
        params, param_dtype=torch.bfloat16, reduce_dtype=torch.float32
    )
    opt = fsdp.optimizer(make_optimizer(args))
    shards = fsdp.shard(params)
    total_bytes = sum(t.numel() * t.element_size() for t in _leaves(params))
    del params  # each rank keeps its shards only
    state: dict[str, Any] = {"shards": shards, "opt": opt.init(shards), "step": 0}
    found = common.resume_from(args)
    if found is not None:
        like = {"shards": fsdp.to_checkpoint(shards), "opt": fsdp.to_checkpoint(state["opt"])}
        loaded = fdp.load_checkpoint(found, {**like, "step": 0})
        state = {
            "shards": fsdp.from_checkpoint(loaded["shards"]),
            "opt": fsdp.from_checkpoint(loaded["opt"]),
            "step": loaded["step"],
        }
    common.log(
        f"lm: {world} ranks ({dist.get_backend()}, {device}), {len(fsdp.units)} units, "
        f"{total_bytes / 1e3:.0f} kB of parameters, vocab {len(chars)}; step {state['step']}"
    )
    first, began = state["step"] + 1, time.perf_counter()
    losses = run(args, fsdp, opt, state, data)
    elapsed = time.perf_counter() - began
    common.log(f"trained {len(losses)} steps in {elapsed:.1f} s")
    if args.plot and dist.get_rank() == 0 and losses:
        title = f"character LM, fdp.FullyShardedDataParallel, {world} ranks"
        common.save_plot(losses, args.plot, title=title, xlabel="step", first=first)
    return summary(args, state, losses, total_bytes, len(chars))


def make_optimizer(args: argparse.Namespace) -> Any:
    """AdamW; or Muon on the blocks' weight matrices and AdamW on the embeddings, the head
    and the norms, as the Muon papers train a transformer (``fsdp.optimizer`` steps each
    matrix whole on one rank)."""
    adamw = fdp.optim.adamw(args.lr, weight_decay=0.01)
    if args.optimizer == "adamw":
        return adamw
    matrices = lambda name, t: "muon" if name.startswith("blocks") and t.ndim >= 2 else "adamw"  # noqa: E731
    return fdp.optim.param_groups(
        matrices, {"muon": fdp.optim.muon(args.muon_lr, weight_decay=0.01), "adamw": adamw}
    )


def summary(
    args: argparse.Namespace, state: dict[str, Any], losses: list[float], total: int, vocab: int
) -> int:
    """Prints the run's figures as one JSON line (rank 0); 0 if the loss beat the threshold.

    - ``final_loss``: the mean over ranks and over the last 10 steps of the
      training loss (nats per character; the batches are fresh text, so it
      also estimates the loss on unseen text). A model that has learnt
      nothing scores about ``log(vocab)``; the run passes below
      ``loss_threshold`` (``--loss-threshold``, default half of that).
    - ``param_bytes_per_rank`` / ``param_bytes_total``: rank 0's parameter
      shards against the whole float32 model (about 1/world of it).
    - ``peak_rss_bytes_rank0``: rank 0's peak resident set size
      (``ru_maxrss``): the whole process, the torch runtime and the data
      included, so it says little about sharding; docs/fsdp.md compares
      allocator-level peaks with DDP and torch's ``fully_shard``.
    """
    final = sum(losses[-10:]) / len(losses[-10:]) if losses else float("nan")
    threshold = args.loss_threshold or 0.5 * math.log(vocab)
    shard_bytes = sum(t.numel() * t.element_size() for ts in state["shards"].values() for t in ts)
    report = {
        "final_loss": round(final, 4),
        "loss_threshold": round(threshold, 4),
        "param_bytes_per_rank": shard_bytes,
        "param_bytes_total": total,
        "peak_rss_bytes_rank0": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "world_size": dist.get_world_size(),
        "optimizer": args.optimizer,
        "steps": state["step"],
    }
    common.log(
        f"final loss {final:.4f}: the last 10 steps' mean training loss, nats per character "
        f"(chance: log(vocab) = {math.log(vocab):.2f}; must be below {threshold:.2f})"
    )
    common.log(json.dumps(report))
    return 0 if final < threshold else 1


def run(
    args: argparse.Namespace,
    fsdp: fdp.FullyShardedDataParallel,
    opt: Any,
    state: dict[str, Any],
    data: torch.Tensor,
) -> list[float]:
    """Trains from ``state["step"]`` to ``--steps``; returns each step's loss (mean over ranks)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = args.batch_size // world
    losses: list[float] = []
    progress = common.Progress(range(state["step"], args.steps), unit="step")
    for _ in progress:
        g = torch.Generator().manual_seed(args.seed * 100_003 + state["step"])
        starts = torch.randint(len(data) - args.context - 1, (args.batch_size,), generator=g)
        mine = starts[rank * per_rank : (rank + 1) * per_rank]
        x = torch.stack([data[s : s + args.context] for s in mine])
        y = torch.stack([data[s + 1 : s + args.context + 1] for s in mine])
        shards = {
            k: tuple(t.detach().requires_grad_() for t in ts) for k, ts in state["shards"].items()
        }
        loss = lm_loss(fsdp, shards, x, y, args.heads)
        torch.autograd.backward(loss)
        grads, _norm = fsdp.clip_grad_norm(
            {k: tuple(t.grad for t in ts) for k, ts in shards.items()}, args.max_norm
        )
        plain = {k: tuple(t.detach() for t in ts) for k, ts in shards.items()}
        state["shards"], state["opt"] = opt.update(grads, state["opt"], plain)
        state["step"] += 1
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
        progress.step(per_rank * world)
        progress.show(loss=losses[-1])
        if state["step"] % args.checkpoint_every == 0 or state["step"] == args.steps:
            save(args, fsdp, state)
    return losses


def lm_loss(
    fsdp: fdp.FullyShardedDataParallel, shards: Any, x: torch.Tensor, y: torch.Tensor, heads: int
) -> torch.Tensor:
    """Next-character cross-entropy; each unit gathered only for its own function."""

    def embed(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return p["tokens"][x] + p["positions"][: x.shape[1]]

    def head(p: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        logits = F.rms_norm(h, (h.shape[-1],), p["norm"]) @ p["out"]
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    h = fsdp.apply(shards, "embed", embed, x)
    for name in fsdp.unit_names:
        if name.startswith("blocks."):
            h = fsdp.apply(shards, name, attention_block, h, heads)
    loss: torch.Tensor = fsdp.apply(shards, "head", head, h)
    return loss


def save(
    args: argparse.Namespace, fsdp: fdp.FullyShardedDataParallel, state: dict[str, Any]
) -> None:
    checkpoint = {
        "shards": fsdp.to_checkpoint(state["shards"]),
        "opt": fsdp.to_checkpoint(state["opt"]),
        "step": state["step"],
    }
    path = args.checkpoint_dir / f"step_{state['step']}"
    fdp.save_checkpoint(path, checkpoint)
    common.log(f"checkpoint written: {path}")


def _leaves(tree: Any) -> list[torch.Tensor]:
    return [t for t in optree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


if __name__ == "__main__":
    sys.exit(main())
