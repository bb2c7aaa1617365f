"""make_functional against the module itself: outputs, gradients, state, hooks, threads."""

from __future__ import annotations

import copy
import gc
import inspect
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar, cast

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import fdp
from tests.helpers import fake, label, plain


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(6, 6)
        self.norm = nn.BatchNorm1d(6)
        self.body = nn.Sequential(nn.Linear(6, 6), nn.Tanh())
        self.decoder = nn.Linear(6, 6)
        self.decoder.weight = self.encoder.weight  # tied

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        return self.decoder(self.body(self.norm(self.encoder(x)))) * scale  # type: ignore[no-any-return]


def test_make_functional_state_is_the_modules_own() -> None:
    net = Net()
    fn, state = fdp.make_functional(net)
    assert state["encoder.weight"] is net.encoder.weight
    assert "decoder.weight" not in state  # tied: named once, as named_parameters does
    assert state["norm.running_mean"] is net.norm.running_mean
    x = torch.randn(5, 6)
    net.eval()
    torch.testing.assert_close(fn(state, x, scale=2.0), net(x, scale=2.0))


@pytest.mark.parametrize("n", [1, 2, 3])
def test_make_functional_with_data_parallel_matches_module(n: int) -> None:
    net = Net().eval()
    ref_net = copy.deepcopy(net)
    fn, state = fdp.make_functional(net)
    x = torch.randn(9, 6)
    out = fdp.data_parallel(fn, state, x, devices=["cpu"] * n, kwargs={"scale": 3.0})
    ref = ref_net(x, scale=3.0)
    torch.testing.assert_close(out, ref)
    torch.autograd.backward(out.pow(2).sum())
    torch.autograd.backward(ref.pow(2).sum())
    for (name, p), (_, q) in zip(net.named_parameters(), ref_net.named_parameters(), strict=True):
        assert p.grad is not None, name
        assert q.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def bn_steps(devices: list[Any], steps: int) -> tuple[Net, list[torch.Tensor]]:
    torch.manual_seed(0)
    net = Net().train()
    fn, state = fdp.make_functional(net)
    outs = []
    for step in range(steps):
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(step))
        outs.append(fdp.data_parallel(fn, state, x, devices=devices).detach())
    return net, outs


@pytest.mark.parametrize("mode", ["loop", "threads"])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_batchnorm_state_takes_replica_zeros_update(
    n: int, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Train-mode BatchNorm: each chunk normalised by its own statistics, one update per step."""
    if mode == "threads":  # one intra-op thread: CPU replicas run on fdp's workers
        monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    steps = 5
    net, outs = bn_steps(["cpu"] * n, steps)
    torch.manual_seed(0)
    ref_net = Net().train()
    sizes = [len(c) for c in torch.arange(8).tensor_split(n)]
    for step in range(steps):
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(step))
        chunks = torch.split(x, sizes)
        # Every chunk normalised with its own batch statistics ...
        ref = [copy.deepcopy(ref_net)(c) for c in chunks[1:]]
        # ... and the state updated once, by replica 0's chunk (DataParallel's rule).
        ref.insert(0, ref_net(chunks[0]))
        torch.testing.assert_close(outs[step], torch.cat(ref).detach())
    norm, ref_norm = net.norm, ref_net.norm
    assert int(cast(torch.Tensor, norm.num_batches_tracked)) == steps
    torch.testing.assert_close(norm.running_mean, ref_norm.running_mean)
    torch.testing.assert_close(norm.running_var, ref_norm.running_var)
    # The same every run.
    again, _ = bn_steps(["cpu"] * n, steps)
    assert again.norm.running_mean is not None
    assert norm.running_mean is not None
    assert torch.equal(again.norm.running_mean, norm.running_mean)


def test_batchnorm_state_written_back_from_another_device() -> None:
    """Replica 0 on another device than the buffers: its update still reaches them."""
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(3).train()
    fn, state = fdp.make_functional(bn)
    ref = copy.deepcopy(bn)
    x = torch.randn(6, 3)
    labelled = label(state, 0)
    out = fdp.data_parallel(fn, labelled, label(x, 1), devices=[fake(1), fake(0)])
    ref_out = torch.cat([ref(x[:3]), copy.deepcopy(ref)(x[3:])])
    torch.testing.assert_close(plain(out).cpu(), ref_out.detach())
    torch.testing.assert_close(plain(labelled["running_mean"]), ref.running_mean)
    assert int(plain(labelled["num_batches_tracked"])) == 1


def test_make_functional_is_thread_safe() -> None:
    net = Net().eval()
    snapshot = {k: (v, v.detach().clone()) for k, v in net.state_dict(keep_vars=True).items()}
    fn, state = fdp.make_functional(net)
    n_threads, repeats = 8, 60
    states = [
        {k: (v.detach() * (1 + 0.1 * t)).requires_grad_(v.requires_grad) for k, v in state.items()}
        for t in range(n_threads)
    ]
    xs = [torch.randn(4, 6, generator=torch.Generator().manual_seed(t)) for t in range(n_threads)]
    # References computed up front on private deep copies, one thread.
    refs = []
    for s, x in zip(states, xs, strict=True):
        ref_net = copy.deepcopy(net)
        ref_net.load_state_dict({k: v.detach() for k, v in s.items()}, strict=False)
        out = ref_net(x)
        grads = torch.autograd.grad(out.sum(), list(ref_net.parameters()))
        refs.append((out.detach(), grads))
    failures: list[BaseException] = []
    start = threading.Barrier(n_threads, timeout=30)

    def hammer(t: int) -> None:
        try:
            start.wait()
            params = [v for v in states[t].values() if v.requires_grad]
            for _ in range(repeats):
                out = fn(states[t], xs[t])
                grads = torch.autograd.grad(out.sum(), params)
                torch.testing.assert_close(out, refs[t][0])
                for g, e in zip(grads, refs[t][1], strict=True):
                    torch.testing.assert_close(g, e)
        except BaseException as err:  # reported in the main thread
            failures.append(err)

    threads = [threading.Thread(target=hammer, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not any(th.is_alive() for th in threads), "a thread hung"
    assert not failures, failures[0]
    # The module is intact: same tensor objects, same values, no grads attached.
    for k, (obj, value) in snapshot.items():
        now = net.state_dict(keep_vars=True)[k]
        assert now is obj, k
        torch.testing.assert_close(now, value)
    assert all(p.grad is None for p in net.parameters())


def test_make_functional_rejects_non_modules() -> None:
    with pytest.raises(
        TypeError, match=r"fdp.make_functional: `module` expected a torch.nn.Module"
    ):
        fdp.make_functional(lambda x: x)  # type: ignore[arg-type]


class Flagged(nn.Module):
    """Reads a mode flag, a Dropout and a user attribute in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.drop = nn.Dropout(0.5)
        self.norm = nn.BatchNorm1d(6)
        self.gain = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.drop(self.lin(x))) * self.gain  # type: ignore[no-any-return]


@pytest.mark.parametrize("where", ["direct", "cpu", "threads"])
def test_make_functional_sees_mode_and_attribute_changes(where: str) -> None:
    net = Flagged()
    fn, state = fdp.make_functional(net)
    x = torch.randn(8, 6)

    def run() -> torch.Tensor:
        if where == "direct":
            return fn(state, x)  # type: ignore[no-any-return]
        if where == "cpu":
            return fdp.data_parallel(fn, state, x, devices=["cpu"])  # type: ignore[no-any-return]
        # Fake devices: replicas on worker threads; the output is checked on one chunk.
        return fdp.parallel_apply(fn, [state, state], [(x,), (x,)], None, [fake(0), fake(1)])[1]  # type: ignore[no-any-return]

    run()  # the first call (a thread's shell used to freeze the module here)
    net.eval()
    net.gain = 3.0
    with torch.no_grad():
        torch.testing.assert_close(run(), net(x))  # no dropout, running statistics, gain 3
        net.drop.p = 0.0
        net.train()
        ref = copy.deepcopy(net)(x)  # train mode again: batch statistics, p = 0
        torch.testing.assert_close(run(), ref)


def test_make_functional_leaves_no_garbage() -> None:
    net = Net()
    fn, state = fdp.make_functional(net)
    x = torch.randn(4, 6)
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)  # keep what the collector finds, to look at it
    try:
        for _ in range(3):
            torch.autograd.backward(fn(state, x).sum())
        gc.collect()
        # Other tests' machinery may leave cycles of its own (dynamo's graph
        # modules, functions without a module); fdp's would hold module
        # shells or fdp functions.
        leaked = [
            o
            for o in gc.garbage
            if (isinstance(o, nn.Module) and not isinstance(o, torch.fx.GraphModule))
            or (inspect.isfunction(o) and (o.__module__ or "").startswith("fdp"))
        ]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert leaked == [], "make_functional left reference cycles behind"


def test_make_functional_refuses_uninitialized_lazy_modules() -> None:
    net = nn.Sequential(nn.LazyLinear(4), nn.ReLU())
    with pytest.raises(
        ValueError,
        match=r"fdp.make_functional: `module` has an uninitialized lazy tensor '0.weight' "
        r"\(LazyLinear\); expected initialized .* Run the module once on a sample batch",
    ):
        fdp.make_functional(net)
    net(torch.randn(2, 3))  # initialised: now it works, and matches the module
    fn, state = fdp.make_functional(net)
    x = torch.randn(5, 3)
    torch.testing.assert_close(fdp.data_parallel(fn, state, x, devices=["cpu", "cpu"]), net(x))


# --- Python state the forward changes ----------------------------------------


class Toggle(nn.Module):
    """Picks its branch from a flag it flips, counts its calls, caches a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        self.flag = True
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if "cache" not in self._buffers:  # as rotary-embedding caches are built
            self.register_buffer("cache", torch.full((6,), 2.0), persistent=False)
        layer = self.a if self.flag else self.b
        self.flag = not self.flag
        self.calls += 1
        return layer(x) * self.cache  # type: ignore[no-any-return]


def toggle_steps(run: Any, net: Toggle, steps: int) -> list[torch.Tensor]:
    outs = []
    for step in range(steps):
        x = torch.randn(6, 6, generator=torch.Generator().manual_seed(step))
        out = run(x)
        out.square().sum().backward()
        outs.append(out.detach())
    return outs


@pytest.mark.parametrize(
    "where", ["direct", "dp1", "dp2-loop", "dp3-loop", "dp2-threads", "dp3-threads", "apply"]
)
def test_attribute_changes_reach_the_module_once_per_call(
    where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As ``module(x)``: every replica takes the branch the module chose, the change lands once."""
    if where.endswith("threads"):  # one intra-op thread: CPU replicas run on fdp's workers
        monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    torch.manual_seed(0)
    net = Toggle()
    ref = copy.deepcopy(net)
    fn, state = fdp.make_functional(net)

    def run(x: torch.Tensor) -> torch.Tensor:
        if where == "direct":
            return cast(torch.Tensor, fn(state, x))
        if where == "apply":
            return torch.cat(fdp.parallel_apply(fn, [state, state], [(x[:3],), (x[3:],)]))
        devices = ["cpu"] * int(where[2])
        return cast(torch.Tensor, fdp.data_parallel(fn, state, x, devices=devices))

    outs = toggle_steps(run, net, 4)
    ref_outs = toggle_steps(ref, ref, 4)
    for got, want in zip(outs, ref_outs, strict=True):
        torch.testing.assert_close(got, want)
    assert (net.flag, net.calls) == (ref.flag, ref.calls) == (True, 4)
    torch.testing.assert_close(net.get_buffer("cache"), ref.get_buffer("cache"))
    assert net.state_dict().keys() == ref.state_dict().keys()  # the cache stays non-persistent
    for (name, p), q in zip(net.named_parameters(), ref.parameters(), strict=True):
        assert p.grad is not None, name
        assert q.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_a_replica_that_raises_leaves_the_module_unchanged() -> None:
    net = Toggle()
    fn, state = fdp.make_functional(net)
    bad = torch.randn(2, 5)  # the wrong width for replica 1
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        fdp.parallel_apply(fn, [state, state], [(torch.randn(2, 6),), (bad,)])
    assert (net.flag, net.calls) == (True, 0)  # as DataParallel: nothing of a failed call lands


M = TypeVar("M", bound=nn.Module)


def with_reference(make: Callable[[], M]) -> tuple[M, M, Any, dict[str, torch.Tensor]]:
    """A seeded module, a deep copy of it to call directly, and the module's function and state."""
    torch.manual_seed(0)
    net = make()
    reference = copy.deepcopy(net)
    fn, state = fdp.make_functional(net)
    return net, reference, fn, state


def call_where(where: str, fn: Any, state: dict[str, torch.Tensor], x: torch.Tensor) -> Any:
    """``fn(state, x)``: directly, over two CPU replicas ("dp2"), or on halves ("apply")."""
    if where == "direct":
        return fn(state, x)
    if where == "dp2":
        return fdp.data_parallel(fn, state, x, devices=["cpu", "cpu"])
    half = x.shape[0] // 2
    outs = fdp.parallel_apply(fn, [state, state], [(x[:half],), (x[half:],)])
    if isinstance(outs[0], torch.Tensor):
        return torch.cat(outs)
    return tuple(torch.cat(parts) for parts in zip(*outs, strict=True))


def assert_same_grads(
    net: nn.Module, reference: nn.Module, loss: torch.Tensor, reference_loss: torch.Tensor
) -> None:
    """Both losses' gradients, on ``net``'s and ``reference``'s parameters, agree."""
    torch.autograd.backward(loss)
    torch.autograd.backward(reference_loss)
    for (name, p), q in zip(net.named_parameters(), reference.parameters(), strict=True):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, msg=name)


class Renaming(nn.Module):
    """Moves a value from one attribute to a new one: same value, same place, new name."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.first: object = ("a", "value")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "first"):
            value = self.first
            del self.first
            self.second = value
        return cast(torch.Tensor, self.lin(x))


@pytest.mark.parametrize("where", ["direct", "dp2"])
def test_a_renamed_attribute_reaches_the_module(where: str) -> None:
    # The shell's dict keeps its length and its values in order: only the key tells.
    net, ref, fn, state = with_reference(Renaming)
    x = torch.randn(4, 3)
    torch.testing.assert_close(call_where(where, fn, state, x), ref(x))
    assert not hasattr(net, "first")
    assert not hasattr(ref, "first")
    assert net.second == ref.second == ("a", "value")
    assert list(vars(net)) == list(vars(ref))


class Checkpointed(nn.Module):
    """Non-reentrant activation checkpointing inside the module's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(6, 6)
        self.l2 = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.l1, x, use_reentrant=False)
        return cast(torch.Tensor, checkpoint(self.l2, torch.tanh(h), use_reentrant=False))


@pytest.mark.parametrize("where", ["direct", "dp2"])
def test_checkpoint_recomputes_with_the_calls_tensors(where: str) -> None:
    """Backward's recomputation sees the tensors of ``state``, not the module's own."""
    torch.manual_seed(0)
    net = Checkpointed()
    fn, state = fdp.make_functional(net)
    other = {k: (v.detach() * 2 + 0.5).requires_grad_() for k, v in state.items()}
    ref = copy.deepcopy(net)
    with torch.no_grad():
        for k, v in ref.named_parameters():
            v.copy_(other[k])
    x = torch.randn(4, 6)
    if where == "direct":
        out = fn(other, x)
    else:
        out = fdp.data_parallel(fn, other, x, devices=["cpu", "cpu"])
    out.square().sum().backward()
    want = ref(x)
    want.square().sum().backward()
    torch.testing.assert_close(out, want)
    for k, q in ref.named_parameters():
        assert other[k].grad is not None, k
        torch.testing.assert_close(other[k].grad, q.grad, msg=k)
    assert all(p.grad is None for p in net.parameters())


def test_state_names_and_ties_are_checked() -> None:
    net = Net().eval()
    fn, state = fdp.make_functional(net)
    x = torch.randn(3, 6)
    with pytest.raises(
        ValueError, match=r"fdp.make_functional: `state` leaf 'encoder.wieght' expected a name"
    ):
        fn({**state, "encoder.wieght": state["encoder.weight"]}, x)
    with pytest.raises(
        TypeError, match=r"fdp.make_functional: `state` leaf 'norm.eps' expected a tensor or None"
    ):
        fn({"norm.eps": 1e-3}, x)
    other = torch.randn(6, 6)
    with pytest.raises(
        ValueError,
        match=r"`state` leaves 'encoder.weight' and 'decoder.weight' expected one tensor "
        r"\(they are tied",
    ):
        fn({"encoder.weight": state["encoder.weight"], "decoder.weight": other}, x)
    # One tensor for a tied pair replaces it under both names, as load_state_dict does.
    ref = copy.deepcopy(net)
    ref.load_state_dict({**ref.state_dict(), "encoder.weight": other, "decoder.weight": other})
    assert ref.decoder.weight is ref.encoder.weight
    torch.testing.assert_close(fn({**state, "encoder.weight": other}, x), ref(x))
    rest = {k: v for k, v in state.items() if k != "encoder.weight"}
    torch.testing.assert_close(fn({**rest, "decoder.weight": other}, x), ref(x))


# --- hooks (torch's test_ddp_forward_backward_hook, and more) ----------------


def triple(grads: Any) -> tuple[torch.Tensor, ...]:
    return (grads[0] * 3, *grads[1:])


def celu(grads: Any) -> tuple[torch.Tensor, ...]:
    return (nn.functional.celu(grads[0]), *grads[1:])


def hooked(seen: list[str]) -> nn.Sequential:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 2))
    fc = net[0]
    fc.register_forward_pre_hook(lambda m, args: (nn.functional.relu(args[0]),))
    fc.register_forward_hook(lambda m, args, out: nn.functional.gelu(out))
    net[2].register_full_backward_pre_hook(lambda m, go: triple(go))
    net[2].register_full_backward_hook(lambda m, gi, go: seen.append(type(m).__name__))
    return net


@pytest.mark.filterwarnings("ignore:Using a non-full backward hook:FutureWarning")  # torch's own
def test_hooks_run_and_change_values_as_on_the_module() -> None:
    seen: list[str] = []
    net, ref = hooked(seen), hooked([])
    # A deprecated, non-full backward hook: torch refers to its module weakly.
    for m in (net[0], ref[0]):
        m.register_backward_hook(lambda m, gi, go: celu(gi))
    fn, state = fdp.make_functional(net)
    x = torch.rand(5, 2)
    out = fdp.data_parallel(fn, state, x, devices=["cpu", "cpu"])
    want = ref(x)
    torch.testing.assert_close(out, want)
    out.sum().backward()
    want.sum().backward()
    assert seen == ["Linear", "Linear"]  # once per replica
    for (name, p), q in zip(net.named_parameters(), ref.parameters(), strict=True):
        assert p.grad is not None, name
        assert q.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, msg=name)


@pytest.mark.filterwarnings("ignore:Using a non-full backward hook:FutureWarning")  # torch's own
def test_a_non_full_backward_hook_keeps_its_shell_only_as_long_as_the_graph() -> None:
    net = nn.Linear(3, 3)
    shells: list[weakref.ref[nn.Module]] = []
    net.register_backward_hook(lambda m, gi, go: shells.append(weakref.ref(m)))
    fn, state = fdp.make_functional(net)
    out = fn(state, torch.randn(2, 3))
    out.sum().backward()  # before: "You are trying to call the hook of a dead Module!"
    assert len(shells) == 1
    assert shells[0]() is not None  # the graph still holds it
    del out
    assert shells[0]() is None  # freed by reference counting: no cycle is left


class Recording(nn.Module):
    """Installs an output-recording hook on its first call, as Hugging Face models do
    for ``output_hidden_states`` (a flag, then a hook appending to a list)."""

    def __init__(self, *, fail_above: float | None = None) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)
        self.installed = False
        self.fail_above = fail_above

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if not self.installed:
            self.a.register_forward_hook(lambda m, i, o: m.outputs.append(o))
            self.installed = True
        if self.fail_above is not None and float(x.max()) > self.fail_above:
            raise ValueError("this chunk fails")
        recorded: list[torch.Tensor] = []
        self.a.outputs = recorded  # type: ignore[assignment]  # a plain attribute, as HF's
        out = self.b(torch.relu(self.a(x)))
        return (out, *recorded)


@pytest.mark.parametrize("where", ["direct", "dp2", "apply"])
def test_a_call_changes_a_module_as_one_direct_call_does(where: str) -> None:
    # Before: the replicas shared the module's hook dicts, so each installed the
    # hook ("replicas returned different structures") and the module kept two.
    # A direct call shares them (the hook lands on the module at once).
    net, reference, fn, state = with_reference(Recording)
    x = torch.randn(6, 4)
    out = call_where(where, fn, state, x)
    want = reference(x)
    assert len(out) == len(want) == 2
    for got, expected in zip(out, want, strict=True):
        torch.testing.assert_close(got, expected)
    assert_same_grads(net, reference, sum(o.sum() for o in out), sum(o.sum() for o in want))
    assert len(net.a._forward_hooks) == 1
    assert net.installed
    for got, expected in zip(net(x), reference(x), strict=True):  # later direct calls agree
        torch.testing.assert_close(got, expected)


def test_a_direct_call_that_raises_leaves_what_a_module_call_leaves() -> None:
    # The hook and the flag set before the failure stay, as after a failed module(x).
    torch.manual_seed(0)
    net = Recording(fail_above=0.0)
    reference = copy.deepcopy(net)
    fn, state = fdp.make_functional(net)
    x = torch.full((3, 4), 1.0)
    with pytest.raises(ValueError, match="this chunk fails"):
        fn(state, x)
    with pytest.raises(ValueError, match="this chunk fails"):
        reference(x)
    assert len(net.a._forward_hooks) == len(reference.a._forward_hooks) == 1
    assert net.installed is reference.installed is True  # so the next call installs none
    y = torch.full((3, 4), -1.0)
    out, want = fn(state, y), reference(y)
    assert len(out) == len(want) == 2  # the one hook recorded once
    for got, expected in zip(out, want, strict=True):
        torch.testing.assert_close(got, expected)
    assert_same_grads(net, reference, sum(o.sum() for o in out), sum(o.sum() for o in want))


def test_a_data_parallel_call_that_raises_changes_nothing() -> None:
    torch.manual_seed(0)
    net = Recording(fail_above=0.0)
    fn, state = fdp.make_functional(net)
    x = torch.cat([torch.full((3, 4), -1.0), torch.full((3, 4), 1.0)])  # replica 1 raises
    with pytest.raises(ValueError, match="this chunk fails"):
        fdp.data_parallel(fn, state, x, devices=["cpu", "cpu"])
    assert len(net.a._forward_hooks) == 0
    assert not net.installed


class Counted(nn.Module):
    """No tensors of its own or below: counts its calls (a plain attribute)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.tanh(x)


class WithBare(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.act = nn.Sequential(Counted(), nn.Dropout(0.0))  # a subtree without tensors
        self.b = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.act(self.a(x)))  # type: ignore[no-any-return]


@pytest.mark.parametrize("where", ["direct", "dp2", "apply"])
def test_a_subtree_without_tensors_runs_as_itself_outside_a_replica(where: str) -> None:
    # Directly, the module itself runs there, as in net(x): its hooks see it. A
    # replica's runs on a shell (as every module with tensors), so that the
    # module changes once, with replica 0's changes.
    net, reference, fn, state = with_reference(WithBare)
    seen: dict[str, list[nn.Module]] = {"a": [], "counted": []}
    net.a.register_forward_hook(lambda m, i, o: seen["a"].append(m))
    net.act[0].register_forward_hook(lambda m, i, o: seen["counted"].append(m))
    x = torch.randn(6, 4)
    out, want = call_where(where, fn, state, x), reference(x)
    torch.testing.assert_close(out, want)
    assert_same_grads(net, reference, out.square().sum(), want.square().sum())
    assert net.act[0].calls == reference.act[0].calls == 1
    assert len(seen["counted"]) == len(seen["a"]) == (1 if where == "direct" else 2)
    assert all(m is not net.a for m in seen["a"])  # shells, whatever the call
    ran_itself = [m is net.act[0] for m in seen["counted"]]
    assert ran_itself == ([True] if where == "direct" else [False, False])
