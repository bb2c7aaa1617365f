"""data_parallel and make_functional against one direct call on the whole batch."""

from __future__ import annotations

import copy
import gc
import inspect
import threading
from typing import Any, cast

import optree
import pytest
import torch
from torch import nn

import fdp
from tests.helpers import (
    Pair,
    detached_copy,
    fake,
    label,
    mlp_params,
    plain,
    tensor_leaves,
    tree_allclose,
)


def make_params(seed: int = 0) -> dict[str, Any]:
    """The shared MLP with a head bias, a None leaf and a buffer that needs no grad."""
    params = mlp_params(seed, inputs=5, head_bias=True)
    return {**params, "unused_bias": None, "frozen": torch.ones(8)}


def model(
    p: dict[str, Any],
    batch: dict[str, Any],
    mask: torch.Tensor,
    k: int,
    *,
    scale: float = 1.0,
    offset: torch.Tensor | None = None,
) -> dict[str, Any]:
    h = batch["x"]
    for layer in p["layers"]:
        h = torch.tanh(h @ layer["w"] + layer["b"]) * p["frozen"]
    logits = h @ p["head"].first + p["head"].second
    if offset is not None:
        logits = logits + offset[:, None]
    return {
        "logits": logits * scale,
        "masked": Pair((logits * mask[:, None]).sum(1), None),
        "k": k,
        "tag": batch["tag"],
    }


def make_batch(n: int, seed: int = 1) -> tuple[tuple[Any, ...], dict[str, Any]]:
    g = torch.Generator().manual_seed(seed)
    inputs = ({"x": torch.randn(n, 5, generator=g), "tag": "digits"}, torch.rand(n, generator=g), 7)
    return inputs, {"scale": 0.5, "offset": torch.randn(n, generator=g)}


def loss_of(out: dict[str, Any]) -> torch.Tensor:
    logits: torch.Tensor = out["logits"]
    masked: torch.Tensor = out["masked"].first
    return (logits**2).sum() + masked.sum()


def assert_same_grads(out: Any, params: Any, ref: Any, ref_params: Any, **tol: float) -> None:
    """Backpropagates loss_of through both; every params leaf's grad equals the reference's."""
    torch.autograd.backward(loss_of(out))
    torch.autograd.backward(loss_of(ref))
    for got, want in zip(tensor_leaves(params), tensor_leaves(ref_params), strict=True):
        if not want.requires_grad:
            assert got.grad is None
            continue
        assert got.grad is not None
        assert want.grad is not None
        assert got.grad.device == got.device
        torch.testing.assert_close(
            got.grad.cpu(), want.grad, rtol=tol.get("rtol"), atol=tol.get("atol")
        )


@pytest.mark.parametrize("batch", [7, 2])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_outputs_and_grads_match_one_call(n: int, batch: int) -> None:
    params = make_params()
    ref_params = detached_copy(params)
    inputs, kwargs = make_batch(batch)
    out = fdp.data_parallel(model, params, inputs, devices=["cpu"] * n, kwargs=kwargs)
    ref = model(ref_params, *inputs, **kwargs)
    tree_allclose(out, ref)
    assert_same_grads(out, params, ref, ref_params)


@pytest.mark.parametrize("api", ["autograd.grad", "func.grad", "func.grad_and_value"])
def test_grads_through_functional_apis(api: str) -> None:
    params = make_params()
    params.pop("unused_bias")  # torch.func.grad refuses None in its argument
    params.pop("frozen")
    params["frozen"] = torch.ones(8)
    inputs, kwargs = make_batch(9)

    def loss(p: dict[str, Any], parallel: bool) -> torch.Tensor:
        if parallel:
            out = fdp.data_parallel(model, p, inputs, devices=["cpu"] * 3, kwargs=kwargs)
        else:
            out = model(p, *inputs, **kwargs)
        return loss_of(out)

    trainable = {k: v for k, v in params.items() if k != "frozen"}

    def split_loss(t: dict[str, Any], parallel: bool) -> torch.Tensor:
        return loss({**t, "frozen": params["frozen"]}, parallel)

    expected = torch.func.grad(split_loss)(detached_copy(trainable), False)
    if api == "autograd.grad":
        flat = tensor_leaves(trainable)
        got_flat = torch.autograd.grad(split_loss(trainable, True), flat)
        for g, e in zip(got_flat, tensor_leaves(expected), strict=True):
            torch.testing.assert_close(g, e)
        return
    if api == "func.grad":
        got = torch.func.grad(split_loss)(detached_copy(trainable), True)
    else:
        got, value = torch.func.grad_and_value(split_loss)(detached_copy(trainable), True)
        torch.testing.assert_close(value, split_loss(trainable, False))
    tree_allclose(got, expected)


def test_scalar_outputs_become_one_entry_per_replica() -> None:
    params = make_params()
    inputs, kwargs = make_batch(6)

    def summed(p: Any, *args: Any, **kw: Any) -> torch.Tensor:
        return loss_of(model(p, *args, **kw))

    with pytest.warns(UserWarning, match="one entry per replica"):
        per_replica = fdp.data_parallel(summed, params, inputs, devices=["cpu"] * 3, kwargs=kwargs)
    assert per_replica.shape == (3,)
    torch.testing.assert_close(per_replica.sum(), summed(params, *inputs, **kwargs))


def test_output_device_and_dim() -> None:
    params = {"w": torch.randn(4, 4, requires_grad=True)}
    x = torch.randn(3, 10, 4)  # batch along dim 1

    def fn(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return x @ p["w"]

    out = fdp.data_parallel(fn, params, x, devices=["cpu"] * 4, output_device=-1, dim=1)
    torch.testing.assert_close(out, fn(params, x))


def test_replicas_returning_different_structures() -> None:
    def fn(p: Any, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"big": x} if x.shape[0] > 2 else {"small": x}

    with pytest.raises(
        ValueError,
        match=r"fdp.data_parallel: `outputs` replicas returned different structures; "
        r"expected \(replica 0\) PyTreeSpec\(\{'big': \*\}.*got \(replica 1\) "
        r"PyTreeSpec\(\{'small'",
    ):
        fdp.data_parallel(fn, {}, torch.ones(5), devices=["cpu", "cpu"])


def test_errors_name_data_parallel() -> None:
    with pytest.raises(ValueError, match=r"fdp.data_parallel: `devices` expected at least one"):
        fdp.data_parallel(model, {}, torch.ones(2), devices=[])
    with pytest.raises(TypeError, match=r"fdp.data_parallel: `output_device` expected"):
        fdp.data_parallel(model, {}, torch.ones(2), devices=["cpu"], output_device=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"fdp.data_parallel: `dim` is out of range for leaf"):
        fdp.data_parallel(model, {}, torch.ones(2), devices=["cpu"], dim=3)


def test_fake_devices_place_everything_and_reduce_grads() -> None:
    cpu_params = {
        "w": torch.randn(5, 3, requires_grad=True),
        "b": torch.randn(3, requires_grad=True),
    }
    params = label(cpu_params, 0)
    x = torch.randn(8, 5)

    def fn(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ p["w"] + p["b"])

    out = fdp.data_parallel(fn, params, label(x, 0), devices=[fake(0), fake(1), fake(2)])
    ref = fn(cpu_params, x)
    assert out.device == fake(0)
    torch.testing.assert_close(plain(out), ref)
    grads = torch.autograd.grad((out**2).sum(), [params["w"], params["b"]])
    ref_grads = torch.autograd.grad((ref**2).sum(), [cpu_params["w"], cpu_params["b"]])
    for g, e in zip(grads, ref_grads, strict=True):
        assert g.device == fake(0)
        torch.testing.assert_close(plain(g), e)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_devices_match_cpu_reference() -> None:
    params = make_params()
    on_cuda = optree.tree_map(
        lambda t: (
            t.detach().cuda().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
        ),
        cast(Any, params),
        none_is_leaf=True,
    )
    inputs, kwargs = make_batch(11)  # on the CPU: scatter moves each chunk
    devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())] * 2
    out = fdp.data_parallel(model, on_cuda, inputs, devices=devices, kwargs=kwargs)
    ref = model(params, *inputs, **kwargs)
    assert out["logits"].device == torch.device("cuda", 0)
    torch.testing.assert_close(out["logits"].cpu(), ref["logits"], rtol=1e-4, atol=1e-5)
    assert_same_grads(out, on_cuda, ref, params, rtol=1e-4, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_cuda_replicate_across_devices() -> None:
    w = torch.randn(100, 10, device="cuda:0", requires_grad=True)
    a, b = fdp.replicate({"w": w}, ["cuda:0", "cuda:1"])
    assert a["w"] is w
    assert b["w"].device == torch.device("cuda", 1)
    (a["w"].sum() + (b["w"] * 2).sum()).backward()
    assert w.grad is not None
    torch.testing.assert_close(w.grad, torch.full_like(w, 3.0))


# --- make_functional --------------------------------------------------------


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
