"""Hugging Face models through every fdp tool, against torch's own tools and one process.

Tiny random configs of GPT-2 (tied input and output embeddings), BERT,
Llama, T5 (one embedding under several names) and a ResNet (BatchNorm),
built identically on every rank from one seed, with dropout off so the
references are exact. Each is run through ``fdp.make_functional`` and:

- ``fdp.data_parallel`` on two CPU replicas, against one process calling
  the module on each half (a BatchNorm normalises each replica's half);
- ``fdp.DistributedDataParallel`` on 2 ranks, against torch's
  ``DistributedDataParallel`` on the same rank and one process averaging
  the ranks' losses: gradients and buffers (and with Hugging Face's
  gradient checkpointing, reentrant or not);
- ``fdp.ZeroRedundancy`` (AdamW), against torch's
  ``ZeroRedundancyOptimizer`` and one process: parameters after a step;
- ``fdp.FullyShardedDataParallel`` with its default units (one per block of
  the model's ``ModuleList``s), against torch's ``fully_shard`` on each
  block and one process: gradients, and each rank's buffers.

transformers is a test-only dependency (the ``test`` group).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

import fdp
from tests import ranks

with warnings.catch_warnings():  # both imports warn (optional packages; TorchScript)
    warnings.simplefilter("ignore")
    transformers = pytest.importorskip(
        "transformers", reason="transformers (the test group) is not installed"
    )
    from torch.distributed.optim import ZeroRedundancyOptimizer

PER = 2  # examples per rank or replica
TOL: dict[str, Any] = {"rtol": 1e-4, "atol": 1e-5}
MODELS = ["gpt2", "bert", "llama", "t5", "resnet"]
# The ModuleList blocks of each model: fdp's default units and torch's fully_shard calls.
BLOCKS = {
    "gpt2": ["transformer.h.0", "transformer.h.1"],
    "bert": ["bert.encoder.layer.0", "bert.encoder.layer.1"],
    "llama": ["model.layers.0", "model.layers.1"],
    "t5": ["decoder.block.0", "decoder.block.1", "encoder.block.0", "encoder.block.1"],
    "resnet": ["resnet.encoder.stages.0", "resnet.encoder.stages.1"],
}


def build(name: str) -> nn.Module:
    """The model, the same on every rank and process (one seed, no dropout)."""
    torch.manual_seed(0)
    t: Any = transformers  # configs take their options as **kwargs
    tiny: dict[str, Any] = {"vocab_size": 64, "bos_token_id": 0, "eos_token_id": 1}
    model: nn.Module
    if name == "gpt2":
        config: Any = t.GPT2Config(n_layer=2, n_embd=16, n_head=2, n_positions=16,
                                   use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0,
                                   attn_pdrop=0.0, **tiny)  # fmt: skip
        model = t.GPT2LMHeadModel(config)
    elif name == "bert":
        config = t.BertConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                              intermediate_size=32, max_position_embeddings=16, num_labels=3,
                              hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                              vocab_size=64)  # fmt: skip
        model = t.BertForSequenceClassification(config)
    elif name == "llama":
        config = t.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                               num_attention_heads=2, num_key_value_heads=1, use_cache=False,
                               max_position_embeddings=16, **tiny)  # fmt: skip
        model = t.LlamaForCausalLM(config)
    elif name == "t5":
        config = t.T5Config(d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2,
                            num_heads=2, dropout_rate=0.0, decoder_start_token_id=0,
                            pad_token_id=0, use_cache=False, **tiny)  # fmt: skip
        model = t.T5ForConditionalGeneration(config)
    else:
        config = t.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16],
                                depths=[1, 1], layer_type="basic", num_labels=3)  # fmt: skip
        model = t.ResNetForImageClassification(config)
    out: nn.Module = model.train()
    return out


def inputs(name: str, part: int) -> dict[str, torch.Tensor]:
    """The keyword inputs (labels included) of batch part ``part`` (a rank or a replica)."""
    g = torch.Generator().manual_seed(100 + part)
    if name == "resnet":
        pixels = torch.randn(PER, 3, 16, 16, generator=g) * (1 + part)
        return {"pixel_values": pixels, "labels": torch.randint(0, 3, (PER,), generator=g)}
    ids = torch.randint(2, 64, (PER, 8), generator=g)
    if name == "bert":
        return {"input_ids": ids, "labels": torch.randint(0, 3, (PER,), generator=g)}
    if name == "t5":
        return {"input_ids": ids, "labels": torch.randint(2, 64, (PER, 5), generator=g)}
    return {"input_ids": ids, "labels": ids}


def whole(name: str, parts: int) -> dict[str, torch.Tensor]:
    """Parts ``0..parts-1`` as one batch."""
    each = [inputs(name, p) for p in range(parts)]
    return {k: torch.cat([e[k] for e in each]) for k in each[0]}


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())


def buffers_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_buffers()}


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def reference(name: str, size: int) -> tuple[nn.Module, list[nn.Module]]:
    """One process: the mean of the ranks' losses; and each rank's copy, for its buffers."""
    model = build(name)
    own = [build(name) for _ in range(size)]
    losses = [model(**inputs(name, r)).loss for r in range(size)]
    torch.autograd.backward(torch.stack(losses).mean())
    for r, m in enumerate(own):
        with torch.no_grad():
            m(**inputs(name, r))  # BatchNorm statistics from this rank's batch alone
    return model, own


def check(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == expected.keys(), what
    for k, v in expected.items():
        torch.testing.assert_close(got[k], v, **TOL, msg=f"{what}: {k}")


# --------------------------------------------------------------- data_parallel


@pytest.mark.parametrize("name", MODELS)
def test_data_parallel_matches_one_process_on_each_half(name: str) -> None:
    model = build(name)
    fn, state = fdp.make_functional(model)
    with pytest.warns(UserWarning, match="some outputs are scalars"):  # DataParallel's too
        out = fdp.data_parallel(fn, state, (), devices=["cpu", "cpu"], kwargs=whole(name, 2))
    torch.autograd.backward(out.loss.mean())  # one loss per replica
    got, got_buffers = grads_of(model), buffers_of(model)
    ref = build(name)
    halves = [ref(**inputs(name, r)) for r in range(2)]
    first = build(name)
    with torch.no_grad():
        first(**inputs(name, 0))  # replica 0's in-place updates are kept, once
    torch.autograd.backward(torch.stack([h.loss for h in halves]).mean())
    torch.testing.assert_close(out.logits, torch.cat([h.logits for h in halves]), **TOL)
    check(got, grads_of(ref), f"{name} gradients")
    check(got_buffers, buffers_of(first), f"{name} buffers")


# --------------------------------------------------------------- DDP


def _ddp(rank: int, size: int, name: str) -> Any:
    model, torch_model = build(name), build(name)
    fn, state = fdp.make_functional(model)
    ddp = fdp.DistributedDataParallel(state)
    torch.autograd.backward(fn(ddp(state), **inputs(name, rank)).loss)
    torch_ddp = torch.nn.parallel.DistributedDataParallel(torch_model)
    torch.autograd.backward(torch_ddp(**inputs(name, rank)).loss)
    return grads_of(model), buffers_of(model), grads_of(torch_model), buffers_of(torch_model)


@pytest.mark.parametrize("name", MODELS)
def test_ddp_matches_torch_ddp_and_one_process(name: str) -> None:
    ref, own = reference(name, 2)
    for rank, (grads, buffers, torch_grads, torch_buffers) in enumerate(
        ranks.world(2).run(_ddp, name)
    ):
        check(grads, torch_grads, f"{name} rank {rank}: fdp against torch's DDP")
        check(grads, grads_of(ref), f"{name} rank {rank}: fdp against one process")
        # Buffers: rank 0's broadcast before the forward, then this rank's update.
        check(buffers, torch_buffers, f"{name} rank {rank}: buffers against torch's DDP")
        check(buffers, buffers_of(own[rank]), f"{name} rank {rank}: buffers")


def _ddp_checkpointed(rank: int, size: int, name: str, reentrant: bool, how: str) -> Any:
    """fdp DDP over the model with Hugging Face's gradient checkpointing, and torch's DDP."""
    model, torch_model = build(name), build(name)
    for m in (model, torch_model):
        m.gradient_checkpointing_enable(  # type: ignore[operator]
            gradient_checkpointing_kwargs={"use_reentrant": reentrant}
        )
    fn, state = fdp.make_functional(model)
    ddp = fdp.DistributedDataParallel(state)
    if how == "backward":
        torch.autograd.backward(fn(ddp(state), **inputs(name, rank)).loss)
        got = grads_of(model)
    else:
        params = {k: v.detach() for k, v in state.items() if v.requires_grad}
        buffers = {k: v for k, v in state.items() if not v.requires_grad}
        got = fdp.grad(lambda p: fn(ddp({**p, **buffers}), **inputs(name, rank)).loss)(params)
    torch_ddp = torch.nn.parallel.DistributedDataParallel(torch_model)
    torch.autograd.backward(torch_ddp(**inputs(name, rank)).loss)
    return got, grads_of(torch_model)


@pytest.mark.parametrize(
    ("reentrant", "how"), [(False, "backward"), (False, "fdp.grad"), (True, "backward")]
)
def test_ddp_with_gradient_checkpointing_matches_torch_ddp_and_one_process(
    reentrant: bool, how: str
) -> None:
    # model.gradient_checkpointing_enable(): each block is recomputed in backward, on the
    # call's shells (non-reentrant) or in a nested backward (reentrant), and its
    # gradients reach the reduction from there. Reentrant checkpointing refuses
    # autograd.grad (fdp.grad's) in torch itself.
    name = "gpt2"
    ref, _ = reference(name, 2)
    for rank, (grads, torch_grads) in enumerate(
        ranks.world(2).run(_ddp_checkpointed, name, reentrant, how)
    ):
        check(grads, torch_grads, f"rank {rank}: fdp against torch's DDP")
        check(grads, grads_of(ref), f"rank {rank}: fdp against one process")


# --------------------------------------------------------------- ZeRO


ZERO_STEPS = 3
# SGD's step is proportional to the gradient: a ZeRO that summed instead of
# averaging fails here. AdamW's barely depends on the gradient's scale, so
# it checks the state carried across steps instead.
OPTIMIZERS: dict[str, tuple[Callable[[], Any], type, dict[str, Any]]] = {
    "sgd": (
        lambda: fdp.optim.sgd(0.5, momentum=0.9, weight_decay=0.1),
        torch.optim.SGD,
        {"lr": 0.5, "momentum": 0.9, "weight_decay": 0.1},
    ),
    "adamw": (
        lambda: fdp.optim.adamw(1e-2, weight_decay=0.1),
        torch.optim.AdamW,
        {"lr": 1e-2, "weight_decay": 0.1},
    ),
}


def _zero_steps(rank: int, size: int, name: str, opt: str) -> Any:
    make, torch_class, options = OPTIMIZERS[opt]
    model, torch_model = build(name), build(name)
    fn, state = fdp.make_functional(model)
    params = {k: v.detach().requires_grad_() for k, v in state.items() if v.requires_grad}
    buffers = {k: v for k, v in state.items() if not v.requires_grad}
    zero = fdp.ZeroRedundancy(make(), params)
    opt_state = zero.init(params)
    torch_ddp = torch.nn.parallel.DistributedDataParallel(torch_model)
    torch_opt = ZeroRedundancyOptimizer(
        torch_model.parameters(), optimizer_class=torch_class, **options
    )
    for step in range(ZERO_STEPS):
        part = rank + size * step
        loss = fn({**params, **buffers}, **inputs(name, part)).loss
        grads = dict(zip(params, torch.autograd.grad(loss, list(params.values())), strict=True))
        new, opt_state = zero.step(grads, opt_state, params)
        params = {k: v.detach().requires_grad_() for k, v in new.items()}
        torch.autograd.backward(torch_ddp(**inputs(name, part)).loss)
        torch_opt.step()
        torch_opt.zero_grad()
    stepped = {k: v.detach() for k, v in params.items()}
    return stepped, {k: v.detach() for k, v in torch_model.named_parameters()}


def _zero_reference(name: str, opt: str, size: int) -> dict[str, torch.Tensor]:
    """One process: each step on the mean of the ranks' losses."""
    _, torch_class, options = OPTIMIZERS[opt]
    model = build(name)
    torch_opt = torch_class(model.parameters(), **options)
    for step in range(ZERO_STEPS):
        losses = [model(**inputs(name, r + size * step)).loss for r in range(size)]
        torch.autograd.backward(torch.stack(losses).mean())
        torch_opt.step()
        torch_opt.zero_grad()
    return {k: v.detach() for k, v in model.named_parameters()}


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize("name", MODELS)
def test_zero_matches_torch_zero_and_one_process(name: str, opt: str) -> None:
    expected = _zero_reference(name, opt, 2)
    for rank, (got, torch_got) in enumerate(ranks.world(2).run(_zero_steps, name, opt)):
        check(got, torch_got, f"{name} rank {rank}: fdp ZeRO against torch's")
        check(got, expected, f"{name} rank {rank}: fdp ZeRO against one process")


# --------------------------------------------------------------- FSDP


def _full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """torch's fully_shard gradients (DTensors) as whole tensors."""
    out = {}
    for k, p in model.named_parameters():
        if p.grad is not None:
            g: Any = p.grad
            out[k] = g.full_tensor() if hasattr(g, "full_tensor") else g
    return out


def _fsdp(rank: int, size: int, name: str) -> Any:
    model, torch_model = build(name), build(name)
    fn, state = fdp.make_functional(model)
    fsdp = fdp.FullyShardedDataParallel(state)
    shards = fsdp.shard(state)
    torch.autograd.backward(fn(fsdp(shards), **inputs(name, rank)).loss)
    zero: Callable[[torch.Tensor], torch.Tensor] = torch.zeros_like
    grads = fsdp.full({u: tuple(zero(t) if t.grad is None else t.grad for t in ts)
                       for u, ts in shards.items()})  # fmt: skip
    trained = {k: grads[k] for k, v in state.items() if v.requires_grad}
    for block in BLOCKS[name]:
        fully_shard(torch_model.get_submodule(block))
    fully_shard(torch_model)
    torch.autograd.backward(torch_model(**inputs(name, rank)).loss)
    return fsdp.unit_names, trained, buffers_of(model), _full_grads(torch_model)


@pytest.mark.parametrize("name", MODELS)
def test_fsdp_with_default_units_matches_fully_shard_and_one_process(name: str) -> None:
    ref, own = reference(name, 2)
    for rank, (units, grads, buffers, torch_grads) in enumerate(ranks.world(2).run(_fsdp, name)):
        assert set(BLOCKS[name]) <= set(units), units
        check(grads, torch_grads, f"{name} rank {rank}: fdp against torch's fully_shard")
        check(grads, grads_of(ref), f"{name} rank {rank}: fdp against one process")
        check(buffers, buffers_of(own[rank]), f"{name} rank {rank}: buffers (each rank's own)")


# --------------------------------------------------------------- docs/models.md's promises
# Each claim of "What carries over" and "What is refused", on GPT-2.


def _gpt2(**options: Any) -> nn.Module:
    """GPT-2 as ``build`` makes it (dropout off unless ``options`` say), with ``options``."""
    torch.manual_seed(0)
    t: Any = transformers
    options = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, **options}
    config = t.GPT2Config(n_layer=2, n_embd=16, n_head=2, n_positions=16, vocab_size=64,
                          bos_token_id=0, eos_token_id=1, **options)  # fmt: skip
    model: nn.Module = t.GPT2LMHeadModel(config)
    return model


def test_eval_and_train_take_effect_on_the_next_call_and_under_data_parallel() -> None:
    model = _gpt2(use_cache=False, resid_pdrop=0.5, embd_pdrop=0.5, attn_pdrop=0.5)
    fn, state = fdp.make_functional(model)
    ids = whole("gpt2", 2)["input_ids"]
    model.eval()  # after make_functional: read at each call
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        torch.testing.assert_close(fn(state, input_ids=ids).logits, expected, rtol=0, atol=0)
        out = fdp.data_parallel(fn, state, (), devices=["cpu", "cpu"], kwargs={"input_ids": ids})
        torch.testing.assert_close(out.logits, expected, **TOL)
        model.train()  # dropout again: the same draws as the module's own call
        torch.manual_seed(1)
        trained = fn(state, input_ids=ids).logits
        torch.manual_seed(1)
        torch.testing.assert_close(trained, model(input_ids=ids).logits, rtol=0, atol=0)
    assert not torch.allclose(trained, expected)


def _frozen(rank: int, size: int) -> Any:
    got: list[Any] = []
    for tool in ("ddp", "fsdp"):
        model = _gpt2(use_cache=False)
        model.get_parameter("transformer.wpe.weight").requires_grad_(False)  # frozen
        fn, state = fdp.make_functional(model)
        if tool == "ddp":
            ddp = fdp.DistributedDataParallel(state)
            torch.autograd.backward(fn(ddp(state), **inputs("gpt2", rank)).loss)
            got.append(grads_of(model))
            continue
        fsdp = fdp.FullyShardedDataParallel(state)
        shards = fsdp.shard(state)
        torch.autograd.backward(fn(fsdp(shards), **inputs("gpt2", rank)).loss)
        one: Callable[[torch.Tensor], torch.Tensor] = torch.ones_like
        zero: Callable[[torch.Tensor], torch.Tensor] = torch.zeros_like
        full = fsdp.full({u: tuple(zero(t) if t.grad is None else t.grad for t in ts)
                          for u, ts in shards.items()})  # fmt: skip
        none = fsdp.full({u: tuple(one(t) if t.grad is None else zero(t) for t in ts)
                          for u, ts in shards.items()})  # fmt: skip
        without = {k for k, v in none.items() if v.numel() and bool(v.all())}
        got.append(({k: v for k, v in full.items() if state[k].requires_grad}, without))
    return got


def test_frozen_parameters_get_no_gradient_under_ddp_and_fsdp() -> None:
    ref = _gpt2(use_cache=False)
    ref.get_parameter("transformer.wpe.weight").requires_grad_(False)
    losses = [ref(**inputs("gpt2", r)).loss for r in range(2)]
    torch.autograd.backward(torch.stack(losses).mean())
    expected = grads_of(ref)
    assert "transformer.wpe.weight" not in expected
    for rank, (ddp_grads, (fsdp_grads, without)) in enumerate(ranks.world(2).run(_frozen)):
        check(ddp_grads, expected, f"rank {rank}: DDP with a frozen parameter")
        check(fsdp_grads, expected, f"rank {rank}: FSDP with a frozen parameter")
        frozen = {k for k, v in ref.state_dict().items() if k not in expected}
        assert without == frozen - {"lm_head.weight"}, without  # shards without a .grad


def test_two_tensors_for_one_tied_tensor_are_refused_by_name() -> None:
    fn, state = fdp.make_functional(build("gpt2"))
    assert "lm_head.weight" not in state  # tied to the input embedding: listed once
    untied = {**state, "lm_head.weight": state["transformer.wte.weight"].detach().clone()}
    with pytest.raises(ValueError, match=r"'transformer\.wte\.weight' and 'lm_head\.weight'"):
        fn(untied, **inputs("gpt2", 0))


def test_a_kv_cache_output_is_refused_by_name_under_data_parallel() -> None:
    model = _gpt2(use_cache=True)
    fn, state = fdp.make_functional(model)
    ids = whole("gpt2", 2)["input_ids"]
    with pytest.raises(ValueError, match=r"non-tensor leaf output\[1\] differs between replicas"):
        fdp.data_parallel(fn, state, (), devices=["cpu", "cpu"], kwargs={"input_ids": ids})
    # use_cache=False, as the page says for training: the one-process logits.
    out = fdp.data_parallel(
        fn, state, (), devices=["cpu", "cpu"], kwargs={"input_ids": ids, "use_cache": False}
    )
    torch.testing.assert_close(out.logits, model(input_ids=ids, use_cache=False).logits, **TOL)
