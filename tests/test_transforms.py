"""The composability matrix: every collective entry point under every torch.func transform.

Each case runs on every rank of a shared gloo world (2 and 3 ranks) and is
compared there with a single-process reference computed from the full
batch (float64, so the tolerances are tight). A case answers ``"ok"``, or
``"refused"`` when fdp raised its own clear error where one is expected;
anything else is a failure with the difference. ``docs/transforms.md``
carries the same table; :func:`test_docs_table_matches` keeps it true.

Conventions the references encode (see docs/transforms.md):

- reverse mode through ``ddp(params)`` gives the full-batch derivative on
  every rank; forward-mode outputs (a tangent, like the primal) are this
  rank's own, and their average over ranks is the full-batch one;
- a derivative w.r.t. a tensor that every rank holds (parameters a
  collective consumes, a learning rate) taken through ``all_reduce_grads``
  or ``ZeroRedundancy.step`` by reverse mode is this rank's share: its
  average over ranks (``fdp.all_reduce_grads``) is the full derivative.
"""

from __future__ import annotations

import functools
import pathlib
import re
from collections.abc import Callable
from typing import Any

import optree
import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vmap

import fdp
from tests import ranks
from tests.helpers import fake, label

D = torch.float64
PER = 4  # examples per rank

Case = Callable[["Setup"], tuple[Any, Any]]
CASES: dict[str, Case] = {}


def case(name: str) -> Callable[[Case], Case]:
    def register(fn: Case) -> Case:
        CASES[name] = fn
        return fn

    return register


class Setup:
    """One rank's view: the full batch, this rank's shard, and the shared weights."""

    def __init__(self, rank: int, size: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.rank, self.size = rank, size
        self.w = torch.randn(4, 3, generator=g, dtype=D)
        self.v = torch.randn(4, 3, generator=g, dtype=D)
        self.X = torch.randn(PER * size, 4, generator=g, dtype=D)
        self.x = self.X.chunk(size)[rank]

    def mine(self, t: torch.Tensor) -> torch.Tensor:
        return t.chunk(self.size)[self.rank]

    def ddp(self) -> tuple[fdp.DistributedDataParallel, torch.Tensor]:
        p = self.w.clone().requires_grad_()
        return fdp.DistributedDataParallel({"w": p}, bucket_cap_mb=1e-6), p

    def full(self, w: torch.Tensor) -> torch.Tensor:
        return objective(w, self.X)

    def average(self, t: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = fdp.all_reduce_grads({"t": t.detach()})["t"]
        return out


def objective(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w).pow(2).mean()


def model(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w)


def backward(t: torch.Tensor) -> None:
    torch.autograd.backward(t)


def dual(primal: torch.Tensor, tangent: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = fwAD.make_dual(primal, tangent)  # type: ignore[no-untyped-call]
    return out


def tangent_of(t: torch.Tensor) -> torch.Tensor | None:
    out: torch.Tensor | None = fwAD.unpack_dual(t).tangent  # type: ignore[no-untyped-call]
    return out


def jvp2(f: Callable[..., Any], primals: tuple[Any, ...], tangents: tuple[Any, ...]) -> Any:
    """``torch.func.jvp``'s (output, tangent), typed."""
    out = jvp(f, primals, tangents)
    return out[0], out[1]


def synced(ddp: fdp.DistributedDataParallel, w: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = ddp({"w": w})["w"]
    return out


# --- ddp(params) ------------------------------------------------------------


@case("ddp | grad | inside")
def _(s: Setup) -> tuple[Any, Any]:
    d, _ = s.ddp()
    return grad(lambda w: objective(synced(d, w), s.x))(s.w), grad(lambda w: objective(w, s.X))(s.w)


@case("ddp | grad | outside")
def _(s: Setup) -> tuple[Any, Any]:
    # ddp(params) outside, a loss that uses torch.func.grad w.r.t. the inputs inside.
    d, p = s.ddp()
    q = synced(d, p)
    gx = grad(lambda x: model(q, x).sum())(s.x)
    backward(model(q, s.x).pow(2).mean() + gx.pow(2).mean())
    r = s.w.clone().requires_grad_()
    gx_full = torch.func.vmap(grad(lambda x: model(r, x).sum()))(s.X)
    backward(model(r, s.X).pow(2).mean() + gx_full.pow(2).mean())
    return p.grad, r.grad


def _meanflow(s: Setup, *, inside: bool) -> tuple[Any, Any]:
    d, p = s.ddp()
    q = None if inside else synced(d, p)

    def u(x: torch.Tensor) -> torch.Tensor:
        return model(synced(d, p) if inside else q, x)  # type: ignore[arg-type]

    out, du = jvp2(u, (s.x,), (torch.ones_like(s.x),))
    backward((out - du.detach()).pow(2).mean())
    r = s.w.clone().requires_grad_()
    ref, dref = jvp2(lambda x: model(r, x), (s.X,), (torch.ones_like(s.X),))
    backward((ref - dref.detach()).pow(2).mean())
    return p.grad, r.grad


@case("ddp | jvp (MeanFlow) then backward | inside")
def _(s: Setup) -> tuple[Any, Any]:
    return _meanflow(s, inside=True)


@case("ddp | jvp (MeanFlow) then backward | outside")
def _(s: Setup) -> tuple[Any, Any]:
    return _meanflow(s, inside=False)


@case("ddp | jvp (MeanFlow), make_functional LayerNorm net | inside")
def _(s: Setup) -> tuple[Any, Any]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(4, 5), torch.nn.LayerNorm(5), torch.nn.Tanh(), torch.nn.Linear(5, 3)
    ).double()
    fn, state = fdp.make_functional(net)
    d = fdp.DistributedDataParallel(state)

    def step(f: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> None:
        out, du = jvp2(f, (x,), (torch.ones_like(x),))
        backward((out - du.detach()).pow(2).mean())

    step(lambda x: fn(d(state), x), s.x)
    got = [t.grad for t in state.values()]
    ref = {k: t.detach().clone().requires_grad_() for k, t in state.items()}
    step(lambda x: fn(ref, x), s.X)
    return got, [t.grad for t in ref.values()]


@case("ddp | vmap then backward | inside")
def _(s: Setup) -> tuple[Any, Any]:
    d, p = s.ddp()
    backward(vmap(lambda x: model(synced(d, p), x))(s.x).pow(2).mean())
    r = s.w.clone().requires_grad_()
    backward(model(r, s.X).pow(2).mean())
    return p.grad, r.grad


@case("ddp | vmap(grad) | inside")
def _(s: Setup) -> tuple[Any, Any]:
    # Per-sample gradients, each averaged with the same slice of the other
    # ranks (the psum rule under vmap).
    d, _ = s.ddp()
    got = vmap(grad(lambda w, x: objective(synced(d, w), x)), in_dims=(None, 0))(s.w, s.x[:, None])
    per = vmap(grad(objective), in_dims=(None, 0))(s.w, s.X[:, None])
    return got, per.view(s.size, PER, 4, 3).mean(0)


@case("ddp | jvp(grad) | inside")
def _(s: Setup) -> tuple[Any, Any]:
    d, _ = s.ddp()
    hvp = jvp2(lambda w: grad(lambda q: objective(synced(d, q), s.x))(w), (s.w,), (s.v,))[1]
    return hvp, jvp2(grad(s.full), (s.w,), (s.v,))[1]


@case("ddp | grad(grad) | inside")
def _(s: Setup) -> tuple[Any, Any]:
    d, _ = s.ddp()

    def inner(w: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = (grad(lambda q: objective(synced(d, q), s.x))(w) * s.v).sum()
        return out

    ref = grad(lambda w: (grad(lambda q: objective(q, s.X))(w) * s.v).sum())(s.w)
    return grad(inner)(s.w), ref


@case("ddp | jacrev | inside")
def _(s: Setup) -> tuple[Any, Any]:
    d, _ = s.ddp()
    return jacrev(lambda w: objective(synced(d, w), s.x))(s.w), jacrev(lambda w: objective(w, s.X))(
        s.w
    )


@case("ddp | jacfwd | inside")
def _(s: Setup) -> tuple[Any, Any]:
    # Forward mode: this rank's own derivative; the average is the full batch's.
    d, _ = s.ddp()
    got = jacfwd(lambda w: objective(synced(d, w), s.x))(s.w)
    assert torch.allclose(s.average(got), jacfwd(lambda w: objective(w, s.X))(s.w))
    return got, jacfwd(lambda w: objective(w, s.x))(s.w)


@case("ddp | hessian | inside")
def _(s: Setup) -> tuple[Any, Any]:
    d, _ = s.ddp()
    return hessian(lambda w: objective(synced(d, w), s.x))(s.w), hessian(
        lambda w: objective(w, s.X)
    )(s.w)


@case("ddp | jvp | inside")
def _(s: Setup) -> tuple[Any, Any]:
    d, _ = s.ddp()
    got = jvp2(lambda w: objective(synced(d, w), s.x), (s.w,), (s.v,))[1]
    assert torch.allclose(s.average(got), jvp2(lambda w: objective(w, s.X), (s.w,), (s.v,))[1])
    return got, jvp2(lambda w: objective(w, s.x), (s.w,), (s.v,))[1]


@case("ddp | forward_ad then backward | inside")
def _(s: Setup) -> tuple[Any, Any]:
    d, p = s.ddp()
    with fwAD.dual_level():
        out = objective(synced(d, dual(p, s.v)), s.x)
        tangent = tangent_of(out)
        backward(out)
    r = s.w.clone().requires_grad_()
    backward(objective(r, s.X))
    ref_t = jvp2(lambda w: objective(w, s.x), (s.w,), (s.v,))[1]
    return (p.grad, tangent), (r.grad, ref_t)


# --- all_reduce_grads --------------------------------------------------------


def ar(t: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = fdp.all_reduce_grads({"g": t})["g"]
    return out


def hess(s: Setup) -> torch.Tensor:
    out: torch.Tensor = hessian(lambda w: objective(w, s.X))(s.w)
    return out


@case("all_reduce_grads | grad | outside")
def _(s: Setup) -> tuple[Any, Any]:
    return ar(grad(objective)(s.w, s.x)), grad(lambda w: objective(w, s.X))(s.w)


@case("all_reduce_grads | grad(grad) | inside")
def _(s: Setup) -> tuple[Any, Any]:
    share = grad(lambda w: (ar(grad(objective)(w, s.x)) * s.v).sum())(s.w)
    return s.average(share), grad(lambda w: (grad(lambda q: objective(q, s.X))(w) * s.v).sum())(s.w)


@case("all_reduce_grads | jvp(grad) | inside")
def _(s: Setup) -> tuple[Any, Any]:
    got = jvp2(lambda w: ar(grad(objective)(w, s.x)), (s.w,), (s.v,))[1]
    return got, jvp2(grad(s.full), (s.w,), (s.v,))[1]


@case("all_reduce_grads | jacrev | inside")
def _(s: Setup) -> tuple[Any, Any]:
    return s.average(jacrev(lambda w: ar(grad(objective)(w, s.x)))(s.w)), hess(s)


@case("all_reduce_grads | jacfwd | inside")
def _(s: Setup) -> tuple[Any, Any]:
    return jacfwd(lambda w: ar(grad(objective)(w, s.x)))(s.w), hess(s)


@case("all_reduce_grads | hessian | inside")
def _(s: Setup) -> tuple[Any, Any]:
    # hessian of a loss whose value is averaged over ranks: the full-batch one.
    got = hessian(lambda w: ar(objective(w, s.x)))(s.w)
    return s.average(got), hess(s)


@case("all_reduce_grads | vmap | inside")
def _(s: Setup) -> tuple[Any, Any]:
    per = vmap(grad(objective), in_dims=(None, 0))(s.w, s.x[:, None])
    full = vmap(grad(objective), in_dims=(None, 0))(s.w, s.X[:, None])
    return vmap(ar)(per), full.view(s.size, PER, 4, 3).mean(0)


@case("all_reduce_grads | vmap(grad) DP-SGD | outside")
def _(s: Setup) -> tuple[Any, Any]:
    def clipped_sum(x: torch.Tensor) -> torch.Tensor:
        per = vmap(grad(objective), in_dims=(None, 0))(s.w, x[:, None])
        scale = (per.flatten(1).norm(dim=1) / 0.1).clamp_min(1).reciprocal()
        out: torch.Tensor = (per * scale.view(-1, 1, 1)).sum(0)
        return out

    total = fdp.all_reduce_grads({"g": clipped_sum(s.x)}, average=False)["g"]
    return total, clipped_sum(s.X)


@case("all_reduce_grads | forward_ad | inside")
def _(s: Setup) -> tuple[Any, Any]:
    with fwAD.dual_level():
        out = ar(dual(grad(objective)(s.w, s.x), grad(objective)(s.v, s.x)))
        tangent = tangent_of(out)
    return tangent, grad(lambda w: objective(w, s.X))(s.v)


# --- data_parallel ------------------------------------------------------------
#
# One process, two replicas: the reference is the model itself on the same
# batch. On CPU replicas the replicas share the parameters; on fake devices
# (CPU data labelled meta:N, tests/helpers.py) they are copied by
# replicate's Function, whose jvp and vmap rules copy the tangents the same
# way. The fake devices cannot carry forward-mode tangents (the subclass
# loses its label there), so they run the reverse-mode and vmap rows.

Model = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _dp_transforms(s: Setup) -> dict[str, Callable[[Model], torch.Tensor]]:
    def loss(f: Model) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda w: f(w, s.X).pow(2).mean()

    def meanflow(f: Model) -> torch.Tensor:
        p = s.w.clone().requires_grad_()
        out, du = jvp2(lambda x: f(p, x), (s.X,), (torch.ones_like(s.X),))
        backward((out - du.detach()).pow(2).mean())
        return p.grad  # type: ignore[return-value]

    def forward_ad(f: Model) -> torch.Tensor:
        with fwAD.dual_level():
            return tangent_of(f(dual(s.w, s.v), s.X))  # type: ignore[return-value]

    return {
        "grad": lambda f: grad(loss(f))(s.w),
        "jvp": lambda f: jvp2(loss(f), (s.w,), (s.v,))[1],
        "vmap": lambda f: vmap(lambda x: f(s.w, x[None]).sum())(s.X),
        "vmap(grad)": lambda f: vmap(
            grad(lambda w, x: f(w, x[None]).pow(2).sum()), in_dims=(None, 0)
        )(s.w, s.X),
        "jvp(grad)": lambda f: jvp2(grad(loss(f)), (s.w,), (s.v,))[1],
        "grad(grad)": lambda f: grad(lambda w: (grad(loss(f))(w) * s.v).sum())(s.w),
        "jacrev": lambda f: jacrev(loss(f))(s.w),
        "jacfwd": lambda f: jacfwd(loss(f))(s.w),
        "hessian": lambda f: hessian(loss(f))(s.w),
        "forward_ad": forward_ad,
        "jvp (MeanFlow) then backward": meanflow,
    }


FAKE_DEVICE_ROWS = ("grad", "vmap", "vmap(grad)", "grad(grad)", "jacrev")


def _dp_case(transform: str, *, on_fake: bool) -> Case:
    def run(s: Setup) -> tuple[Any, Any]:
        how = _dp_transforms(s)[transform]
        if not on_fake:
            return how(lambda w, x: fdp.data_parallel(model, w, x, devices=["cpu", "cpu"])), how(
                model
            )
        s.w, s.v, s.X = (label(t, 0) for t in (s.w, s.v, s.X))

        def replicated(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = fdp.data_parallel(model, w, x, devices=[fake(0), fake(1)])
            return out

        return how(replicated).data_, how(model).data_  # type: ignore[attr-defined]

    return run


for _t in _dp_transforms(Setup(0, 1)):
    CASES[f"data_parallel | {_t} | inside"] = _dp_case(_t, on_fake=False)
for _t in FAKE_DEVICE_ROWS:
    CASES[f"data_parallel (fake devices) | {_t} | inside"] = _dp_case(_t, on_fake=True)


# --- broadcast_params ---------------------------------------------------------


@case("broadcast_params | grad | inside")
def _(s: Setup) -> tuple[Any, Any]:
    # The transpose of a broadcast: every rank's cotangent summed onto rank 0.
    got = grad(lambda w: objective(fdp.broadcast_params({"w": w * 1})["w"], s.x))(s.w)
    total = grad(lambda w: sum(objective(w, x) for x in s.X.chunk(s.size)))(s.w)
    return got, total * (s.rank == 0)


@case("broadcast_params | jvp | inside")
def _(s: Setup) -> tuple[Any, Any]:
    got = jvp2(lambda w: fdp.broadcast_params({"w": w * (s.rank + 1)})["w"], (s.w,), (s.v,))
    return got, (s.w, s.v)


@case("broadcast_params | vmap | inside")
def _(s: Setup) -> tuple[Any, Any]:
    both = torch.stack([s.w, s.v])
    return vmap(lambda w: fdp.broadcast_params({"w": w * (s.rank + 1)})["w"])(both), both


# --- sync_batch_norm ----------------------------------------------------------


class BN:
    """A 3-channel batch whose loss weights every element differently."""

    def __init__(self, s: Setup) -> None:
        g = torch.Generator().manual_seed(1)
        shape = (PER * s.size, 3, 2)
        self.X = torch.randn(*shape, generator=g, dtype=D) * 2 + 1
        self.T = torch.randn(*shape, generator=g, dtype=D)
        self.K = torch.randn(*shape, generator=g, dtype=D)
        self.W = torch.randn(3, generator=g, dtype=D)
        self.B = torch.randn(3, generator=g, dtype=D)
        self.x, self.t, self.k = s.mine(self.X), s.mine(self.T), s.mine(self.K)

    def sync(self, x: torch.Tensor, w: torch.Tensor | None = None) -> torch.Tensor:
        return fdp.sync_batch_norm(x, None, None, self.W if w is None else w, self.B)

    def ref(self, x: torch.Tensor, w: torch.Tensor | None = None) -> torch.Tensor:
        return F.batch_norm(x, None, None, self.W if w is None else w, self.B, True)

    def loss(self, y: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return (y.sin() * k).sum()

    def local_loss(self, x: torch.Tensor) -> torch.Tensor:
        return self.loss(self.sync(x), self.k)

    def full_loss(self, x: torch.Tensor) -> torch.Tensor:
        return self.loss(self.ref(x), self.K)


@case("sync_batch_norm | grad | inside")
def _(s: Setup) -> tuple[Any, Any]:
    b = BN(s)
    got = grad(lambda x: b.loss(b.sync(x), b.k))(b.x)
    return got, s.mine(grad(lambda x: b.loss(b.ref(x), b.K))(b.X))


@case("sync_batch_norm | grad (weight, a rank's share) | inside")
def _(s: Setup) -> tuple[Any, Any]:
    b = BN(s)
    share = grad(lambda w: b.loss(b.sync(b.x, w), b.k))(b.W)
    total = fdp.all_reduce_grads({"w": share}, average=False)["w"]
    return total, grad(lambda w: b.loss(b.ref(b.X, w), b.K))(b.W)


@case("sync_batch_norm | jvp | inside")
def _(s: Setup) -> tuple[Any, Any]:
    b = BN(s)
    return jvp2(b.sync, (b.x,), (b.t,))[1], s.mine(jvp2(b.ref, (b.X,), (b.T,))[1])


@case("sync_batch_norm | jvp(grad) | inside")
def _(s: Setup) -> tuple[Any, Any]:
    b = BN(s)
    got = jvp2(grad(b.local_loss), (b.x,), (b.t,))[1]
    return got, s.mine(jvp2(grad(b.full_loss), (b.X,), (b.T,))[1])


def _bn_hvp(
    b: BN, norm: Callable[..., torch.Tensor], x: torch.Tensor, k: torch.Tensor, t: Any
) -> Any:
    return grad(lambda z: (grad(lambda q: b.loss(norm(q), k))(z) * t).sum())(x)


@case("sync_batch_norm | grad(grad) | inside")
def _(s: Setup) -> tuple[Any, Any]:
    b = BN(s)
    return _bn_hvp(b, b.sync, b.x, b.k, b.t), s.mine(_bn_hvp(b, b.ref, b.X, b.K, b.T))


@case("sync_batch_norm | autograd create_graph | outside")
def _(s: Setup) -> tuple[Any, Any]:
    b = BN(s)
    x = b.x.clone().requires_grad_()
    (gx,) = torch.autograd.grad(b.loss(b.sync(x), b.k), x, create_graph=True)
    backward((gx * b.t).sum())
    return x.grad, s.mine(_bn_hvp(b, b.ref, b.X, b.K, b.T))


@case("sync_batch_norm | vmap | inside")
def _(s: Setup) -> tuple[Any, Any]:
    b = BN(s)
    got = vmap(b.sync)(torch.stack([b.x, 2 * b.x]))
    return got, torch.stack([s.mine(b.ref(b.X)), s.mine(b.ref(2 * b.X))])


@case("sync_batch_norm | vmap with running stats | inside")
def _(s: Setup) -> tuple[Any, Any]:
    b = BN(s)
    mean, var = torch.zeros(3, dtype=D), torch.ones(3, dtype=D)
    vmap(lambda x: fdp.sync_batch_norm(x, mean, var, b.W, b.B))(torch.stack([b.x, b.x]))
    return None, None  # unreachable: refused


@case("sync_batch_norm | jvp with running stats | inside")
def _(s: Setup) -> tuple[Any, Any]:
    b = BN(s)
    mean, var = torch.zeros(3, dtype=D), torch.ones(3, dtype=D)
    jvp2(lambda x: fdp.sync_batch_norm(x, mean, var, b.W, b.B), (b.x,), (b.t,))
    ref_mean, ref_var = torch.zeros(3, dtype=D), torch.ones(3, dtype=D)
    F.batch_norm(b.X, ref_mean, ref_var, b.W, b.B, True)
    return (mean, var), (ref_mean, ref_var)


# --- fdp.optim and ZeroRedundancy ---------------------------------------------

OPTIMIZERS: dict[str, Callable[[Any], Any]] = {
    "sgd": lambda lr: fdp.optim.sgd(lr, momentum=0.9, nesterov=True, weight_decay=0.1),
    "adam": lambda lr: fdp.optim.adam(lr, amsgrad=True, weight_decay=0.1),
    "adamw": lambda lr: fdp.optim.adamw(lr),
}


def _train(s: Setup, make: Callable[[Any], Any], lr: Any, x: torch.Tensor) -> torch.Tensor:
    """Three steps of ``make(lr)`` on this data; the loss on the full batch after them."""
    opt = make(lr)
    p = {"w": s.w}
    state = opt.init(p)
    for _ in range(3):
        p, state = opt.update({"w": grad(objective)(p["w"], x)}, state, p)
    return objective(p["w"], s.X)


def _finite_difference(f: Callable[[float], torch.Tensor], at: float) -> torch.Tensor:
    eps = 1e-6
    return (f(at + eps) - f(at - eps)) / (2 * eps)


for _name, _make in OPTIMIZERS.items():

    @case(f"optim.{_name} | grad (lr) | inside")
    def _(s: Setup, make: Callable[[Any], Any] = _make) -> tuple[Any, Any]:
        lr = torch.tensor(0.05, dtype=D)
        got = grad(lambda r: _train(s, make, r, s.X))(lr)
        return got, _finite_difference(lambda r: _train(s, make, r, s.X), 0.05)

    @case(f"optim.{_name} | jvp (lr) | inside")
    def _(s: Setup, make: Callable[[Any], Any] = _make) -> tuple[Any, Any]:
        one = torch.tensor(1.0, dtype=D)
        got = jvp2(lambda r: _train(s, make, r, s.X), (torch.tensor(0.05, dtype=D),), (one,))[1]
        return got, _finite_difference(lambda r: _train(s, make, r, s.X), 0.05)

    @case(f"optim.{_name} | vmap (lr) | inside")
    def _(s: Setup, make: Callable[[Any], Any] = _make) -> tuple[Any, Any]:
        lrs = torch.tensor([0.01, 0.05], dtype=D)
        got = vmap(lambda r: _train(s, make, r, s.X))(lrs)
        return got, torch.stack([_train(s, make, float(r), s.X) for r in lrs])


@case("optim.sgd | MAML, autograd | outside")
def _(s: Setup) -> tuple[Any, Any]:
    def meta(w0: torch.Tensor) -> torch.Tensor:
        opt = fdp.optim.sgd(0.1)
        (g,) = torch.autograd.grad(objective(w0, s.x), w0, create_graph=True)
        p, _ = opt.update({"w": g}, opt.init({"w": w0}), {"w": w0})
        return objective(p["w"], s.X)

    w0 = s.w.clone().requires_grad_()
    backward(meta(w0))
    return w0.grad, grad(lambda w: objective(w - 0.1 * grad(objective)(w, s.x), s.X))(s.w)


def _zero(s: Setup, make: Callable[[Any], Any], lr: Any, stage: int) -> torch.Tensor:
    opt = make(lr)
    p = {"w": s.w, "b": s.v[0]}
    zero = fdp.ZeroRedundancy(opt, p, stage=stage, bucket_cap_mb=1e-5)
    state = zero.init(p)
    for _ in range(2):
        g = grad(lambda q: objective(q["w"], s.x) + q["b"].sum() ** 2)(p)
        p, state = zero.step(g, state, p)
    return objective(p["w"], s.X) + p["b"].sum()


def _zero_reference(s: Setup, make: Callable[[Any], Any], lr: Any) -> torch.Tensor:
    opt = make(lr)
    p = {"w": s.w, "b": s.v[0]}
    state = opt.init(p)
    for _ in range(2):
        g = grad(lambda q: objective(q["w"], s.X) + q["b"].sum() ** 2)(p)
        p, state = opt.update(g, state, p)
    return objective(p["w"], s.X) + p["b"].sum()


for _stage in (1, 2):

    @case(f"ZeroRedundancy stage {_stage} | grad (lr, a rank's share) | inside")
    def _(s: Setup, stage: int = _stage) -> tuple[Any, Any]:
        make = OPTIMIZERS["adamw"]
        lr = torch.tensor(0.05, dtype=D)
        share = grad(lambda r: _zero(s, make, r, stage))(lr)
        return s.average(share), grad(lambda r: _zero_reference(s, make, r))(lr)

    @case(f"ZeroRedundancy stage {_stage} | autograd (lr, a rank's share) | outside")
    def _(s: Setup, stage: int = _stage) -> tuple[Any, Any]:
        make = OPTIMIZERS["sgd"]
        lr = torch.tensor(0.05, dtype=D, requires_grad=True)
        backward(_zero(s, make, lr, stage))
        assert lr.grad is not None
        return s.average(lr.grad), grad(lambda r: _zero_reference(s, make, r))(lr.detach())

    @case(f"ZeroRedundancy stage {_stage} | jvp (lr) | inside")
    def _(s: Setup, stage: int = _stage) -> tuple[Any, Any]:
        make = OPTIMIZERS["adam"]
        at, one = (torch.tensor(0.05, dtype=D),), (torch.tensor(1.0, dtype=D),)
        got = jvp2(lambda r: _zero(s, make, r, stage), at, one)[1]
        return got, jvp2(lambda r: _zero_reference(s, make, r), at, one)[1]


# --- the matrix ---------------------------------------------------------------

REFUSED = {"sync_batch_norm | vmap with running stats | inside"}


def _close(got: Any, ref: Any) -> str:
    leaves_got = optree.tree_leaves(got, none_is_leaf=True)
    leaves_ref = optree.tree_leaves(ref, none_is_leaf=True)
    if len(leaves_got) != len(leaves_ref):
        return f"structure {len(leaves_got)} leaves vs {len(leaves_ref)}"
    for a, b in zip(leaves_got, leaves_ref, strict=True):
        a, b = torch.as_tensor(a).detach(), torch.as_tensor(b).detach()
        if a.shape != b.shape:
            return f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
        if not torch.allclose(a, b, rtol=1e-6, atol=1e-8):
            return f"max difference {float((a - b).abs().max()):.3g}"
    return "ok"


def _run_all(rank: int, size: int) -> dict[str, str]:
    out = {}
    for name, fn in CASES.items():
        try:
            out[name] = _close(*fn(Setup(rank, size)))
        except Exception as e:  # reported per case, so one failure does not hide the rest
            fdp_error = isinstance(e, ValueError | NotImplementedError) and str(e).startswith(
                "fdp."
            )
            out[name] = "refused" if fdp_error else f"raised {type(e).__name__}: {str(e)[:300]}"
    return out


@functools.cache
def _matrix(size: int) -> list[dict[str, str]]:
    return ranks.world(size).run(_run_all, timeout_s=300)


@pytest.mark.parametrize("size", [1, 2, 3])
@pytest.mark.parametrize("name", list(CASES))
def test_matrix(name: str, size: int) -> None:
    expected = "refused" if name in REFUSED else "ok"
    for rank, results in enumerate(_matrix(size)):
        assert results[name] == expected, f"rank {rank} of {size}: {results[name]}"


def test_docs_table_matches() -> None:
    """docs/transforms.md lists exactly these cases, each with its verdict."""
    text = (pathlib.Path(__file__).parent.parent / "docs" / "transforms.md").read_text()
    rows = re.findall(r"^\| `?([^|`]+?)`? \| ([^|]+?) \| ([^|]+?) \| (ok|refused)", text, re.M)
    documented = {f"{e.strip()} | {t.strip()} | {p.strip()}": v for e, t, p, v in rows}
    expected = {name: ("refused" if name in REFUSED else "ok") for name in CASES}
    assert documented == expected


# --- compiled -----------------------------------------------------------------
#
# Each case compiles the transformed computation (aot_eager) with and without
# fullgraph=True. Without it every case gives the reference (where fdp cannot
# be compiled it runs eagerly: a graph break). With it, the MeanFlow pattern
# is one graph; elsewhere dynamo raises with fdp's reason as its explanation.

Comp = Callable[[Callable[..., Any]], Callable[..., Any]]  # torch.compile, with fullgraph or not
Compiled = Callable[["Setup", Comp], tuple[Any, Any]]
COMPILED: dict[str, Compiled] = {}
ONE_GRAPH = {"ddp | jvp (MeanFlow) then backward | inside"}


def compiled(name: str) -> Callable[[Compiled], Compiled]:
    def register(fn: Compiled) -> Compiled:
        COMPILED[name] = fn
        return fn

    return register


@compiled("ddp | jvp (MeanFlow) then backward | inside")
def _(s: Setup, comp: Comp) -> tuple[Any, Any]:
    d, p = s.ddp()

    def loss(q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        out, du = jvp2(lambda x: model(synced(d, q), x), (x,), (torch.ones_like(x),))
        loss: torch.Tensor = (out - du.detach()).pow(2).mean()
        return loss

    got = comp(loss)(p, s.x)
    backward(got)
    r = s.w.clone().requires_grad_()
    ref, dref = jvp2(lambda x: model(r, x), (s.X,), (torch.ones_like(s.X),))
    backward((ref - dref.detach()).pow(2).mean())
    return p.grad, r.grad


@compiled("ddp | grad | inside")
def _(s: Setup, comp: Comp) -> tuple[Any, Any]:
    d, _ = s.ddp()
    got = comp(lambda w: grad(lambda w: objective(synced(d, w), s.x))(w))(s.w)
    return got, grad(s.full)(s.w)


@compiled("ddp | vmap then backward | inside")
def _(s: Setup, comp: Comp) -> tuple[Any, Any]:
    d, p = s.ddp()
    backward(comp(lambda q, x: vmap(lambda x: model(synced(d, q), x))(x).pow(2).mean())(p, s.x))
    r = s.w.clone().requires_grad_()
    backward(model(r, s.X).pow(2).mean())
    return p.grad, r.grad


@compiled("ddp | jvp(grad) | inside")
def _(s: Setup, comp: Comp) -> tuple[Any, Any]:
    d, _ = s.ddp()

    def local(q: torch.Tensor) -> torch.Tensor:
        return objective(synced(d, q), s.x)

    def hvp(w: torch.Tensor, v: torch.Tensor) -> Any:
        return jvp2(grad(local), (w,), (v,))[1]

    return comp(hvp)(s.w, s.v), jvp2(grad(s.full), (s.w,), (s.v,))[1]


@compiled("all_reduce_grads | jvp(grad) | inside")
def _(s: Setup, comp: Comp) -> tuple[Any, Any]:
    got = comp(lambda w, v: jvp2(lambda w: ar(grad(objective)(w, s.x)), (w,), (v,))[1])
    return got(s.w, s.v), jvp2(grad(s.full), (s.w,), (s.v,))[1]


@compiled("all_reduce_grads | vmap | inside")
def _(s: Setup, comp: Comp) -> tuple[Any, Any]:
    per = vmap(grad(objective), in_dims=(None, 0))(s.w, s.x[:, None])
    full = vmap(grad(objective), in_dims=(None, 0))(s.w, s.X[:, None])
    return comp(lambda t: vmap(ar)(t))(per), full.view(s.size, PER, 4, 3).mean(0)


@compiled("broadcast_params | jvp | inside")
def _(s: Setup, comp: Comp) -> tuple[Any, Any]:
    def f(w: torch.Tensor, v: torch.Tensor) -> Any:
        return jvp2(lambda w: fdp.broadcast_params({"w": w * (s.rank + 1)})["w"], (w,), (v,))

    return comp(f)(s.w, s.v), (s.w, s.v)


@compiled("sync_batch_norm | grad | inside")
def _(s: Setup, comp: Comp) -> tuple[Any, Any]:
    b = BN(s)
    got = comp(lambda x: grad(lambda x: b.loss(b.sync(x), b.k))(x))(b.x)
    return got, s.mine(grad(b.full_loss)(b.X))


# Compiling three optimizer steps is slow (about 10 s each): one row per transform.
@compiled("optim.sgd | grad (lr) | inside")
def _(s: Setup, comp: Comp) -> tuple[Any, Any]:
    def trained(r: Any) -> torch.Tensor:
        return _train(s, OPTIMIZERS["sgd"], r, s.X)

    got = comp(grad(trained))(torch.tensor(0.05, dtype=D))
    return got, _finite_difference(trained, 0.05)


@compiled("optim.adam | jvp (lr) | inside")
def _(s: Setup, comp: Comp) -> tuple[Any, Any]:
    make, one = OPTIMIZERS["adam"], torch.tensor(1.0, dtype=D)
    tangent = comp(lambda r: jvp2(lambda r: _train(s, make, r, s.X), (r,), (one,))[1])
    got = tangent(torch.tensor(0.05, dtype=D))
    return got, _finite_difference(lambda r: _train(s, make, r, s.X), 0.05)


ONE_GRAPH |= {"optim.sgd | grad (lr) | inside", "optim.adam | jvp (lr) | inside"}


def _run_compiled(rank: int, size: int) -> dict[str, str]:
    out = {}
    for name, fn in COMPILED.items():
        # One graph under fullgraph=True is the same graph without it.
        for fullgraph in (True,) if name in ONE_GRAPH else (True, False):
            torch._dynamo.reset()

            def comp(f: Callable[..., Any], fg: bool = fullgraph) -> Callable[..., Any]:
                return torch.compile(f, backend="aot_eager", fullgraph=fg)

            key = f"{name} | fullgraph={fullgraph}"
            try:
                out[key] = _close(*fn(Setup(rank, size), comp))
            except Exception as e:  # reported per case
                head = "\n".join(str(e).splitlines()[:3])
                fdp_reason = "(reason: fdp." in head and "pytorch/pytorch#193279" in head
                out[key] = "refused" if fdp_reason else f"raised {type(e).__name__}: {head[:300]}"
    return out


@functools.cache
def _compiled_matrix() -> list[dict[str, str]]:
    return ranks.world(2).run(_run_compiled, timeout_s=400)


@pytest.mark.parametrize("fullgraph", [True, False])
@pytest.mark.parametrize("name", list(COMPILED))
def test_compiled(name: str, fullgraph: bool) -> None:
    expected = "ok" if name in ONE_GRAPH or not fullgraph else "refused"
    for rank, results in enumerate(_compiled_matrix()):
        got = results[f"{name} | fullgraph={fullgraph or name in ONE_GRAPH}"]
        assert got == expected, f"rank {rank}: {got}"


def test_compiled_docs_table_matches() -> None:
    """docs/transforms.md's compiled table lists exactly these cases, each with its verdict."""
    text = (pathlib.Path(__file__).parent.parent / "docs" / "transforms.md").read_text()
    rows = re.findall(
        r"^\| `?([^|`]+?)`? \| ([^|]+?) \| ([^|]+?) \| (one graph|fdp's reason) \| reference \|$",
        text,
        re.M,
    )
    documented = {f"{e.strip()} | {t.strip()} | {p.strip()}": v for e, t, p, v in rows}
    expected = {n: ("one graph" if n in ONE_GRAPH else "fdp's reason") for n in COMPILED}
    assert documented == expected
