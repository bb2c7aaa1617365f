"""fdp.DiLoCo and fdp.LocalSGD on 2 gloo ranks against a one-process simulation of the workers.

The simulation keeps one parameter tree and one inner optimizer state per
worker, steps each on its own batches, and every ``sync_every`` steps
averages the pseudo-gradients ``anchor - params`` and steps the anchor with
the outer optimizer, which every worker then continues from.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import fdp
from tests import ranks
from tests.helpers import tensor_leaves

STEPS, SYNC_EVERY = 7, 3  # synchronisations after steps 3 and 6; step 7 stays local


def init_params() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "w1": torch.randn(5, 8, generator=g) / 5**0.5,
        "b1": torch.zeros(8),
        "head": [torch.randn(8, 2, generator=g) / 8**0.5, torch.zeros(2)],
    }


def batch(step: int, worker: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + worker)
    x = torch.randn(6, 5, generator=g)
    return x, torch.cos(x[:, :2])


def loss(params: dict[str, Any], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(x @ params["w1"] + params["b1"])
    return torch.nn.functional.mse_loss(h @ params["head"][0] + params["head"][1], y)


def grads_of(kind: str, params: dict[str, Any], x: torch.Tensor, y: torch.Tensor) -> Any:
    if kind == "vmap":  # per-example gradients under vmap(grad), averaged
        per = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(
            params, x.unsqueeze(1), y.unsqueeze(1)
        )
        return torch.utils._pytree.tree_map(lambda g: None if g is None else g.mean(0), per)
    return torch.func.grad(loss)(params, x, y)


def inner_optimizer(name: str) -> fdp.optim.Optimizer:
    return fdp.optim.sgd(0.1) if name == "local_sgd" else fdp.optim.adamw(0.05, weight_decay=0.01)


def algorithm(name: str, group: Any = None) -> fdp.DiLoCo:
    """The algorithm with its default outer step (the simulation writes that step out)."""
    inner = inner_optimizer(name)
    if name == "local_sgd":
        return fdp.LocalSGD(inner, sync_every=SYNC_EVERY, group=group)
    dtype = torch.bfloat16 if name == "diloco_bf16" else None
    return fdp.DiLoCo(inner, sync_every=SYNC_EVERY, group=group, sync_dtype=dtype)


OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9  # DiLoCo's outer step: Nesterov SGD (Douillard et al.)


def outer_step(
    name: str, anchor: torch.Tensor, delta: torch.Tensor, buf: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The anchor after one outer step on the averaged pseudo-gradient ``delta``.

    LocalSGD averages the parameters: ``anchor - delta``. DiLoCo steps
    Nesterov momentum SGD (torch.optim.SGD's rule, dampening 0): the buffer
    ``b = momentum * b + delta`` (``delta`` at the first step), then
    ``anchor - lr * (delta + momentum * b)``.
    """
    if name == "local_sgd":
        return anchor - delta, None
    buf = delta.clone() if buf is None else OUTER_MOMENTUM * buf + delta
    return anchor - OUTER_LR * (delta + OUTER_MOMENTUM * buf), buf


def skipped(kind: str, step: int, worker: int) -> bool:
    """Whether this worker skips the step ("skip": worker 1's step 1, a loss scaler's inf)."""
    return kind == "skip" and worker == 1 and step == 1


def _train(rank: int, size: int, name: str, kind: str, path: str | None = None) -> dict[str, Any]:
    params, alg = init_params(), algorithm(name)
    state = alg.init(params)
    for step in range(STEPS):
        if path is not None and step == RESUME_AT:
            params, state, alg = _resumed(path, name, params, state, step)
        grads = grads_of(kind, params, *batch(step, rank))
        if skipped(kind, step, rank):  # still an update, with None gradients (docs)
            grads = torch.utils._pytree.tree_map(lambda g: None, grads)
        params, state = alg.update(grads, state, params)
    return {"params": params, "anchor": state["anchor"], "count": int(state["count"])}


RESUME_AT = 4  # after a local step: the workers' parameters and inner states differ


def _resumed(path: str, name: str, params: Any, state: Any, step: int) -> tuple[Any, Any, Any]:
    """This worker's state saved with fdp.save_checkpoint and loaded into a new run's objects."""
    fdp.save_checkpoint(path, {"worker": fdp.PerRank({"p": params, "s": state}), "step": step})
    alg = algorithm(name)  # the restarted job: new objects, a fresh state as `like`
    fresh = init_params()
    like: dict[str, Any] = {"worker": fdp.PerRank({"p": fresh, "s": alg.init(fresh)}), "step": 0}
    loaded = fdp.load_checkpoint(path, like)
    if loaded["step"] != step:
        raise AssertionError(f"loaded step {loaded['step']}, saved {step}")
    return loaded["worker"].value["p"], loaded["worker"].value["s"], alg


def simulate(name: str, kind: str, workers: int) -> list[dict[str, Any]]:
    """The workers in one process: local inner steps, the averaged outer step every H."""
    opt = inner_optimizer(name)
    params = [init_params() for _ in range(workers)]
    inner = [opt.init(p) for p in params]
    anchor = init_params()
    leaves, spec = fdp._tree.flatten(anchor)
    bufs: list[torch.Tensor | None] = [None] * len(leaves)
    for step in range(STEPS):
        for w in range(workers):
            if skipped(kind, step, w):  # the worker's parameters and inner state stay
                continue
            g = grads_of(kind, params[w], *batch(step, w))
            params[w], inner[w] = opt.update(g, inner[w], params[w])
        if (step + 1) % SYNC_EVERY == 0:
            new = []
            for i, a in enumerate(fdp._tree.flatten(anchor)[0]):
                delta = _mean_delta(name, a, [fdp._tree.flatten(p)[0][i] for p in params])
                stepped, bufs[i] = outer_step(name, a, delta, bufs[i])
                new.append(stepped)
            anchor = fdp._tree.unflatten(spec, new)
            params = [
                torch.utils._pytree.tree_map(lambda t: None if t is None else t.clone(), anchor)
                for _ in range(workers)
            ]
    return [{"params": p, "anchor": anchor} for p in params]


def _mean_delta(name: str, anchor: torch.Tensor, ps: list[torch.Tensor]) -> torch.Tensor:
    if name == "diloco_bf16":  # each delta in bf16, scaled by 1/n, summed in bf16
        parts = [((anchor - p).to(torch.bfloat16) * (1 / len(ps))).to(torch.bfloat16) for p in ps]
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        return total.to(anchor.dtype)
    return torch.stack([anchor - p for p in ps]).mean(0)


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("diloco", "grad"),
        ("local_sgd", "grad"),
        ("diloco_bf16", "grad"),
        ("diloco", "vmap"),
        ("diloco", "skip"),
    ],
)
def test_workers_equal_the_one_process_simulation(name: str, kind: str) -> None:
    check(ranks.world(2).run(_train, name, kind), simulate(name, kind, 2))


@pytest.mark.parametrize("name", ["diloco", "local_sgd", "diloco_bf16"])
def test_a_run_resumed_from_each_workers_checkpoint_equals_the_simulation(
    tmp_path: Path, name: str
) -> None:
    # Before fdp.PerRank, save_checkpoint refused the workers' inner states on every
    # rank (they differ by design) and advised computing the loss from ddp(params).
    check(ranks.world(2).run(_train, name, "grad", str(tmp_path / "c")), simulate(name, "grad", 2))


def check(got: list[dict[str, Any]], expected: list[dict[str, Any]]) -> None:
    """Each worker's parameters and anchor are the simulation's."""
    for rank in range(2):
        assert got[rank]["count"] == STEPS
        for key in ("params", "anchor"):
            a, _ = fdp._tree.flatten(got[rank][key])
            b, _ = fdp._tree.flatten(expected[rank][key])
            for x, y in zip(a, b, strict=True):
                if x is None:
                    assert y is None
                else:
                    torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)
    # Step 7 was local: the workers differ again, around the same anchor.
    assert not torch.equal(got[0]["params"]["w1"], got[1]["params"]["w1"])
    torch.testing.assert_close(got[0]["anchor"]["w1"], got[1]["anchor"]["w1"], rtol=0, atol=0)


def _counts_differ(rank: int, size: int) -> str:
    params, alg = init_params(), algorithm("diloco")
    state = alg.init(params)
    if rank == 1:  # resumed with another worker's count: its syncs pair with the wrong ones
        state["count"] += SYNC_EVERY
    try:
        for step in range(SYNC_EVERY):
            params, state = alg.update(grads_of("grad", params, *batch(step, rank)), state, params)
    except ValueError as e:
        return str(e)
    return "no error"


def test_workers_whose_counts_differ_are_refused_on_every_worker() -> None:
    messages = ranks.world(2).run(_counts_differ)
    for m in messages:
        assert "fdp.DiLoCo.update: `state` expected the same step count on every worker" in m


def _apart(rank: int, size: int, kind: str, broadcast: bool) -> tuple[str, list[float]]:
    """Each rank's parameters shifted by its rank (as from another seed)."""
    start = init_params()
    params = {
        k: [t + rank for t in v] if isinstance(v, list) else v + rank for k, v in start.items()
    }
    if broadcast:
        params = fdp.broadcast_params(params)
    alg = algorithm(kind)
    try:
        state = alg.init(params)
    except ValueError as e:
        return str(e), []
    for step in range(SYNC_EVERY):
        params, state = alg.update(grads_of("grad", params, *batch(step, rank)), state, params)
    return "trained", [float(t.sum()) for t in tensor_leaves(params)]


@pytest.mark.parametrize("kind", ["diloco", "local_sgd"])
def test_workers_that_start_apart_are_refused_at_init(kind: str) -> None:
    # Before: each outer step moved every worker's own anchor, and the workers trained
    # different models without an error (after a sync the parameters still differed).
    for message, _ in ranks.world(2).run(_apart, kind, False):
        assert "init: `params` leaf params[" in message
        assert "expected the same values on every rank at init" in message
        assert "fdp.broadcast_params(params)" in message
    (first, sums0), (_, sums1) = ranks.world(2).run(_apart, kind, True)  # rank 0's, everywhere
    assert first == "trained"
    assert sums0 == sums1  # after a sync, every worker holds the same parameters


def _inside_transform(rank: int, size: int) -> list[str]:
    params, alg = init_params(), algorithm("diloco")
    state = alg.init(params)
    grads = grads_of("grad", params, *batch(0, rank))

    def w1_after(p: dict[str, Any]) -> torch.Tensor:
        out: torch.Tensor = alg.update(grads, state, p)[0]["w1"]
        return out.sum()

    ones = torch.utils._pytree.tree_map(torch.ones_like, params)
    calls: dict[str, Callable[[], Any]] = {
        "grad": lambda: torch.func.grad(w1_after)(params),
        "jvp": lambda: torch.func.jvp(w1_after, (params,), (ones,)),
        "vmap of parameters": lambda: torch.func.vmap(
            lambda x: alg.update(grads, state, {**params, "b1": x})[0]["b1"]
        )(torch.zeros(3, 8)),
        "vmap of gradients": lambda: torch.func.vmap(
            lambda g: alg.update({**grads, "b1": g}, state, params)[0]["b1"]
        )(torch.zeros(3, 8)),
    }
    messages = []
    for name, call in calls.items():
        try:
            call()
        except RuntimeError as e:
            messages.append(f"{name}: {e}")
        else:
            messages.append(f"{name}: no error")
    # Outside, the same state still steps: the refusals changed nothing.
    params, state = alg.update(grads, state, params)
    messages.append(f"count {int(state['count'])}")
    return messages


def test_update_inside_a_transform_is_refused_on_every_worker() -> None:
    for messages in ranks.world(2).run(_inside_transform):
        *refusals, count = messages
        assert count == "count 1"
        assert len(refusals) == 4
        for m in refusals:
            assert "fdp.DiLoCo.update: expected a call outside torch.func transforms" in m, m


def test_bad_options_are_refused() -> None:
    inner = fdp.optim.sgd(0.1)
    with pytest.raises(
        ValueError, match=r"fdp.DiLoCo: `sync_every` expected a positive int; got 0"
    ):
        fdp.DiLoCo(inner, sync_every=0)
    with pytest.raises(TypeError, match=r"fdp.LocalSGD: `sync_dtype` expected a floating-point"):
        fdp.LocalSGD(inner, sync_every=2, sync_dtype=torch.int32)
    with pytest.raises(TypeError, match=r"fdp.DiLoCo: `inner` expected an fdp.optim optimizer"):
        fdp.DiLoCo(torch.optim.SGD, sync_every=2)  # type: ignore[arg-type]
