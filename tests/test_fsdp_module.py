"""``fsdp.wrap(fn)``: a make_functional model fully sharded, each unit gathered per block.

Every case runs on 2 gloo ranks and compares with one process: the mean of
the ranks' losses, differentiated on the unsharded model (``reference``),
for gradients (and, without checkpointing, with torch's ``fully_shard`` on
each block and the root); and each block's gather is checked to happen inside its
forward, with the unit's memory freed after it (between forward and
backward a rank holds its shards only). Hugging Face models from
``tests/test_models.py``: GPT-2's tied ``wte``/``lm_head`` (one unit used in
two places), T5's embedding under three names, activation checkpointing
(reentrant and not), evaluation under ``no_grad``, ``no_sync`` and bf16.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

import fdp
from fdp._sharding import _fsdp_unit
from tests import ranks
from tests.test_models import BLOCKS, _full_grads, build, check, grads_of, inputs, reference

MODELS = ["gpt2", "bert", "llama", "t5", "resnet"]


def _grads(fsdp: Any, shards: Any, state: Any) -> dict[str, torch.Tensor]:
    """The shards' gradients as the unsharded model's, for its trained parameters."""
    full = fsdp.full({u: tuple(torch.zeros_like(t) if t.grad is None else t.grad for t in ts)
                      for u, ts in shards.items()})  # fmt: skip
    return {k: full[k] for k, v in state.items() if v.requires_grad}


def _wrapped(rank: int, size: int, name: str, checkpointing: str | None) -> Any:
    model = build(name)
    if checkpointing is not None:
        reentrant = checkpointing == "reentrant"
        # transformers 5.24 renamed it (the old name warns); 5.20 (Python 3.10) has only the old.
        enable: Any = getattr(model, "activation_checkpointing_enable", None)
        enable = enable or model.gradient_checkpointing_enable
        enable({"use_reentrant": reentrant})
    fn, state = fdp.make_functional(model)
    fsdp = fdp.FullyShardedDataParallel(state)
    shards = fsdp.shard(state)
    run = fsdp.wrap(fn)
    phases = []

    def during(module: nn.Module, args: Any, out: Any) -> None:
        phases.append(fsdp._states[BLOCKS[name][0]].phase)  # the block's unit, inside it

    handle = model.get_submodule(BLOCKS[name][0]).register_forward_hook(during)
    loss = run(shards, **inputs(name, rank)).loss
    handle.remove()
    between = fsdp._states[BLOCKS[name][0]].phase
    loss.backward()
    emptied = all(p.numel() == 0 for p in model.parameters())
    theirs: dict[str, torch.Tensor] = {}
    if checkpointing is None:  # torch's fully_shard on each block, then the root
        torch_model = build(name)
        for block in BLOCKS[name]:
            fully_shard(torch_model.get_submodule(block))
        fully_shard(torch_model)
        torch.autograd.backward(torch_model(**inputs(name, rank)).loss)
        theirs = _full_grads(torch_model)
    return _grads(fsdp, shards, state), between, emptied, float(loss.detach()), theirs


@pytest.mark.parametrize("name", MODELS)
def test_each_block_gathered_in_its_forward_matches_one_process(name: str) -> None:
    ref, _ = reference(name, 2)
    losses = [float(ref(**inputs(name, r)).loss.detach()) for r in range(2)]
    for rank, (grads, between, emptied, loss, theirs) in enumerate(
        ranks.world(2).run(_wrapped, name, None)
    ):
        check(grads, grads_of(ref), f"{name} rank {rank}: gradients against one process")
        check(grads, theirs, f"{name} rank {rank}: gradients against torch's fully_shard")
        assert between == _fsdp_unit.Phase.RESHARDED, (name, between)
        assert emptied, "the module's own parameters are released"
        assert loss == pytest.approx(losses[rank], rel=1e-5)


CHECKPOINTED = [("gpt2", "reentrant"), ("gpt2", "non-reentrant"), ("llama", "reentrant"),
                ("t5", "non-reentrant")]  # fmt: skip


@pytest.mark.parametrize(("name", "how"), CHECKPOINTED)
def test_activation_checkpointing_regathers_in_the_recompute(name: str, how: str) -> None:
    ref, _ = reference(name, 2)
    for rank, (grads, between, *_) in enumerate(ranks.world(2).run(_wrapped, name, how)):
        check(grads, grads_of(ref), f"{name} {how} rank {rank}")
        # Nothing held between forward and backward. transformers 5.20 (Python
        # 3.10) runs a reentrant checkpoint's first forward under no_grad, where
        # wrap frees the gathered buffers entirely: SHARDED, not RESHARDED.
        held_nothing = {_fsdp_unit.Phase.RESHARDED, _fsdp_unit.Phase.SHARDED}
        assert between in held_nothing, (name, how, between)


def _eval_and_module(rank: int, size: int) -> Any:
    model = build("gpt2")
    expected = model.eval()(**inputs("gpt2", rank)).logits.detach()
    fn, state = fdp.make_functional(model)
    fsdp = fdp.FullyShardedDataParallel(state)
    shards = fsdp.shard(state)
    run = fsdp.wrap(fn)
    with torch.no_grad():
        logits = run(shards, **inputs("gpt2", rank)).logits
    errors = []
    for attempt in (lambda: model(**inputs("gpt2", rank)), lambda: fsdp.shard(state)):
        try:
            attempt()
        except (RuntimeError, ValueError) as e:
            errors.append(str(e))
    fsdp.restore(shards)
    restored = model(**inputs("gpt2", rank)).logits.detach()
    fsdp.wrap(fn)  # released again
    released = all(p.numel() == 0 for p in model.parameters())
    model.load_state_dict(fsdp.full(shards), strict=False)  # full storage, then the values
    loaded = model(**inputs("gpt2", rank)).logits.detach()
    return expected, logits, errors, restored, loaded, released


def test_eval_no_grad_released_module_restore_and_load_state_dict() -> None:
    for expected, logits, errors, restored, loaded, released in ranks.world(2).run(
        _eval_and_module
    ):
        torch.testing.assert_close(logits, expected)
        assert len(errors) == 2, errors
        assert "released when it was wrapped" in errors[0], errors[0]
        assert "fsdp.wrap released" in errors[1], errors[1]
        torch.testing.assert_close(restored, expected)
        torch.testing.assert_close(loaded, expected)
        assert released


def _no_sync_and_bf16(rank: int, size: int) -> Any:
    model = build("llama")
    fn, state = fdp.make_functional(model)
    fsdp = fdp.FullyShardedDataParallel(state)
    shards = fsdp.shard(state)
    run = fsdp.wrap(fn)
    with fsdp.no_sync():
        run(shards, **inputs("llama", rank)).loss.backward()
    run(shards, **inputs("llama", rank + 2)).loss.backward()
    accumulated = _grads(fsdp, shards, state)
    model16 = build("llama")
    fn16, state16 = fdp.make_functional(model16)
    fsdp16 = fdp.FullyShardedDataParallel(state16, param_dtype=torch.bfloat16)
    shards16 = fsdp16.shard(state16)
    fsdp16.wrap(fn16)(shards16, **inputs("llama", rank)).loss.backward()
    return accumulated, _grads(fsdp16, shards16, state16)


def test_no_sync_accumulates_and_bf16_parameters_match_one_process() -> None:
    ref = build("llama")
    losses = [ref(**inputs("llama", r)).loss for r in (0, 1, 2, 3)]
    torch.autograd.backward(torch.stack(losses).sum() / 2)  # two micro-batches, mean of 2 ranks
    ref16 = build("llama").to(torch.bfloat16)
    torch.autograd.backward(torch.stack([ref16(**inputs("llama", r)).loss for r in (0, 1)]).mean())
    expected16 = {k: v.float() for k, v in grads_of(ref16).items()}
    for rank, (accumulated, bf16) in enumerate(ranks.world(2).run(_no_sync_and_bf16)):
        check(accumulated, grads_of(ref), f"no_sync rank {rank}")
        assert bf16.keys() == expected16.keys()
        for k, v in expected16.items():
            torch.testing.assert_close(bf16[k], v, rtol=0.05, atol=0.02, msg=k)


def _refusals(rank: int, size: int) -> Any:
    model = build("gpt2")
    fn, state = fdp.make_functional(model)
    fsdp = fdp.FullyShardedDataParallel(state, units=["transformer.h.0.mlp.c_fc.weight"])
    shards = fsdp.shard(state)
    errors = []
    try:
        fsdp.wrap(lambda s, x: x)
    except TypeError as e:
        errors.append(str(e))
    run = fsdp.wrap(fn)  # a unit that is a leaf: gathered by the forward of its module
    loss = run(shards, **inputs("gpt2", rank)).loss
    loss.backward()
    seen: list[Any] = []

    def reads_outside(module: nn.Module, args: Any) -> None:  # the root: c_fc not gathered
        weight: Any = module.get_submodule("transformer.h.0.mlp.c_fc").weight
        seen.append((weight.shape, weight.dtype, weight.device))
        weight.sum()

    model.register_forward_pre_hook(reads_outside)
    try:
        run(shards, **inputs("gpt2", rank))
    except RuntimeError as e:
        errors.append(str(e))
    return errors, float(loss.detach()), seen


def test_wrap_refuses_other_functions_and_gathers_leaf_units_where_used() -> None:
    ref, _ = reference("gpt2", 2)
    losses = [float(ref(**inputs("gpt2", r)).loss.detach()) for r in range(2)]
    for rank, (errors, loss, seen) in enumerate(ranks.world(2).run(_refusals)):
        assert "`fn` expected the function fdp.make_functional" in errors[0], errors
        assert loss == pytest.approx(losses[rank], rel=1e-5)
        # Outside its module the parameter has its metadata, and any op on it raises.
        assert seen == [(torch.Size([16, 64]), torch.float32, torch.device("cpu"))]
        assert (
            "'transformer.h.0.mlp.c_fc.weight' (unit 'transformer.h.0.mlp.c_fc.weight')"
            in (errors[1])
        ), errors
        assert "was used (aten.sum.default) outside the forward" in errors[1], errors


def _on_cuda(rank: int, size: int) -> Any:
    import torch.distributed as dist

    group = dist.new_group(backend="nccl")  # this rank alone, on its GPU
    model, ref = build("gpt2").cuda(), build("gpt2").cuda()
    fn, state = fdp.make_functional(model)
    fsdp = fdp.FullyShardedDataParallel(state, group=group)
    shards = fsdp.shard(state)
    run = fsdp.wrap(fn)
    batch = {k: v.cuda() for k, v in inputs("gpt2", 0).items()}
    run(shards, **batch).loss.backward()
    between = fsdp._states[BLOCKS["gpt2"][0]].phase
    ref(**batch).loss.backward()
    got = {k: v.cpu() for k, v in _grads(fsdp, shards, state).items()}
    dist.destroy_process_group(group)
    return got, {k: v.cpu() for k, v in grads_of(ref).items()}, between


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_wrap_on_cuda_with_nccl_matches_the_module() -> None:
    got, expected, between = ranks.world(1).run(_on_cuda)[0]
    check(got, expected, "gpt2 on CUDA")
    assert between == _fsdp_unit.Phase.RESHARDED


def _under_func_grad(rank: int, size: int) -> Any:
    model = build("llama")
    fn, state = fdp.make_functional(model)
    fsdp = fdp.FullyShardedDataParallel(state)
    shards = {k: tuple(t.detach() for t in ts) for k, ts in fsdp.shard(state).items()}
    run = fsdp.wrap(fn)

    def loss(s: Any) -> torch.Tensor:
        out: torch.Tensor = run(s, **inputs("llama", rank)).loss
        return out

    grads = torch.func.grad(loss)(shards)
    full = fsdp.full(grads)
    return {k: full[k] for k, v in state.items() if v.requires_grad}


def test_wrap_inside_torch_func_grad_matches_one_process() -> None:
    ref, _ = reference("llama", 2)
    for rank, grads in enumerate(ranks.world(2).run(_under_func_grad)):
        check(grads, grads_of(ref), f"llama under torch.func.grad, rank {rank}")
