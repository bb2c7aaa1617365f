"""DistributedDataParallel inside torch.compile(fullgraph=True): the reduction in the graph.

Every body runs on spawned gloo ranks (tests/ranks.py), compiles the loss
with ``fullgraph=True`` (so any graph break fails the test), and its
gradients are compared with one plain single-process computation: the
average over ranks of each rank's loss gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils._pytree import tree_map

import fdp
from fdp import _tree
from tests import ranks
from tests.helpers import PER_RANK, TINY, TOL, batch, mlp_params, shard

pytestmark = pytest.mark.compile
DEPTH = 3


def make_params() -> dict[str, Any]:
    """The shared MLP, a frozen float leaf, an int buffer and a leaf no rank uses."""
    params = mlp_params(depth=DEPTH)
    params["frozen"] = torch.full((8,), 0.5)
    params["steps"] = torch.tensor(3)
    params["never"] = torch.ones(5, requires_grad=True)
    return params


def skipped_layer(rank: int, skip: bool) -> int | None:
    """The 8-to-8 layer rank ``rank`` leaves out (its buckets unused there), if ``skip``."""
    return 1 + rank % (DEPTH - 1) if skip else None


def loss_fn(params: dict[str, Any], x: torch.Tensor, y: torch.Tensor, skip: int | None) -> Any:
    h = x
    for j, layer in enumerate(params["layers"]):
        if j != skip:
            h = torch.tanh(h @ layer["w"] + layer["b"]) * params["frozen"]
        else:
            h = h * params["frozen"]
    out = h @ params["head"].first + params["steps"]
    return (out - y).square().mean()


def ddp_loss(ddp: fdp.DistributedDataParallel, p: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
    return loss_fn(ddp(p), x, y, None)


def reference(size: int, *, skip: bool, steps: int = 1) -> list[torch.Tensor | None]:
    """Average over ranks of each rank's gradient, accumulated over ``steps`` batches."""
    params = make_params()
    for step in range(steps):
        x, y = batch(size * PER_RANK, seed=1 + step)
        for r in range(size):
            loss = loss_fn(params, shard(x, r), shard(y, r), skipped_layer(r, skip)) / size
            torch.autograd.backward(loss)
    return grads(params)


def grads(params: dict[str, Any]) -> list[torch.Tensor | None]:
    out = [layer[k].grad for layer in params["layers"] for k in ("w", "b")]
    return [*out, params["head"].first.grad, params["never"].grad]


def check(got: list[torch.Tensor | None], expected: list[torch.Tensor | None]) -> None:
    for g, e in zip(got, expected, strict=True):
        # A leaf no rank used: zeros inside a compiled graph (documented), None eagerly.
        torch.testing.assert_close(g, torch.zeros(5) if e is None else e, **TOL)


Compiled = tuple[
    dict[str, Any], fdp.DistributedDataParallel, Callable[..., Any], CompileCounterWithBackend
]


def compiled_loss(
    backend: str, skip: int | None = None, *, buckets: dict[str, Any] = TINY, **options: Any
) -> Compiled:
    """New parameters, their DDP (``buckets``: a bucket per leaf), the loss through it
    compiled with ``fullgraph=True``, and the counter of its graphs."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    params = make_params()
    ddp = fdp.DistributedDataParallel(params, **buckets, **options)

    @torch.compile(backend=counter, fullgraph=True)
    def loss(p: dict[str, Any], x: torch.Tensor, y: torch.Tensor) -> Any:
        return loss_fn(ddp(p), x, y, skip)

    return params, ddp, loss, counter


def _fullgraph_step(
    rank: int, size: int, backend: str, skip: bool, overlap: bool = True
) -> tuple[Any, int]:
    skipped = skipped_layer(rank, skip)
    params, _, loss, counter = compiled_loss(backend, skipped, compiled_overlap=overlap)
    x, y = batch(size * PER_RANK)
    torch.autograd.backward(loss(params, shard(x, rank), shard(y, rank)))
    return grads(params), counter.frame_count


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_fullgraph_ddp_matches_the_full_batch_gradients(backend: str) -> None:
    for got, frames in ranks.world(2).run(_fullgraph_step, backend, False):
        check(got, reference(2, skip=False))
        assert frames == 1


def _graph_calls(rank: int, size: int) -> tuple[Any, Any, list[str]]:
    """The eager-backend step's loss, gradients and the names of the functions its graph calls."""
    params, _, loss, counter = compiled_loss("eager")
    x, y = batch(size * PER_RANK)
    out = loss(params, shard(x, rank), shard(y, rank))
    torch.autograd.backward(out)
    calls = [
        getattr(node.target, "__qualname__", str(node.target))
        for graph in counter.graphs
        for node in graph.graph.nodes
        if node.op == "call_function"
    ]
    return out.detach(), grads(params), calls


def test_the_reduction_is_one_untraced_call_in_dynamos_graph() -> None:
    # Dynamo writes the reduction into the graph as one call, which AOTAutograd
    # traces later: traced by dynamo, its autograd.Function costs time quadratic
    # in the leaves (docs/compile.md). The other calls are the loss's own ops.
    x, y = batch(2 * PER_RANK)
    for rank, (out, got, calls) in enumerate(ranks.world(2).run(_graph_calls)):
        expected = loss_fn(make_params(), shard(x, rank), shard(y, rank), None)
        torch.testing.assert_close(out, expected.detach(), **TOL)
        check(got, reference(2, skip=False))
        assert calls.count("_reduce") == 1, calls
        assert not any("autograd_function_apply" in c for c in calls), calls


@pytest.mark.parametrize("size", [3, 4])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no overlap"])
def test_fullgraph_ddp_with_whole_buckets_unused_on_some_ranks(size: int, overlap: bool) -> None:
    # Rank r leaves layer 1 or 2 out: its buckets get no gradient there, while
    # the other ranks reduce them; nothing may hang, and .grad is the average.
    for got, _ in ranks.world(size).run(_fullgraph_step, "aot_eager", True, overlap):
        check(got, reference(size, skip=True))


def _unordered_step(rank: int, size: int, backend: str, skip: bool) -> tuple[Any, int]:
    """:func:`_fullgraph_step` as on a torch that cannot give an op an ordered effect.

    The buckets are pinned by real gradients (a chain from the first): the
    effect is only the fallback where no gradient is real (below).
    """
    from fdp._ddp import _traced

    _traced._ORDERED = False
    try:
        return _fullgraph_step(rank, size, backend, skip)
    finally:
        _traced._ORDERED = True


def test_fullgraph_ddp_needs_no_ordered_effect_where_a_gradient_is_real() -> None:
    for got, _ in ranks.world(3).run(_unordered_step, "aot_eager", True):
        check(got, reference(3, skip=True))


class _NoGradient(torch.autograd.Function):
    """The identity, whose backward gives its input no gradient (None)."""

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> None:
        return None


def _cut_step(rank: int, size: int, backend: str) -> tuple[Any, list[torch.Tensor | None]]:
    """Rank 0's loss reaches every leaf only through :class:`_NoGradient`: the loss, the grads."""
    torch._dynamo.reset()
    params = make_params()
    ddp = fdp.DistributedDataParallel(params, **TINY)

    def cut(t: Any) -> Any:
        floating = isinstance(t, torch.Tensor) and t.is_floating_point()
        return _NoGradient.apply(t) if rank == 0 and floating else t  # type: ignore[no-untyped-call]

    @torch.compile(backend=backend, fullgraph=True)
    def loss(p: dict[str, Any], x: torch.Tensor, y: torch.Tensor) -> Any:
        return loss_fn(tree_map(cut, ddp(p)), x, y, None)

    x, y = batch(size * PER_RANK)
    out = loss(params, shard(x, rank), shard(y, rank))
    torch.autograd.backward(out)
    return out.detach(), grads(params)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_rank_whose_gradients_are_all_none_still_reduces(backend: str) -> None:
    # No gradient reaches the reduction on rank 0 (the backward still runs
    # there, with None for every leaf): nothing real pins its buckets to
    # backward, so an ordered effect does; without it rank 0 issued them in
    # forward (measured: a hang). The average counts rank 0 as zeros.
    params = make_params()
    x, y = batch(2 * PER_RANK)
    torch.autograd.backward(loss_fn(params, shard(x, 1), shard(y, 1), None) / 2)
    for rank, (out, got) in enumerate(ranks.world(2).run(_cut_step, backend)):
        expected = loss_fn(make_params(), shard(x, rank), shard(y, rank), None)
        torch.testing.assert_close(out, expected.detach(), **TOL)
        check(got, grads(params))


def _compiled_twice(rank: int, size: int, overlap: bool) -> list[tuple[Any, int, dict[str, int]]]:
    """The inductor step, then again after ``dynamo.reset()``: each one's FX graph cache counts."""
    from torch._dynamo.utils import counters

    out = []
    for _ in range(2):
        before = dict(counters["inductor"])
        got, frames = _fullgraph_step(rank, size, "inductor", True, overlap)
        cache = {
            k: counters["inductor"][k] - before.get(k, 0)
            for k in ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass")
        }
        out.append((got, frames, cache))
    return out


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no overlap"])
def test_fullgraph_ddp_with_inductor(overlap: bool) -> None:
    # inductor's partitioner and joint-graph passes are where unused buckets
    # once moved their all-reduce into the forward graph. The second compile
    # is a restarted job's: with the overlap or without, both graphs come
    # from the on-disk cache (no effect token), and still reduce correctly.
    for runs in ranks.world(2).run(_compiled_twice, overlap):
        for got, frames, _ in runs:
            check(got, reference(2, skip=True))
            assert frames == 1
        expected = {"fxgraph_cache_hit": 2, "fxgraph_cache_miss": 0, "fxgraph_cache_bypass": 0}
        assert runs[1][2] == expected


def _backward_inputs(rank: int, size: int) -> list[torch.Tensor | None]:
    torch._dynamo.reset()
    params = make_params()
    ddp = fdp.DistributedDataParallel(params, **TINY)
    loss = torch.compile(partial(ddp_loss, ddp), fullgraph=True, backend="aot_eager")
    x, y = batch(size * PER_RANK)
    chosen = [params["head"].first, params["layers"][0]["w"]]
    torch.autograd.backward(loss(params, shard(x, rank), shard(y, rank)), inputs=chosen)
    return grads(params)


def test_backward_with_inputs_reduces_the_chosen_leaves() -> None:
    expected = reference(2, skip=False)
    for got in ranks.world(2).run(_backward_inputs):
        w0, b0, *_, head, never = got
        assert b0 is None
        assert never is None
        check([w0, head], [expected[0], expected[-2]])


def _accumulate(rank: int, size: int, cycles: int) -> tuple[list[Any], int]:
    """``cycles`` rounds of two no_sync micro-batches and one synchronised one, then SGD."""
    params, ddp, loss, counter = compiled_loss("aot_eager")
    results = []
    for _ in range(cycles):
        for step in range(3):
            x, y = batch(size * PER_RANK, seed=1 + step)
            if step < 2:
                with ddp.no_sync():
                    torch.autograd.backward(loss(params, shard(x, rank), shard(y, rank)))
            else:
                torch.autograd.backward(loss(params, shard(x, rank), shard(y, rank)))
        results.append(grads(params))
        for t in [*leaves_of(params), params["never"]]:  # zero_grad(set_to_none=True)
            t.grad = None
    return results, counter.frame_count


def test_no_sync_accumulation_inside_the_compiled_loss() -> None:
    expected = reference(2, skip=False, steps=3)
    for results, frames in ranks.world(2).run(_accumulate, 3):
        for got in results:
            check(got, expected)
        # Without the reduction: the first micro-batch's graph broadcasts the
        # buffers (torch's rule), the second's does not; with it: the third.
        assert frames == 3


def _new_tensors_every_step(rank: int, size: int, steps: int) -> tuple[list[Any], int]:
    params, _, loss, counter = compiled_loss("aot_eager", buckets={})  # the default buckets
    for step in range(steps):
        x, y = batch(size * PER_RANK, seed=step)
        torch.autograd.backward(loss(params, shard(x, rank), shard(y, rank)))
        params = sgd(params)
    return leaves_of(params), counter.frame_count


def sgd(params: dict[str, Any]) -> dict[str, Any]:
    """New leaf tensors, one step of SGD from the ones with a ``.grad``."""

    def update(t: torch.Tensor) -> torch.Tensor:
        new = t.detach() - 0.1 * t.grad if t.grad is not None else t.detach()
        return new.requires_grad_(t.requires_grad)

    layers = [{k: update(v) for k, v in layer.items()} for layer in params["layers"]]
    head = params["head"]._replace(first=update(params["head"].first))
    return {**params, "layers": layers, "head": head, "never": update(params["never"])}


def leaves_of(params: dict[str, Any]) -> list[torch.Tensor]:
    return [*(v for layer in params["layers"] for v in layer.values()), params["head"].first]


def test_a_training_loop_with_new_tensors_compiles_once() -> None:
    steps, size = 20, 2
    reference_params = make_params()
    for step in range(steps):
        x, y = batch(size * PER_RANK, seed=step)
        torch.autograd.backward(loss_fn(reference_params, x, y, None))
        reference_params = sgd(reference_params)
    for got, frames in ranks.world(size).run(_new_tensors_every_step, steps):
        for g, e in zip(got, leaves_of(reference_params), strict=True):
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)
        assert frames == 1


def _one_factory_many_ddps(rank: int, size: int) -> tuple[list[Any], int]:
    """Three DDPs, each through its own closure of one compiled function, no reset between."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")

    def factory(ddp: fdp.DistributedDataParallel) -> Callable[..., Any]:
        @torch.compile(backend=counter, fullgraph=True)
        def loss(p: dict[str, Any], x: torch.Tensor, y: torch.Tensor) -> Any:
            return loss_fn(ddp(p), x, y, None)

        return loss

    x, y = batch(size * PER_RANK)
    got = []
    for _ in range(3):
        params = make_params()
        ddp = fdp.DistributedDataParallel(params, **TINY)
        loss = factory(ddp)(params, shard(x, rank), shard(y, rank))
        torch.autograd.backward(loss)
        got.append((loss.detach(), grads(params)))
    return got, counter.frame_count


def test_ddps_compiled_through_one_function_each_reduce_their_own() -> None:
    # A factory of compiled losses (one per model, a DDP made again) compiles the
    # same code for each DDP. Dynamo turned the number naming the second DDP's
    # plan into a symbol (an int that changed between compiles), which the
    # plan registry could not look up: the second DDP's first call raised.
    expected = reference(2, skip=False)
    x, y = batch(2 * PER_RANK)
    for rank, (got, frames) in enumerate(ranks.world(2).run(_one_factory_many_ddps)):
        mine = loss_fn(make_params(), shard(x, rank), shard(y, rank), None)
        for loss, each in got:
            torch.testing.assert_close(loss, mine.detach(), **TOL)
            check(each, expected)
        assert frames == 3  # one graph per DDP, each compiled once


def _hooks(rank: int, size: int) -> tuple[dict[str, list[Any]], str]:
    results = {}
    for hook in (fdp.allreduce_hook, fdp.fp16_compress_hook, fdp.bf16_compress_hook):
        torch._dynamo.reset()
        params = make_params()
        ddp = fdp.DistributedDataParallel(params, comm_hook=hook)
        loss = torch.compile(partial(ddp_loss, ddp), backend="aot_eager", fullgraph=True)
        x, y = batch(size * PER_RANK)
        torch.autograd.backward(loss(params, shard(x, rank), shard(y, rank)))
        results[hook.__name__] = grads(params)

    def my_hook(group: Any, bucket: fdp.GradBucket) -> torch.futures.Future[torch.Tensor]:
        return fdp.allreduce_hook(group, bucket)

    torch._dynamo.reset()
    params = make_params()
    ddp = fdp.DistributedDataParallel(params, comm_hook=my_hook)
    refused = torch.compile(partial(ddp_loss, ddp), backend="aot_eager", fullgraph=True)
    x, y = batch(size * PER_RANK)
    with pytest.raises(
        Exception, match=r"`comm_hook` .*my_hook cannot run inside torch.compile"
    ) as e:
        refused(params, x, y)
    return results, str(e.value)


def test_comm_hooks_traced_and_a_user_hook_refused_clearly() -> None:
    expected = reference(2, skip=False)
    for results, message in ranks.world(2).run(_hooks):
        check(results["allreduce_hook"], expected)
        for name in ("fp16_compress_hook", "bf16_compress_hook"):
            for g, e in zip(results[name], expected, strict=True):
                torch.testing.assert_close(
                    g, torch.zeros(5) if e is None else e, rtol=0.02, atol=2e-3
                )
        assert (
            "fdp's or torch's allreduce_hook, fp16_compress_hook or bf16_compress_hook" in message
        )


def _compiled_func_grad(rank: int, size: int) -> str:
    torch._dynamo.reset()
    params = make_params()
    ddp = fdp.DistributedDataParallel(params)
    x, y = batch(size * PER_RANK)

    def loss(layers: Any) -> Any:
        return loss_fn(ddp({**params, "layers": layers}), shard(x, rank), shard(y, rank), None)

    with pytest.raises(Exception, match=r"pytorch/pytorch#193279") as e:
        torch.compile(torch.func.grad(loss), backend="aot_eager", fullgraph=True)(params["layers"])
    return str(e.value)


def test_compiled_func_grad_over_ddp_is_refused_under_fullgraph() -> None:
    # Without fullgraph, dynamo runs the transform eagerly and the hooks reduce
    # (test_compile.py::test_ddp_in_compiled_losses_reduces_correctly).
    for message in ranks.world(2).run(_compiled_func_grad):
        # fdp's reason is dynamo's explanation, not buried in its debug context.
        explanation = message.splitlines()[1]
        assert "(reason: fdp.DistributedDataParallel: ddp(params) cannot be compiled" in explanation
        assert "call .backward() on its result" in explanation


def layouts_params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    conv = torch.randn(2, 3, 2, 2, generator=g).to(memory_format=torch.channels_last)
    tied = torch.randn(3, generator=g).requires_grad_()
    return {
        "conv": conv.requires_grad_(),
        "odd": torch.randn(3, generator=g).requires_grad_(),  # the complex leaf at an odd offset
        "z": torch.randn(4, dtype=torch.complex64, generator=g).requires_grad_(),
        "tied_a": tied,
        "tied_b": tied,
    }


def layouts_loss(p: dict[str, torch.Tensor], rank: int) -> torch.Tensor:
    scale = float(rank + 1)
    total = (p["conv"] ** 2).sum() * scale + (p["odd"] * scale).sin().sum()
    total = total + (p["z"].abs() ** 2 * scale).sum() + (p["tied_a"] * scale).sum()
    return total + (p["tied_b"] ** 3).sum()


def _layouts(rank: int, size: int) -> list[torch.Tensor | None]:
    torch._dynamo.reset()
    params = layouts_params()
    ddp = fdp.DistributedDataParallel(params, bucket_cap_mb=1e-4, first_bucket_cap_mb=1e-4)
    loss = torch.compile(lambda p: layouts_loss(ddp(p), rank), backend="aot_eager", fullgraph=True)
    torch.autograd.backward(loss(params))
    return [params[k].grad for k in ("conv", "odd", "z", "tied_a")]


def test_complex_channels_last_and_tied_leaves_inside_the_compiled_loss() -> None:
    size = 2
    params = layouts_params()
    for r in range(size):
        torch.autograd.backward(layouts_loss(params, r) / size)
    expected = [params[k].grad for k in ("conv", "odd", "z", "tied_a")]
    for got in ranks.world(size).run(_layouts):
        check(got, expected)


def _backward_graph(
    rank: int, size: int, ddp: fdp.DistributedDataParallel, params: Any
) -> tuple[torch.fx.GraphModule, list[torch.Tensor | None]]:
    """The compiled backward graph of ``ddp_loss`` (AOTAutograd, no compiler), and the grads."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop

    torch._dynamo.reset()
    graphs: list[torch.fx.GraphModule] = []

    def keep(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm)
        return boxed_nop(gm, example_inputs)

    backend = aot_autograd(fw_compiler=boxed_nop, bw_compiler=keep)
    loss = torch.compile(partial(ddp_loss, ddp), backend=backend, fullgraph=True)
    x, y = batch(size * PER_RANK)
    torch.autograd.backward(loss(params, shard(x, rank), shard(y, rank)))
    (backward,) = graphs
    return backward, grads(params)


def _backward_collectives(rank: int, size: int, caps: dict[str, Any]) -> tuple[int, int]:
    """(all-reduces in the compiled backward graph, buckets) for one bucket-cap setting."""
    params = make_params()
    ddp = fdp.DistributedDataParallel(params, **caps)
    backward, _ = _backward_graph(rank, size, ddp, params)
    reduces = [
        n for n in backward.graph.nodes if n.target is torch.ops._c10d_functional.all_reduce.default
    ]
    # A bucket of leaves that need no gradient (the frozen one) is skipped.
    leaves, _ = _tree.flatten(params)
    paths = _tree.paths(params, "params")
    trainable = {p for p, t in zip(paths, leaves, strict=True) if getattr(t, "requires_grad", 0)}
    return len(reduces), sum(1 for b in ddp.buckets if trainable & set(b))


@pytest.mark.parametrize(
    "caps",
    [TINY, {"bucket_cap_mb": 1e-3, "first_bucket_cap_mb": 1e-4}, {}],
    ids=["a bucket per leaf", "a few buckets", "one bucket"],
)
def test_the_compiled_backward_has_one_all_reduce_per_bucket(caps: dict[str, Any]) -> None:
    for reduces, buckets in ranks.world(2).run(_backward_collectives, caps):
        assert reduces == buckets
        assert (buckets > 1) == (caps != {})


def _effects(rank: int, size: int, overlap: bool) -> tuple[int, list[torch.Tensor | None]]:
    """The ``with_effects`` nodes of the compiled backward, and the gradients."""
    params = make_params()
    ddp = fdp.DistributedDataParallel(params, **TINY, compiled_overlap=overlap)
    backward, got = _backward_graph(rank, size, ddp, params)
    effects = [n for n in backward.graph.nodes if n.target is torch.ops.higher_order.with_effects]
    return len(effects), got


def test_the_backward_holds_no_effect_with_or_without_the_overlap() -> None:
    # An effect token is what torch 2.13's FX graph cache refuses to keep:
    # without one, a restarted job reuses the compiled backward.
    for overlap in (True, False):
        for effects, got in ranks.world(2).run(_effects, overlap):
            check(got, reference(2, skip=False))
            assert effects == 0


def test_compiled_overlap_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match=r"`compiled_overlap` expected a bool; got 'no'"):
        fdp.DistributedDataParallel(make_params(), compiled_overlap="no")  # type: ignore[arg-type]


WIDE, LAYERS = 64, 4


def wide_params() -> list[dict[str, torch.Tensor]]:
    """A 4-layer 64-wide tanh MLP: matrices big enough that inductor calls extern mm."""
    g = torch.Generator().manual_seed(0)
    return [
        {
            "w": (torch.randn(WIDE, WIDE, generator=g) / WIDE**0.5).requires_grad_(),
            "b": torch.zeros(WIDE, requires_grad=True),
        }
        for _ in range(LAYERS)
    ]


def wide_loss(params: list[dict[str, torch.Tensor]], x: torch.Tensor, skip: int | None) -> Any:
    for j, layer in enumerate(params):
        if j != skip:
            x = torch.tanh(x @ layer["w"] + layer["b"])
    return x.square().mean()


def _overlapped(
    rank: int, size: int, overlap: bool, skipped: int
) -> tuple[list[Any], list[str], int]:
    """Gradients, the backward's extern mm / all-reduce / wait calls in generated order, buckets."""
    import re

    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    params = wide_params()
    # Three buckets; rank 1 leaves layer `skipped` out (unused leaves in a bucket there).
    ddp = fdp.DistributedDataParallel(
        params, bucket_cap_mb=0.02, first_bucket_cap_mb=0.02, compiled_overlap=overlap
    )
    skip = skipped if rank == 1 else None
    loss = torch.compile(
        lambda p, x: wide_loss(ddp(p), x, skip), fullgraph=True, options=fdp.overlap_options()
    )
    x = torch.randn(size * 8, WIDE, generator=torch.Generator().manual_seed(1))
    _, codes = run_and_get_code(lambda: torch.autograd.backward(loss(params, shard(x, rank))))
    (backward,) = [code for code in codes if "all_reduce_" in code]
    calls = re.findall(
        r"(extern_kernels\.mm|all_reduce_\.default|wait_tensor\.default)\(", backward
    )
    return [t.grad for layer in params for t in layer.values()], calls, len(ddp.buckets)


@pytest.mark.parametrize(
    ("overlap", "skipped"),
    [(True, 2), (False, 2), (True, LAYERS - 1)],
    ids=["overlap", "no overlap", "overlap, the first bucket unused on a rank"],
)
def test_overlap_options_issue_each_all_reduce_before_backward_ends(
    overlap: bool, skipped: int
) -> None:
    # Skipping the last layer leaves the first bucket without a gradient on
    # rank 1: its all-reduce waits for the first real ones there, in backward.
    size = 2
    params = wide_params()
    x = torch.randn(size * 8, WIDE, generator=torch.Generator().manual_seed(1))
    for r in range(size):
        torch.autograd.backward(wide_loss(params, shard(x, r), skipped if r == 1 else None) / size)
    expected = [t.grad for layer in params for t in layer.values()]
    for got, calls, buckets in ranks.world(size).run(_overlapped, overlap, skipped):
        check(got, expected)
        issues = [i for i, c in enumerate(calls) if c.startswith("all_reduce")]
        waits = [i for i, c in enumerate(calls) if c.startswith("wait")]
        last_mm = max(i for i, c in enumerate(calls) if c.endswith("mm"))
        assert len(issues) == len(waits) == buckets > 1, calls
        # The first bucket (the last layer) is in flight while backward
        # still multiplies; every wait comes after its issue. Without the
        # overlap every bucket waits for every gradient.
        assert (issues[0] < last_mm) == overlap, calls
        assert all(i < w for i, w in zip(issues, waits, strict=True)), calls
