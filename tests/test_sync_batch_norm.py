"""fdp.sync_batch_norm against batch norm on the concatenated global batch.

Every rank holds a slice of one global batch (of different sizes, 0
included) and a slice of a fixed output gradient. The reference is
``F.batch_norm`` on the whole batch in one process: outputs, input
gradients and running statistics per rank, and the weight and bias
gradients as the sum of every rank's share.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import fdp
from tests import ranks
from tests.helpers import TOL

C = 4
SPATIAL = {"1d": (), "1d_length": (3,), "2d": (2, 3), "3d": (2, 2, 2)}
SIZES = {2: [5, 3], 3: [4, 0, 3]}


# (spread, centre) of x: "far" channels have a mean a thousand times their spread.
KINDS = {"near": (2.0, 1.0), "far": (1.0, 1000.0)}


def problem(spatial: tuple[int, ...], total: int, kind: str = "near") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    spread, centre = KINDS[kind]
    return {
        "x": torch.randn(total, C, *spatial, generator=g) * spread + centre,
        "dy": torch.randn(total, C, *spatial, generator=g),
        "w": torch.randn(C, generator=g),
        "b": torch.randn(C, generator=g),
    }


def my_slice(rank: int, size: int) -> slice:
    sizes = SIZES[size]
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def _sync_bn(rank: int, size: int, spatial: tuple[int, ...], how: str, kind: str) -> dict[str, Any]:
    torch._dynamo.reset()
    p = problem(spatial, sum(SIZES[size]), kind)
    x, dy = p["x"][my_slice(rank, size)].clone(), p["dy"][my_slice(rank, size)]
    w, b = p["w"].clone().requires_grad_(), p["b"].clone().requires_grad_()
    rm, rv = torch.zeros(C), torch.ones(C)

    def loss(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        y = fdp.sync_batch_norm(x, rm, rv, w, b, momentum=0.2)
        return (y * dy).sum()

    if how == "func.grad":
        dx, dw, db = torch.func.grad(loss, argnums=(0, 1, 2))(x, w, b)
    else:
        x.requires_grad_()
        fn = torch.compile(loss, backend="aot_eager", fullgraph=True) if how == "compile" else loss
        torch.autograd.backward(fn(x, w, b))
        dx, dw, db = x.grad, w.grad, b.grad
    with torch.no_grad():
        y = fdp.sync_batch_norm(x.detach(), None, None, p["w"], p["b"])
    # func.grad's results depend on w and b, which require grad out here.
    out = {"y": y, "dx": dx, "dw": dw, "db": db, "rm": rm, "rv": rv}
    return {k: v.detach() for k, v in out.items()}


def reference(spatial: tuple[int, ...], size: int, kind: str) -> dict[str, torch.Tensor]:
    p = problem(spatial, sum(SIZES[size]), kind)
    x = p["x"].clone().requires_grad_()
    w, b = p["w"].clone().requires_grad_(), p["b"].clone().requires_grad_()
    rm, rv = torch.zeros(C), torch.ones(C)
    y = F.batch_norm(x, rm, rv, w, b, training=True, momentum=0.2, eps=1e-5)
    torch.autograd.backward((y * p["dy"]).sum())
    assert x.grad is not None
    assert w.grad is not None
    assert b.grad is not None
    return {"y": y.detach(), "dx": x.grad, "dw": w.grad, "db": b.grad, "rm": rm, "rv": rv}


@pytest.mark.parametrize("spatial", list(SPATIAL), ids=list(SPATIAL))
@pytest.mark.parametrize("size", [2, 3])
def test_matches_batch_norm_on_the_global_batch(spatial: str, size: int) -> None:
    check(SPATIAL[spatial], size, "backward")


@pytest.mark.parametrize("how", ["func.grad", pytest.param("compile", marks=pytest.mark.compile)])
def test_under_func_grad_and_compile(how: str) -> None:
    check(SPATIAL["2d"], 3, how)


# Per rank, the batches of one compiled loss: sizes that change make dynamo
# compile a symbolic batch size (the second one), which the statistics take.
BATCHES = ([5, 3], [4, 2], [3, 4], [6, 1])


def _compiled_batches(rank: int, size: int) -> list[dict[str, torch.Tensor]]:
    torch._dynamo.reset()
    rm, rv = torch.zeros(C), torch.ones(C)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def loss(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, dy: torch.Tensor) -> Any:
        return (fdp.sync_batch_norm(x, rm, rv, w, b, momentum=0.2) * dy).sum()

    out = []
    for sizes in BATCHES:
        p = problem(SPATIAL["2d"], sum(sizes))
        part = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
        x = p["x"][part].clone().requires_grad_()
        w, b = p["w"].clone().requires_grad_(), p["b"].clone().requires_grad_()
        value = loss(x, w, b, p["dy"][part])
        torch.autograd.backward(value)
        grads = {"dx": x.grad, "dw": w.grad, "db": b.grad}
        out.append({"loss": value.detach(), "rm": rm.clone(), "rv": rv.clone(), **grads})
    return out


@pytest.mark.compile
def test_compiled_batches_of_changing_sizes_match_the_global_batch() -> None:
    results = ranks.world(2).run(_compiled_batches)
    rm, rv = torch.zeros(C), torch.ones(C)
    for step, sizes in enumerate(BATCHES):
        p = problem(SPATIAL["2d"], sum(sizes))
        x = p["x"].clone().requires_grad_()
        w, b = p["w"].clone().requires_grad_(), p["b"].clone().requires_grad_()
        loss = (F.batch_norm(x, rm, rv, w, b, training=True, momentum=0.2) * p["dy"]).sum()
        torch.autograd.backward(loss)
        mine = [r[step] for r in results]
        torch.testing.assert_close(sum(r["loss"] for r in mine), loss.detach(), **TOL)
        torch.testing.assert_close(torch.cat([r["dx"] for r in mine]), x.grad, **TOL)
        torch.testing.assert_close(sum(r["dw"] for r in mine), w.grad, **TOL)
        torch.testing.assert_close(sum(r["db"] for r in mine), b.grad, **TOL)
        for r in mine:
            torch.testing.assert_close(r["rm"], rm, **TOL)
            torch.testing.assert_close(r["rv"], rv, **TOL)


@pytest.mark.parametrize("size", [2, 3])
def test_channels_far_from_zero_keep_their_variance(size: int) -> None:
    # x is stored to 6e-5 here: the two sides' means differ by about 1e-4
    # of the spread, and the weight gradient (a sum of 36) by 7e-4. Summing
    # x and x^2 instead loses the variance itself (errors of 0.1 and more).
    check(SPATIAL["2d"], size, "backward", kind="far", tol={"rtol": 1e-3, "atol": 1e-3})


def _low_precision(rank: int, size: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    p = {k: v.to(dtype) for k, v in problem((2, 3), sum(SIZES[size])).items()}
    x = p["x"][my_slice(rank, size)].clone().requires_grad_()
    w, b = p["w"].requires_grad_(), p["b"].requires_grad_()
    rm, rv = torch.zeros(C), torch.ones(C)  # float32 running statistics, as AMP keeps them
    y = fdp.sync_batch_norm(x, rm, rv, w, b)
    torch.autograd.backward((y * p["dy"][my_slice(rank, size)]).sum())
    assert x.grad is not None
    assert w.grad is not None
    assert b.grad is not None
    assert (y.dtype, x.grad.dtype, w.grad.dtype) == (dtype, dtype, dtype)
    return {"y": y.detach(), "dx": x.grad, "dw": w.grad, "db": b.grad, "rm": rm, "rv": rv}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_inputs_take_float32_statistics(dtype: torch.dtype) -> None:
    results = ranks.world(3).run(_low_precision, dtype)
    # The reference: float32 batch norm of the same (rounded) numbers.
    p = {k: v.to(dtype).float() for k, v in problem((2, 3), sum(SIZES[3])).items()}
    x, w, b = (p[k].requires_grad_() for k in ("x", "w", "b"))
    rm, rv = torch.zeros(C), torch.ones(C)
    y = F.batch_norm(x, rm, rv, w, b, training=True)
    torch.autograd.backward((y * p["dy"]).sum())
    tol: dict[str, Any] = {"rtol": 2e-2, "atol": 2e-2}
    for rank, r in enumerate(results):
        part = my_slice(rank, 3)
        torch.testing.assert_close(r["y"].float(), y.detach()[part], **tol)
        torch.testing.assert_close(r["dx"].float(), x.grad[part], **tol)  # type: ignore[index]
        torch.testing.assert_close(r["rm"], rm, **TOL)
        torch.testing.assert_close(r["rv"], rv, **TOL)
    torch.testing.assert_close(sum(r["dw"].float() for r in results), w.grad, **tol)
    torch.testing.assert_close(sum(r["db"].float() for r in results), b.grad, **tol)


def check(
    spatial: tuple[int, ...],
    size: int,
    how: str,
    *,
    kind: str = "near",
    tol: dict[str, Any] = TOL,
) -> None:
    ref = reference(spatial, size, kind)
    results = ranks.world(size).run(_sync_bn, spatial, how, kind)
    for rank, r in enumerate(results):
        part = my_slice(rank, size)
        torch.testing.assert_close(r["y"], ref["y"][part], **tol)
        torch.testing.assert_close(r["dx"], ref["dx"][part], **tol)
        torch.testing.assert_close(r["rm"], ref["rm"], **tol)
        torch.testing.assert_close(r["rv"], ref["rv"], **tol)
    torch.testing.assert_close(sum(r["dw"] for r in results), ref["dw"], **tol)
    torch.testing.assert_close(sum(r["db"] for r in results), ref["db"], **tol)


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match=r"`x` expected shape \(N, C, \*\); got shape \(3,\)"):
        fdp.sync_batch_norm(torch.ones(3), None, None)


def conv_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(C, 6, 3, padding=1),
        torch.nn.BatchNorm2d(6, momentum=None),  # cumulative average: num_batches_tracked
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(6 * 2 * 3, 3),
        torch.nn.BatchNorm1d(3),
        # Its tensors are None, yet synced: make_functional runs only a
        # subtree without registered names as itself.
        torch.nn.Sequential(torch.nn.BatchNorm1d(3, affine=False, track_running_stats=False)),
    )


def _module(rank: int, size: int, how: str) -> dict[str, Any]:
    net = conv_net()
    fn, state = fdp.make_functional(net, sync_batch_norm=True)
    p = problem((2, 3), sum(SIZES[size]))
    x = p["x"][my_slice(rank, size)].clone()
    dy = p["dy"][my_slice(rank, size), :3, 0, 0]
    params = {k: v for k, v in state.items() if v.requires_grad}
    for _ in range(2):  # two steps: the running statistics accumulate

        def loss(params: dict[str, torch.Tensor]) -> torch.Tensor:
            out: torch.Tensor = (fn({**state, **params}, x) * dy).sum()
            return out

        if how == "func.grad":
            grads = torch.func.grad(loss)(params)
        else:
            for t in params.values():
                t.grad = None
            torch.autograd.backward(loss(params))
            grads = {k: t.grad for k, t in params.items()}
    net.eval()
    out = {f"grad.{k}": g for k, g in grads.items()}
    out |= {f"buffer.{k}": v.clone() for k, v in net.named_buffers()}
    out["eval"] = fn(state, x)
    return {k: v.detach() for k, v in out.items()}


@pytest.mark.parametrize("how", ["backward", "func.grad"])
def test_make_functional_sync_batch_norm_matches_the_global_batch(how: str) -> None:
    size = 3
    net = conv_net()
    p = problem((2, 3), sum(SIZES[size]))
    for _ in range(2):
        net.zero_grad()
        torch.autograd.backward((net(p["x"]) * p["dy"][:, :3, 0, 0]).sum())
    net.eval()
    # Two layers of statistics from sums over three ranks: float32 rounding
    # reaches 2e-6 in a few of the 108 linear-weight gradients.
    loose: dict[str, Any] = {"rtol": 1e-4, "atol": 1e-5}
    results = ranks.world(size).run(_module, how)
    for name, param in net.named_parameters():
        assert param.grad is not None
        torch.testing.assert_close(sum(r[f"grad.{name}"] for r in results), param.grad, **loose)
    for rank, r in enumerate(results):
        for name, buf in net.named_buffers():
            torch.testing.assert_close(r[f"buffer.{name}"], buf, **loose)
        torch.testing.assert_close(r["eval"], net(p["x"][my_slice(rank, size)]), **loose)


def _edges(rank: int, size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    rm, rv = torch.zeros(3), torch.ones(3)
    # One value per channel in the whole global batch: every rank raises, as torch does.
    try:
        fdp.sync_batch_norm(torch.randn(1 if rank == 0 else 0, 3), rm, rv)
        out["one"] = "ran"
    except ValueError as e:
        out["one"] = str(e)
    # An empty global batch leaves the running statistics as they were.
    y = fdp.sync_batch_norm(torch.randn(0, 3, 2), rm, rv)
    out["empty"] = (tuple(y.shape), rm.clone(), rv.clone())
    # eval() without running statistics: local batch statistics, no collective
    # (only rank 0 evaluates; a collective would hang).
    bn = torch.nn.BatchNorm1d(3, track_running_stats=False).eval()
    fn, state = fdp.make_functional(bn, sync_batch_norm=True)
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(rank))
    if rank == 0:
        out["eval"] = (fn(state, x).detach(), bn(x).detach())
    # nn.SyncBatchNorm's own process_group: ranks 0-1 together, rank 2 alone.
    groups = [torch.distributed.new_group([0, 1]), torch.distributed.new_group([2])]
    sbn = torch.nn.SyncBatchNorm(3, process_group=groups[0 if rank < 2 else 1])
    fn, state = fdp.make_functional(sbn, sync_batch_norm=True)
    out["group"] = fn(state, torch.randn(4, 3, generator=torch.Generator().manual_seed(rank)))
    out["group"] = out["group"].detach()
    return out


def test_edges_match_torch() -> None:
    results = ranks.world(3).run(_edges)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel") as e:
        F.batch_norm(torch.randn(1, 3), torch.zeros(3), torch.ones(3), training=True)
    assert e.type is ValueError
    xs = [torch.randn(4, 3, generator=torch.Generator().manual_seed(r)) for r in range(3)]
    for rank, out in enumerate(results):
        assert "more than 1 value per channel in the global batch" in out["one"]
        shape, rm, rv = out["empty"]
        assert shape == (0, 3, 2)
        torch.testing.assert_close(rm, torch.zeros(3), rtol=0, atol=0)
        torch.testing.assert_close(rv, torch.ones(3), rtol=0, atol=0)
        if rank == 0:
            got, expected = out["eval"]
            torch.testing.assert_close(got, expected)
        members = [0, 1] if rank < 2 else [2]
        batch = torch.cat([xs[r] for r in members])
        expected = F.batch_norm(batch, None, None, training=True)[members.index(rank) * 4 :][:4]
        torch.testing.assert_close(out["group"], expected, **TOL)


def test_momentum_none_is_refused_clearly() -> None:
    with pytest.raises(TypeError, match="`momentum` expected a float; got None"):
        fdp.sync_batch_norm(torch.randn(4, 3), torch.zeros(3), torch.ones(3), momentum=None)  # type: ignore[arg-type]
