"""docs/recipes.md's patterns on 2 and 3 gloo ranks, against one process on the whole batch.

The page itself runs in a one-process world (tests/test_docs.py); here the
same loops run where ranks differ: a Hugging Face-style module with keyword
inputs, an output object and tied embeddings under DDP; every sample once
with ``join`` and uneven shards; float16 loss scaling with local gradients
under ZeroRedundancy, where one rank alone overflows.
"""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fdp
from tests import ranks

VOCAB, DIM, STEPS = 11, 6, 3


@dataclasses.dataclass
class Output:
    loss: torch.Tensor
    logits: torch.Tensor


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(
        self, input_ids: torch.Tensor, *, attention_mask: torch.Tensor, labels: torch.Tensor
    ) -> Output:
        h = self.norm(self.embed(input_ids)) * attention_mask.unsqueeze(-1)
        logits = self.lm_head(h)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
        loss = (loss * attention_mask.flatten()).sum() / attention_mask.sum()
        return Output(loss=loss, logits=logits)


def lm_batch(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2 * world, 5), generator=g)
    mask = torch.ones_like(ids)
    mask[:, 3:] = (torch.arange(2 * world) % 2).unsqueeze(1)  # half the rows padded
    return ids, mask


def _lm_ranks(rank: int, size: int) -> dict[str, torch.Tensor]:
    ids, mask = lm_batch(size)
    model = TinyLM()
    fn, state = fdp.make_functional(model)
    ddp = fdp.DistributedDataParallel(state)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    mine = slice(2 * rank, 2 * rank + 2)  # each rank's rows: equal token counts per rank
    for _ in range(STEPS):
        out = fn(ddp(state), ids[mine], attention_mask=mask[mine], labels=ids[mine])
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_an_hf_style_module_trains_as_one_process_on_the_whole_batch() -> None:
    world = 2
    ids, mask = lm_batch(world)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    for _ in range(STEPS):
        # DDP averages the ranks' losses: the mean of per-rank masked means.
        losses = [
            model(ids[r * 2 : r * 2 + 2], attention_mask=mask[r * 2 : r * 2 + 2],
                  labels=ids[r * 2 : r * 2 + 2]).loss
            for r in range(world)
        ]  # fmt: skip
        opt.zero_grad()
        torch.autograd.backward(sum(losses) / world)
        opt.step()
    expected = model.state_dict()
    for got in ranks.world(world).run(_lm_ranks):
        assert got.keys() == expected.keys()  # both tied names, as torch saves them
        for name, tensor in expected.items():
            torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=1e-6)


class ModelOutput(collections.OrderedDict):  # type: ignore[type-arg]
    """transformers' ModelOutput in brief: a dataclass whose set fields are also its items."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if value is not None:
                self[f.name] = value


@dataclasses.dataclass
class CausalLMOutput(ModelOutput):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> CausalLMOutput:
        return CausalLMOutput(logits=self.head(self.embed(input_ids)) * attention_mask[..., None])


def test_data_parallel_gathers_an_hf_style_output_with_keyword_inputs() -> None:
    """``data_parallel`` over a module: keyword inputs split, a ModelOutput gathered whole."""
    ids, mask = lm_batch(2)
    model = Classifier()
    fn, state = fdp.make_functional(model)
    out = fdp.data_parallel(
        fn, state, (ids,), kwargs={"attention_mask": mask}, devices=["cpu", "cpu"]
    )
    assert type(out) is CausalLMOutput
    assert list(out.keys()) == ["logits"]  # None fields stay out of the items, as in HF
    assert out.loss is None
    ref = model(ids, attention_mask=mask)
    assert out.logits is not None
    assert ref.logits is not None
    torch.testing.assert_close(out.logits, ref.logits)
    grads = torch.autograd.grad(out.logits.square().sum(), list(state.values()))
    expected = torch.autograd.grad(ref.logits.square().sum(), list(state.values()))
    for g, e in zip(grads, expected, strict=True):
        torch.testing.assert_close(g, e)


N, BATCH = 13, 2  # 3 ranks: 5, 4 and 4 samples, so 3, 2 and 2 batches


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return torch.randn(N, 3, generator=g), torch.randn(N, 1, generator=g)


def _uneven_ranks(rank: int, size: int) -> torch.Tensor:
    x, y = data()
    params = {"w": torch.zeros(3, 1, requires_grad=True)}
    ddp = fdp.DistributedDataParallel(params)
    opt = torch.optim.SGD(params.values(), lr=0.1)
    with ddp.join():
        for idx in torch.split(torch.arange(rank, N, size), BATCH):
            loss = F.mse_loss(x[idx] @ ddp(params)["w"], y[idx])
            opt.zero_grad()
            torch.autograd.backward(loss)
            opt.step()
    return params["w"].detach()


def test_every_sample_once_with_join_equals_one_process() -> None:
    """Step k averages the ranks that still have a batch, over the whole world (torch's rule)."""
    world = 3
    x, y = data()
    shards = [torch.split(torch.arange(r, N, world), BATCH) for r in range(world)]
    w = torch.zeros(3, 1, requires_grad=True)
    for k in range(max(len(s) for s in shards)):
        losses = [F.mse_loss(x[s[k]] @ w, y[s[k]]) for s in shards if k < len(s)]
        (grad,) = torch.autograd.grad(torch.stack(losses).sum() / world, w)
        with torch.no_grad():
            w -= 0.1 * grad
    for got in ranks.world(world).run(_uneven_ranks):
        torch.testing.assert_close(got, w.detach())


def _scaled_zero(rank: int, size: int, sync: bool | None) -> tuple[list[float], torch.Tensor]:
    params = {"w": torch.ones(4), "b": torch.zeros(2)}
    zero = fdp.ZeroRedundancy(fdp.optim.sgd(0.1), params)
    scaler = fdp.optim.GradScaler(init_scale=8.0, growth_interval=2)
    zstate, sstate, scales = zero.init(params), scaler.init(), []
    for step in range(4):
        local = {"w": params["w"] * (rank + 1), "b": torch.ones(2)}
        if step == 1 and rank == 1:
            local["w"] = local["w"] * float("inf")  # this rank alone overflows
        scaled = scaler.scale(local, sstate)
        grads, found_inf = scaler.unscale(scaled, sstate, sync=sync)
        if not found_inf:
            params, zstate = zero.step(grads, zstate, params)
        sstate = scaler.update(sstate, found_inf)
        scales.append(float(sstate["scale"]))
    return scales, params["w"]


# sync=None (the default): ZeroRedundancy's local gradients are recognised by
# their structure. Before, only the overflowing rank skipped the step, and
# the others waited in zero.step until the process group's timeout.
@pytest.mark.parametrize("sync", [True, None], ids=["sync", "default"])
@pytest.mark.parametrize("world", [2, 3])
def test_loss_scaling_under_zero_skips_a_step_on_every_rank(world: int, sync: bool | None) -> None:
    w, scales = torch.ones(4), []
    scale, tracker = 8.0, 0
    for step in range(4):
        if step == 1:  # skipped everywhere, the scale backs off
            scale, tracker = scale / 2, 0
        else:
            w = w - 0.1 * w * sum(r + 1 for r in range(world)) / world
            tracker += 1
            if tracker == 2:
                scale, tracker = scale * 2, 0
        scales.append(scale)
    for got_scales, got_w in ranks.world(world).run(_scaled_zero, sync):
        assert got_scales == scales
        torch.testing.assert_close(got_w, w)
