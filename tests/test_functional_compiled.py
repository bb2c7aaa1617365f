"""make_functional inside torch.compile against the module itself, run eagerly.

Compiled, ``fn(state)`` puts the state's tensors straight into the module's
own parameter and buffer dicts while dynamo traces, every tied name
included, and puts the module's back after: these check outputs,
gradients, buffers, the module left as it was, and the refusals eager
calls make. Where the forward has a graph break the compiled call runs on
shells, as eagerly: a checkpointed block that dynamo leaves eager
recomputes in backward with the call's tensors.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import fdp


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(6, 6)
        self.norm = nn.BatchNorm1d(6)
        self.body = nn.Sequential(nn.Linear(6, 6), nn.Tanh())
        self.decoder = nn.Linear(6, 6)
        self.decoder.weight = self.encoder.weight  # tied
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(self.norm(self.encoder(x)))
        return self.decoder(h) * self.scale  # type: ignore[no-any-return]


class Broken(Net):
    """A graph break in the middle of the forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.encoder(x))
        torch._dynamo.graph_break()
        return self.decoder(self.body(h)) * self.scale  # type: ignore[no-any-return]


def tables(net: nn.Module) -> list[tuple[str, str, Any]]:
    """Every (module, key, tensor) of the module's parameter and buffer dicts, tied ones too."""
    out = []
    for prefix, m in net.named_modules(remove_duplicate=False):
        for key, t in [*m._parameters.items(), *m._buffers.items()]:
            out.append((prefix, key, t))
    return out


def same_tables(a: list[tuple[str, str, Any]], b: list[tuple[str, str, Any]]) -> bool:
    return len(a) == len(b) and all(
        x[:2] == y[:2] and x[2] is y[2] for x, y in zip(a, b, strict=False)
    )


def grads(net: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: p.grad for n, p in net.named_parameters()}


def compiled(fn: Callable[..., Any], **options: Any) -> Callable[..., Any]:
    torch._dynamo.reset()
    return torch.compile(fn, backend="eager", **options)


@pytest.mark.filterwarnings(
    # dynamo reads .grad of the resumed frame's non-leaf input (torch 2.13), a warning
    "ignore:The .grad attribute of a Tensor that is not a leaf Tensor:UserWarning"
)
@pytest.mark.parametrize("make", [Net, Broken], ids=["one_graph", "graph_break"])
def test_compiled_call_matches_the_module_and_leaves_it_as_it_was(make: type[Net]) -> None:
    torch.manual_seed(0)
    net = make().train()
    ref = copy.deepcopy(net)
    fn, state = fdp.make_functional(net)
    before = tables(net)
    x = torch.randn(5, 6)
    run = compiled(lambda s, x: fn(s, x), fullgraph=make is Net)
    for _ in range(2):  # the second call runs the compiled code alone
        out = run(state, x)
        expected = ref(x)
        torch.testing.assert_close(out, expected)
        out.pow(2).sum().backward()
        expected.pow(2).sum().backward()
    assert same_tables(tables(net), before)
    for (name, g), r in zip(grads(net).items(), grads(ref).values(), strict=True):
        assert g is not None, name
        assert r is not None, name
        torch.testing.assert_close(g, r, msg=name)
    # batch statistics updated in place, on the module's own buffers
    torch.testing.assert_close(net.norm.running_mean, ref.norm.running_mean)
    assert net.norm.num_batches_tracked is not None
    assert int(net.norm.num_batches_tracked) == 2


def test_compiled_call_with_new_tensors_leaves_the_modules_alone() -> None:
    torch.manual_seed(0)
    net = Net().eval()
    fn, state = fdp.make_functional(net)
    new = {k: (v.detach() * 0.5).requires_grad_(v.requires_grad) for k, v in state.items()}
    ref = copy.deepcopy(net)
    ref.load_state_dict({k: v.detach() for k, v in new.items()}, strict=False)
    x = torch.randn(5, 6)
    out = compiled(lambda s, x: fn(s, x), fullgraph=True)(new, x)
    torch.testing.assert_close(out, ref(x))
    out.sum().backward()
    ref(x).sum().backward()
    assert all(p.grad is None for p in net.parameters())
    for name, p in ref.named_parameters():
        g = new[name].grad
        assert g is not None, name
        torch.testing.assert_close(g, p.grad, msg=name)


def test_compiled_call_with_part_of_the_state_uses_the_modules_for_the_rest() -> None:
    torch.manual_seed(0)
    net = Net().eval()
    fn, _ = fdp.make_functional(net)
    weight = torch.randn(6, 6)  # the tied encoder/decoder weight, under one name
    ref = copy.deepcopy(net)
    with torch.no_grad():
        ref.encoder.weight.copy_(weight)
    x = torch.randn(5, 6)
    out = compiled(lambda w, x: fn({"encoder.weight": w}, x), fullgraph=True)(weight, x)
    torch.testing.assert_close(out, ref(x))
    assert net.decoder.weight is net.encoder.weight is not weight


def test_compiled_call_takes_a_tied_tensor_under_both_names() -> None:
    torch.manual_seed(0)
    net = Net().eval()
    fn, state = fdp.make_functional(net)
    x = torch.randn(5, 6)
    both = {**state, "decoder.weight": state["encoder.weight"]}
    out = compiled(lambda s, x: fn(s, x), fullgraph=True)(both, x)
    torch.testing.assert_close(out, net(x))


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (lambda s: {**s, "decoder.weight": torch.zeros(6, 6)}, ValueError, "tied"),
        (lambda s: {**s, "encoder.nope": torch.zeros(6)}, ValueError, "encoder.nope"),
        (lambda s: {**s, "encoder.bias": 3}, TypeError, "encoder.bias"),
    ],
    ids=["two_tensors_for_a_tied_one", "unknown_name", "not_a_tensor"],
)
def test_compiled_call_refuses_as_the_eager_call(
    change: Callable[[dict[str, Any]], dict[str, Any]], error: type[Exception], match: str
) -> None:
    net = Net().eval()
    fn, state = fdp.make_functional(net)
    before = tables(net)
    bad = change(dict(state))
    x = torch.randn(5, 6)
    with pytest.raises(error, match=match):
        fn(bad, x)
    with pytest.raises(error, match=match):
        compiled(lambda s, x: fn(s, x))(bad, x)
    assert same_tables(tables(net), before)


class Breaking(nn.Module):
    """Two layers with a graph break between them."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(6, 6)
        self.outer = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inner(x))
        torch._dynamo.graph_break()
        return torch.tanh(self.outer(h))


class Smooth(Breaking):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.outer(torch.tanh(self.inner(x))))


class Checkpointed(nn.Module):
    """A non-reentrant checkpoint around a block dynamo cannot trace whole."""

    block_type: type[nn.Module] = Breaking

    def __init__(self) -> None:
        super().__init__()
        self.block = self.block_type()
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(checkpoint(self.block, x, use_reentrant=False))  # type: ignore[no-any-return]


class CheckpointedSmooth(Checkpointed):
    """The checkpoint traced whole: dynamo's checkpoint operator, in the graph."""

    block_type = Smooth


@pytest.mark.filterwarnings(
    "ignore:The .grad attribute of a Tensor that is not a leaf Tensor:UserWarning"
)
@pytest.mark.parametrize(
    "make",
    [Checkpointed, Breaking, CheckpointedSmooth],
    ids=["checkpointed", "plain", "checkpoint_in_the_graph"],
)
def test_compiled_call_with_a_graph_break_recomputes_with_the_calls_tensors(
    make: type[nn.Module],
) -> None:
    torch.manual_seed(0)
    net = make()
    fn, state = fdp.make_functional(net)
    # Tensors unlike the module's own: a recompute that read the module's gets other values.
    new = {k: (v.detach() * 1.5 + 0.1).requires_grad_() for k, v in state.items()}
    ref = copy.deepcopy(net)
    ref.load_state_dict({k: v.detach() for k, v in new.items()})
    before = tables(net)
    x = torch.randn(5, 6)
    run = compiled(lambda s, x: fn(s, x))
    for step in range(3):  # later calls run the compiled pieces alone
        out = run(new, x)
        expected = ref(x)
        torch.testing.assert_close(out, expected)
        got = torch.autograd.grad(out.pow(2).sum(), list(new.values()))
        want = torch.autograd.grad(expected.pow(2).sum(), list(ref.parameters()))
        for name, g, w in zip(new, got, want, strict=True):
            torch.testing.assert_close(g, w, msg=f"step {step}: {name}")
    assert same_tables(tables(net), before)
    assert all(p.grad is None for p in net.parameters())


class Counted(Breaking):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return super().forward(x)


@pytest.mark.filterwarnings(
    "ignore:The .grad attribute of a Tensor that is not a leaf Tensor:UserWarning"
)
def test_compiled_call_with_a_graph_break_writes_back_what_the_forward_changed() -> None:
    net = Counted()
    ref = copy.deepcopy(net)
    fn, state = fdp.make_functional(net)
    x = torch.randn(5, 6)
    run = compiled(lambda s, x: fn(s, x))
    for _ in range(2):
        out, expected = run(state, x), ref(x)
        torch.testing.assert_close(out, expected)
        out.sum().backward()
        expected.sum().backward()
    assert net.calls == ref.calls == 2
    for (name, g), r in zip(grads(net).items(), grads(ref).values(), strict=True):
        torch.testing.assert_close(g, r, msg=name)


@pytest.mark.filterwarnings(
    "ignore:The .grad attribute of a Tensor that is not a leaf Tensor:UserWarning"
)
def test_compiled_call_with_a_graph_break_compiles_once() -> None:
    torch.manual_seed(0)
    net = Breaking()
    fn, state = fdp.make_functional(net)
    x = torch.randn(5, 6)
    run = compiled(lambda s, x: fn(s, x))
    counters = torch._dynamo.utils.counters
    for call in range(4):  # each call makes new shells: no recompile for them
        fresh = {k: v.detach().clone().requires_grad_() for k, v in state.items()}
        out, expected = run(fresh, x), net(x)
        torch.testing.assert_close(out, expected)
        got = torch.autograd.grad(out.sum(), list(fresh.values()))
        want = torch.autograd.grad(expected.sum(), list(net.parameters()))
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w)
        if call == 0:
            graphs = counters["stats"]["unique_graphs"]
            assert graphs >= 2  # the forward, in pieces: not run eagerly
    assert counters["stats"]["unique_graphs"] == graphs


def test_compiled_call_with_a_graph_break_refuses_under_fullgraph() -> None:
    net = Breaking()
    before = tables(net)
    fn, state = fdp.make_functional(net)
    with pytest.raises(torch._dynamo.exc.Unsupported, match="graph_break"):
        compiled(lambda s, x: fn(s, x), fullgraph=True)(state, torch.randn(5, 6))
    assert same_tables(tables(net), before)


def test_non_strict_export_of_a_call_matches_the_module() -> None:
    torch.manual_seed(0)
    net = Net().eval()
    fn, state = fdp.make_functional(net)
    new = {k: v.detach() * 0.5 for k, v in state.items()}
    ref = copy.deepcopy(net)
    ref.load_state_dict(new, strict=False)

    class Call(nn.Module):
        def forward(self, x: torch.Tensor) -> Any:
            return fn(new, x)

    x = torch.randn(5, 6)
    exported = torch.export.export(Call(), (x,), strict=False)
    torch.testing.assert_close(exported.module()(x), ref(x))
    x2 = torch.randn(5, 6, requires_grad=True)
    x3 = x2.detach().clone().requires_grad_()
    out, expected = exported.module()(x2), ref(x3)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    expected.sum().backward()
    torch.testing.assert_close(x2.grad, x3.grad)


def _transformed(
    fn: Callable[..., Any], state: dict[str, torch.Tensor], x: torch.Tensor, how: str
) -> Any:
    """``how`` of the call: its gradients (torch.func.grad, fdp.grad), a vmap, a jvp's tangent."""
    loss = lambda s: fn(s, x).square().mean()  # noqa: E731
    if how == "func_grad":
        return list(torch.func.grad(loss)(state).values())
    if how == "fdp_grad":
        return list(fdp.grad(loss)(state).values())
    if how == "vmap":
        return torch.func.vmap(lambda row: fn(state, row))(x)
    ones = {k: torch.ones_like(v) for k, v in state.items()}
    return torch.func.jvp(lambda s: fn(s, x), (state,), (ones,))[1]


@pytest.mark.filterwarnings(
    "ignore:The .grad attribute of a Tensor that is not a leaf Tensor:UserWarning"
)
@pytest.mark.parametrize("how", ["func_grad", "fdp_grad", "vmap", "jvp"])
def test_a_graph_broken_call_inside_compiled_transforms(how: str) -> None:
    # Dynamo runs a transform around a graph break eagerly: the call takes its eager shells.
    torch.manual_seed(0)
    net = Breaking()
    fn, state = fdp.make_functional(net)
    new = {k: v.detach() * 1.5 + 0.1 for k, v in state.items()}
    ref = copy.deepcopy(net)
    ref.load_state_dict(new)
    x = torch.randn(5, 6)
    # aot_eager: dynamo's "eager" backend fails on a graph break under
    # torch.func.grad (torch 2.13), for torch.func.functional_call alike.
    torch._dynamo.reset()
    run = torch.compile(lambda s, x: _transformed(fn, s, x, how), backend="aot_eager")
    got = run(new, x)
    # The reference: torch's own functional_call on a copy, eager.
    expected = _transformed(lambda s, x: torch.func.functional_call(ref, s, (x,)), new, x, how)
    torch.testing.assert_close(got, expected)
