"""The int8 all-gather of fully sharded parameters (``gather_dtype=torch.int8``).

The reference rounds each rank's shard here, block by block in a plain
loop (256 values from the shard's start, the scale ``max|x| / 127``), and
makes the whole tree of those decoded weights with an exact gather
(``fsdp.full``). Outputs and gradients are then compared with one process
on the full batch using the decoded weights: what is trained is the decoded
weights, and the shards' gradient is the gradient with respect to them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

import fdp
from fdp import _compat
from fdp._comm import _quantized
from tests import ranks
from tests.helpers import tree_allclose

TOL: dict[str, Any] = {"rtol": 1e-5, "atol": 1e-6}
ROWS = 3  # examples per rank
Shards = dict[str, tuple[torch.Tensor, ...]]


def reference_roundtrip(x: torch.Tensor, block: int = 256) -> torch.Tensor:
    """``x`` (1-D) rounded to int8 block by block and back, in ``x``'s dtype, plainly."""
    decoded = torch.promote_types(x.dtype, torch.float32)  # float64 decodes in float64
    out = torch.empty(x.numel(), dtype=decoded)
    wide = x.detach().float()
    for start in range(0, x.numel(), block):
        values = wide[start : start + block]
        scale = values.abs().max() / 127
        if scale > 0:
            out[start : start + block] = torch.round(values / scale).to(decoded) * scale
        else:
            out[start : start + block] = values * 0
    return out.to(x.dtype)


# ---------------------------------------------------------------------------
# The codec, in one process.


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("n", [1, 255, 256, 257, 1000])
def test_the_codec_rounds_each_block_to_int8_as_the_reference(n: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(n)
    parts = [(torch.randn(n, generator=g) * torch.logspace(-3, 1, n)).to(dtype) for _ in range(3)]
    rows = torch.stack([_quantized.encode(x) for x in parts])
    for x, row in zip(parts, rows, strict=True):  # eager, into a buffer: the same bytes
        into = torch.full((_quantized.packed_bytes(n),), 7, dtype=torch.uint8)
        assert torch.equal(_quantized.encode(x, out=into), row)
    assert rows.dtype == torch.uint8
    assert rows.shape[1] == _quantized.packed_bytes(n)
    expected = torch.cat([reference_roundtrip(x) for x in parts])
    for out in (None, torch.empty(3 * n, dtype=dtype)):
        got = _quantized.decode(rows, n, dtype, out=out)
        assert got.dtype == dtype
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    for x, back in zip(parts, expected.view(3, n), strict=True):  # the documented bound
        amax = float(x.double().abs().amax())  # and the rounding to dtype where it lands
        bound = amax / 254 * (1 + 1e-3) + amax * torch.finfo(dtype).eps
        assert float((back.double() - x.double()).abs().max()) <= bound


def test_zero_blocks_are_exact_and_a_non_finite_value_spoils_only_its_block() -> None:
    x = torch.zeros(600)
    x[300] = float("nan")
    x[520] = float("inf")
    x[256:260] = torch.tensor([1.0, -2.0, 3.0, 0.5])
    got = _quantized.decode(_quantized.encode(x)[None], 600, torch.float32)
    assert torch.equal(got[:256], torch.zeros(256))  # an all-zero block: zeros
    assert not torch.isfinite(got[256:512]).any()  # the NaN's block
    assert not torch.isfinite(got[512:]).any()  # the inf's block
    tiny = torch.full((10,), 1e-44)  # a scale that underflows to zero: zeros, never inf
    assert torch.equal(
        _quantized.decode(_quantized.encode(tiny)[None], 10, torch.float32), tiny * 0
    )


def test_the_codec_compiled_by_inductor_equals_eager() -> None:
    """A partial last block, compiled (Note [inductor slice of a broadcast product])."""
    n = 1000  # three whole blocks and a partial one

    def roundtrip(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        rows = torch.stack([_quantized.encode(x), _quantized.encode(y)])
        return _quantized.decode(rows, n, torch.float32)

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, generator=g), torch.randn(n, generator=g) * 3
    compiled = torch.compile(roundtrip, backend="inductor", fullgraph=True)
    torch.testing.assert_close(compiled(x, y), roundtrip(x, y), rtol=0, atol=0)


# ---------------------------------------------------------------------------
# Fully sharded training through the int8 gather.


def make_params() -> dict[str, Any]:
    """Leaves whose shards hold whole blocks and a partial one; a complex leaf."""
    g = torch.Generator().manual_seed(0)

    def p(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, dtype=dtype) / 3).requires_grad_()

    return {
        "embed": p(40, 16),
        "blocks": [{"w": p(16, 16), "b": p(16)} for _ in range(2)],
        "head": {"w": p(16, 3), "phase": p(3, dtype=torch.complex64)},
    }


def data(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(size * ROWS, 40, generator=g), torch.randn(size * ROWS, 3, generator=g)


def mine(t: torch.Tensor, rank: int) -> torch.Tensor:
    return t[rank * ROWS : (rank + 1) * ROWS]


def model(params: dict[str, Any], x: torch.Tensor) -> torch.Tensor:
    h = x @ params["embed"]
    for block in params["blocks"]:
        h = torch.tanh(h @ block["w"] + block["b"])
    phase = params["head"]["phase"].abs().to(h.dtype)  # complex leaves keep their dtype
    out: torch.Tensor = h @ params["head"]["w"].to(h.dtype) + phase
    return out


def local_loss(params: dict[str, Any], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(params, x).float() - y).square().mean()


def applied(fsdp: fdp.FullyShardedDataParallel, shards: Shards, x: torch.Tensor) -> torch.Tensor:
    """``model`` with each unit gathered only for its function (``fsdp.apply``)."""
    h = fsdp.apply(shards, "embed", lambda w, x: x @ w, x)
    for i in range(2):
        h = fsdp.apply(shards, f"blocks.{i}", lambda u, h: torch.tanh(h @ u["w"] + u["b"]), h)
    head = fsdp.gather(shards, "head")
    out: torch.Tensor = h @ head["w"] + head["phase"].abs().to(h.dtype)
    return out


def decoded(fsdp: fdp.FullyShardedDataParallel, shards: Shards) -> Any:
    """The whole tree of the reference's decoded weights (each rank's shard rounded here)."""
    rounded = {k: tuple(reference_roundtrip(t) for t in ts) for k, ts in shards.items()}
    return fsdp.full(rounded)


def reference_grad(size: int, weights: Any) -> Any:
    """The gradient of the mean over ranks of each rank's loss, at ``weights``, one process."""
    x, y = data(size)
    weights = tree_map(lambda t: t.detach(), weights)

    def mean_loss(w: Any) -> torch.Tensor:
        return sum(local_loss(w, mine(x, r), mine(y, r)) for r in range(size)) / size  # type: ignore[return-value]

    return torch.func.grad(mean_loss)(weights)


def _grads_by(how: str, fsdp: fdp.FullyShardedDataParallel, shards: Shards, rank: int) -> Any:
    x, y = data(dist.get_world_size())
    xs, ys = mine(x, rank), mine(y, rank)
    if how == "func_grad":
        return fsdp.full(torch.func.grad(lambda s: local_loss(fsdp(s), xs, ys))(shards))
    if how == "backward":
        torch.autograd.backward(local_loss(fsdp(shards), xs, ys))
    elif how == "apply":
        torch.autograd.backward((applied(fsdp, shards, xs).float() - ys).square().mean())
    else:  # no_sync: two micro-batches, one kept, one reduce-scattered
        with fsdp.no_sync():
            torch.autograd.backward(0.5 * local_loss(fsdp(shards), xs[:1], ys[:1]))
        torch.autograd.backward(0.5 * local_loss(fsdp(shards), xs[1:], ys[1:]))
    return fsdp.full(shard_grads(shards))


def shard_grads(shards: Shards) -> Shards:
    """Each shard's ``.grad`` (every shard here is trained)."""
    out = {k: tuple(t.grad for t in ts) for k, ts in shards.items()}
    assert all(g is not None for gs in out.values() for g in gs)
    return out  # type: ignore[return-value]


def _train(rank: int, size: int, how: str, prefetch: bool) -> Any:
    params = make_params()
    fsdp = fdp.FullyShardedDataParallel(params, gather_dtype=torch.int8, prefetch=prefetch)
    shards = fsdp.shard(params)
    gathered = tree_map(lambda t: t.detach(), fsdp(shards))
    return decoded(fsdp, shards), gathered, _grads_by(how, fsdp, shards, rank)


def _no_sync_grad(size: int, weights: Any) -> Any:
    """no_sync's micro-batches: half the loss of the first row, half that of the rest."""
    x, y = data(size)
    weights = tree_map(lambda t: t.detach(), weights)

    def mean_loss(w: Any) -> torch.Tensor:
        total = torch.zeros(())
        for r in range(size):
            xs, ys = mine(x, r), mine(y, r)
            total += 0.5 * local_loss(w, xs[:1], ys[:1]) + 0.5 * local_loss(w, xs[1:], ys[1:])
        return total / size

    return torch.func.grad(mean_loss)(weights)


@pytest.mark.parametrize(
    ("how", "prefetch"),
    [
        ("func_grad", True),
        ("backward", True),
        ("apply", True),
        ("apply", False),
        ("no_sync", True),
    ],
)
@pytest.mark.parametrize("size", [2, 3])
def test_gradients_are_one_process_s_at_the_decoded_weights(
    size: int, how: str, prefetch: bool
) -> None:
    got = ranks.world(size).run(_train, how, prefetch)
    weights = got[0][0]
    exact = tree_map(lambda t: t.detach(), make_params())
    # Rounded: off by at most half a block's scale, but not equal (the wire was int8).
    assert not torch.equal(weights["embed"], exact["embed"])
    assert float((weights["embed"] - exact["embed"]).abs().max()) <= 4 / 254
    # A complex leaf's real and imaginary parts are rounded alike.
    assert not torch.equal(weights["head"]["phase"], exact["head"]["phase"])
    expected = (_no_sync_grad if how == "no_sync" else reference_grad)(size, weights)
    for w, gathered, grads in got:
        tree_allclose(w, weights, rtol=0, atol=0)  # every rank decodes the same weights
        tree_allclose(gathered, weights, rtol=0, atol=0)
        tree_allclose(grads, expected, **TOL)


def _transforms(rank: int, size: int) -> Any:
    params = make_params()
    fsdp = fdp.FullyShardedDataParallel(params, gather_dtype=torch.int8)
    shards = tree_map(lambda t: t.detach(), fsdp.shard(params))
    g = torch.Generator().manual_seed(10 + rank)
    tangents = tree_map(lambda t: torch.randn(t.shape, generator=g, dtype=t.dtype), shards)
    primal, tangent = torch.func.jvp(fsdp, (shards,), (tangents,))[:2]
    x, y = data(size)

    def example_loss(s: Shards, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return local_loss(fsdp(s), x[None], y[None])

    per_example = torch.func.vmap(torch.func.grad(example_loss), in_dims=(None, 0, 0))
    batched = per_example(shards, mine(x, rank), mine(y, rank))
    examples = [fsdp.full(tree_map(lambda t: t[i], batched)) for i in range(ROWS)]  # noqa: B023
    # Shards batched under vmap: each row rounded in blocks of its own, as alone.
    stacked = tree_map(lambda t: torch.stack([t, 2 * t]), shards)
    rows = torch.func.vmap(fsdp)(stacked)
    doubled = tree_map(lambda t: 2 * t, shards)
    return (
        decoded(fsdp, shards),
        primal,
        tangent,
        fsdp.full(tangents),
        examples,
        rows,
        decoded(fsdp, doubled),
    )


@pytest.mark.parametrize("size", [2, 3])
def test_jvp_carries_exact_tangents_and_vmap_rounds_each_row_alone(size: int) -> None:
    x, y = data(size)
    for got in ranks.world(size).run(_transforms):
        weights, primal, tangent, exact_tangent, examples, rows, doubled = got
        tree_allclose(primal, weights, rtol=0, atol=0)
        tree_allclose(tangent, exact_tangent, rtol=0, atol=0)  # the tangent is not rounded
        for i in range(ROWS):
            # Example i of every rank, averaged: the reduce-scatter of each vmapped row.
            def row_loss(w: Any, i: int = i) -> torch.Tensor:
                pairs = [(mine(x, r)[i : i + 1], mine(y, r)[i : i + 1]) for r in range(size)]
                return sum(local_loss(w, xs, ys) for xs, ys in pairs) / size  # type: ignore[return-value]

            tree_allclose(examples[i], torch.func.grad(row_loss)(weights), **TOL)
        tree_allclose(tree_map(lambda t: t[0], rows), weights, rtol=0, atol=0)
        tree_allclose(tree_map(lambda t: t[1], rows), doubled, rtol=0, atol=0)


def _second_order(rank: int, size: int) -> Any:
    """A Hessian-vector product w.r.t. the shards, forward-over-reverse and reverse-over-reverse."""
    params = make_params()
    fsdp = fdp.FullyShardedDataParallel(params, gather_dtype=torch.int8)
    x, y = data(size)
    shards = tree_map(lambda t: t.detach(), fsdp.shard(params))
    g = torch.Generator().manual_seed(20 + rank)
    v = tree_map(lambda t: torch.randn(t.shape, generator=g, dtype=t.dtype), shards)

    def loss(s: Shards) -> torch.Tensor:
        return local_loss(fsdp(s), mine(x, rank), mine(y, rank))

    hvp = torch.func.jvp(torch.func.grad(loss), (shards,), (v,))[1]

    def along_v(s: Shards) -> torch.Tensor:
        grads = torch.func.grad(loss)(s)
        dots = [(a * b).sum() for k in grads for a, b in zip(grads[k], v[k], strict=True)]
        partial = torch.stack(dots).sum().reshape(1)  # a sum over ranks of partial dots
        return fdp.all_reduce_grads({"dot": partial}, average=False)["dot"].sum()

    rr = torch.func.grad(along_v)(shards)
    return decoded(fsdp, shards), fsdp.full(hvp), fsdp.full(rr), fsdp.full(v)


@pytest.mark.parametrize("size", [2, 3])
def test_second_order_gathers_travel_exact(size: int) -> None:
    """The Hessian at the decoded weights along the exact direction: no tangent is rounded."""
    x, y = data(size)
    for weights, hvp, rr, direction in ranks.world(size).run(_second_order):

        def mean_loss(w: Any) -> torch.Tensor:
            return sum(local_loss(w, mine(x, r), mine(y, r)) for r in range(size)) / size  # type: ignore[return-value]

        expected = torch.func.jvp(torch.func.grad(mean_loss), (weights,), (direction,))[1]
        tree_allclose(hvp, expected, **TOL)
        tree_allclose(rr, expected, **TOL)


def _compiled(rank: int, size: int) -> Any:
    params = make_params()
    fsdp = fdp.FullyShardedDataParallel(params, gather_dtype=torch.int8)
    shards = fsdp.shard(params)
    x, y = data(size)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def loss(s: Shards, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (applied(fsdp, s, x) - y).square().mean()

    torch.autograd.backward(loss(shards, mine(x, rank), mine(y, rank)))
    grads = fsdp.full(shard_grads(shards))
    return decoded(fsdp, shards), grads


def test_compiled_resharding_recomputes_the_same_decoded_weights() -> None:
    got = ranks.world(2).run(_compiled)
    weights = got[0][0]
    expected = reference_grad(2, weights)
    for _, grads in got:
        tree_allclose(grads, expected, **TOL)


def _mixed(rank: int, size: int) -> Any:
    params = make_params()
    fsdp = fdp.FullyShardedDataParallel(
        params,
        param_dtype=torch.bfloat16,
        gather_dtype=torch.int8,
        unit_dtypes={"head": {"gather_dtype": None}, "blocks.1": {"param_dtype": torch.float32}},
    )
    shards = fsdp.shard(params)
    x, y = data(size)
    xs, ys = mine(x, rank), mine(y, rank)
    grads = torch.func.grad(lambda s: mixed_loss(fsdp(s), xs, ys))(shards)
    return decoded(fsdp, shards), tree_map(lambda t: t.detach(), fsdp(shards)), fsdp.full(grads)


def mixed_loss(params: dict[str, Any], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``local_loss`` with each unit computing in its weights' dtype."""
    h = x.to(params["embed"].dtype) @ params["embed"]
    for block in params["blocks"]:
        h = torch.tanh(h.to(block["w"].dtype) @ block["w"] + block["b"])
    head = params["head"]
    out: torch.Tensor = h.to(head["w"].dtype) @ head["w"] + head["phase"].abs().to(head["w"].dtype)
    return (out.float() - y).square().mean()


def test_per_unit_gather_dtypes_and_a_bf16_param_dtype() -> None:
    exact = tree_map(lambda t: t.detach(), make_params())
    x, y = data(2)

    def mean_loss(w: Any) -> torch.Tensor:
        return torch.stack([mixed_loss(w, mine(x, r), mine(y, r)) for r in range(2)]).mean()

    for weights, gathered, grads in ranks.world(2).run(_mixed):
        # One process at the gathered weights, in their dtypes; the shards' gradients
        # come back in the master's float32 (reduce-scattered in bfloat16 where gathered so).
        expected = tree_map(lambda g: g.to(grads_dtype(g)), torch.func.grad(mean_loss)(gathered))
        tree_allclose(grads, expected, rtol=2e-2, atol=2e-3)
        assert gathered["embed"].dtype == torch.bfloat16
        tree_allclose(gathered["embed"], weights["embed"].to(torch.bfloat16), rtol=0, atol=0)
        assert gathered["blocks"][1]["w"].dtype == torch.float32  # decoded to float32
        tree_allclose(gathered["blocks"][1], weights["blocks"][1], rtol=0, atol=0)
        assert gathered["head"]["w"].dtype == torch.bfloat16  # exact, cast as param_dtype
        tree_allclose(gathered["head"]["w"], exact["head"]["w"].to(torch.bfloat16), rtol=0, atol=0)


def grads_dtype(g: torch.Tensor) -> torch.dtype:
    """The master copy's dtype of a gradient computed in ``g.dtype``."""
    return g.dtype if g.is_complex() else torch.float32


def _wire(rank: int, size: int, gather_dtype: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every buffer this rank's gathers put on the wire, and this rank's shards."""
    params = make_params()
    fsdp = fdp.FullyShardedDataParallel(params, gather_dtype=gather_dtype, prefetch=False)
    shards = fsdp.shard(params)
    sent: list[torch.Tensor] = []
    original = _compat.all_gather_single

    def counted(out: torch.Tensor, part: torch.Tensor, group: Any) -> Any:
        sent.append(part.detach().clone())
        return original(out, part, group)

    _compat.all_gather_single = counted
    try:
        fsdp(shards)
    finally:
        _compat.all_gather_single = original
    return sent, [t.detach().reshape(-1) for ts in shards.values() for t in ts]


def _int8_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One process's block-wise int8 of a float32 shard: values and float32 scales."""
    blocks = torch.split(x, 256)
    scales = torch.stack([b.abs().max() / 127.0 for b in blocks])
    safe = torch.where(scales > 0, scales, torch.ones(()))
    q = torch.cat([(b / s).round() for b, s in zip(blocks, safe, strict=True)])
    return q.to(torch.int8), scales


def test_the_int8_gather_sends_int8_values_and_scales_under_0_3x_float32_s_bytes() -> None:
    int8 = ranks.world(2).run(_wire, torch.int8)
    plain = ranks.world(2).run(_wire, None)
    for (sent, shards), (sent_plain, _) in zip(int8, plain, strict=True):
        assert sent_plain, "the plain gathers were not counted"
        assert sent, "the int8 gathers were not counted"
        assert {t.dtype for t in sent} == {torch.uint8}  # bytes: int8 values, then scales
        assert {t.dtype for t in sent_plain} == {torch.float32}
        ratio = sum(t.numel() for t in sent) / sum(4 * t.numel() for t in sent_plain)
        assert ratio <= 0.3, ratio
        # Each float32 shard went as its int8 values and block scales, nothing else.
        floats = [x for x in shards if x.dtype == torch.float32 and x.numel()]
        assert len(floats) == len(sent), (len(floats), len(sent))
        for x, wire in zip(floats, sent, strict=True):
            q, scales = _int8_blocks(x)
            n = x.numel()
            aligned = -(-n // 4) * 4
            assert wire.numel() == aligned + 4 * scales.numel()
            assert (wire[:n].view(torch.int8).int() - q.int()).abs().max() <= 1
            torch.testing.assert_close(wire[aligned:].view(torch.float32), scales, rtol=0, atol=0)


def _refused(rank: int, size: int, case: str) -> str:
    params = make_params()
    options: dict[str, Callable[[], Any]] = {
        "float16": lambda: {"gather_dtype": torch.float16},
        "unit key": lambda: {"unit_dtypes": {"head": {"wire": torch.int8}}},
        "unit value": lambda: {"unit_dtypes": {"head": {"gather_dtype": torch.uint8}}},
        "one rank": lambda: {"gather_dtype": torch.int8 if rank == 1 else None},
        "one rank wrong": lambda: {"gather_dtype": torch.float16 if rank == 1 else None},
    }
    try:
        fdp.FullyShardedDataParallel(params, **options[case]())
    except (TypeError, ValueError) as err:
        return f"{type(err).__name__}: {err}"
    return "accepted"


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("float16", r"ValueError: .*`gather_dtype` expected None .* or torch.int8 .*float16"),
        ("unit key", r"ValueError: .*`unit_dtypes\['head'\]` expected keys among .*'wire'"),
        ("unit value", r"ValueError: .*`unit_dtypes\['head'\]` expected None .*uint8"),
        ("one rank", r"ValueError: .*`gather_dtype` differs across ranks: rank 0 has None, rank 1"),
        ("one rank wrong", r"`gather_dtype` differs across ranks: .* rank 1 has torch.float16"),
    ],
)
def test_bad_options_are_refused_on_every_rank(case: str, match: str) -> None:
    for said in ranks.world(2).run(_refused, case):
        assert said.startswith("ValueError: fdp.FullyShardedDataParallel: ")
        assert re.search(match, said), said
