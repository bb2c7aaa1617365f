"""Streaming DiLoCo (fdp.DiLoCo with fragments, overlap, alpha, quantized pseudo-gradients)
on 2 and 3 gloo ranks against a one-process simulation of the workers.

The simulation keeps one parameter tree and one inner optimizer state per
worker and one outer momentum buffer per leaf. After inner step ``c``
(counted from 1), fragment ``i`` sends its pseudo-gradient ``anchor -
params`` when ``c % H == i * H // P``; ``tau`` steps later the workers'
mean (through the wire's rounding, written out below) steps the fragment's
anchor with Nesterov SGD, and every worker's fragment becomes ``alpha *
local + (1 - alpha) * anchor``.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch

import fdp
from tests import ranks
from tests.test_diloco import OUTER_LR, OUTER_MOMENTUM, batch, grads_of, init_params

H, STEPS = 4, 11  # fragment 0 sends after steps 4 and 8, fragment 1 after 2, 6 and 10
BLOCK = 256  # values per scale on a quantized wire
# init_params's leaves in the tree's order (b1, head.0, head.1, w1: 8, 16, 2 and 40
# values): two contiguous fragments of about 33 values each; w1 alone is the second.
LABELS = {"w1": 1, "b1": 0, "head": [0, 0]}
MIXED = {"w1": 0, "b1": 1, "head": [1, 0]}  # a user's labels, not contiguous


def options(case: str) -> dict[str, Any]:
    """The DiLoCo options of each case (fragments as the number or the labels)."""
    cases: dict[str, dict[str, Any]] = {
        "fragments": {"fragments": 2},
        "overlap": {"fragments": 2, "overlap": 1, "alpha": 0.5},
        "overlap2_labels": {"fragments": MIXED, "overlap": 2},
        "one_fragment_overlap": {"fragments": 1, "overlap": 3, "alpha": 0.25},
        "int8": {"fragments": 2, "overlap": 1, "sync_dtype": torch.int8},
        "float8": {"fragments": 2, "sync_dtype": torch.float8_e4m3fn},
        "bf16": {"fragments": 2, "overlap": 1, "sync_dtype": torch.bfloat16},
    }
    return cases[case]


def labels_of(opts: dict[str, Any]) -> dict[str, Any]:
    f = opts["fragments"]
    return f if isinstance(f, dict) else LABELS if f == 2 else {"w1": 0, "b1": 0, "head": [0, 0]}


def algorithm(opts: dict[str, Any], *, local_sgd: bool = False) -> fdp.DiLoCo:
    if local_sgd:
        return fdp.LocalSGD(fdp.optim.sgd(0.1), sync_every=H, **opts)
    return fdp.DiLoCo(fdp.optim.adamw(0.05, weight_decay=0.01), sync_every=H, **opts)


def _train(
    rank: int,
    size: int,
    case: str,
    local_sgd: bool,
    resume_at: int | None,
    compiled: bool = False,
    path: str | None = None,
) -> dict[str, Any]:
    params, alg = init_params(), algorithm(options(case), local_sgd=local_sgd)
    state = alg.init(params)
    grads_fn = torch.compile(grads_of, fullgraph=True) if compiled else grads_of
    for step in range(STEPS):
        if step == resume_at:  # a saved state, a new object: the reduction in flight redone
            alg = algorithm(options(case), local_sgd=local_sgd)
            params, state = _reloaded(path, params, state, alg)
        grads = grads_fn("grad", params, *batch(step, rank))
        params, state = alg.update(grads, state, params)
    busy = sum(slot["started"] >= 0 for slot in state["in_flight"])
    return {"params": params, "anchor": state["anchor"], "in_flight": busy}


def _reloaded(path: str | None, params: Any, state: Any, alg: fdp.DiLoCo) -> tuple[Any, Any]:
    """This worker's params and state through torch.save, or fdp's checkpoint (``path``)."""
    if path is None:
        buffer = io.BytesIO()
        torch.save({"params": params, "state": state}, buffer)
        buffer.seek(0)
        saved = torch.load(buffer, weights_only=False)
        return saved["params"], saved["state"]
    fdp.save_checkpoint(path, {"worker": fdp.PerRank({"params": params, "state": state})})
    fresh = init_params()
    like = {"worker": fdp.PerRank({"params": fresh, "state": alg.init(fresh)})}
    worker = fdp.load_checkpoint(path, like)["worker"].value
    return worker["params"], worker["state"]


def _rounded(x: torch.Tensor, wire: torch.dtype | None) -> torch.Tensor:
    """``x`` (1-D float32) after the wire: each block of 256 scaled by max|x| / top."""
    if wire is None or wire.itemsize > 1:  # not a quantized wire
        return x
    out = []
    for block in torch.split(x, BLOCK):
        top = 127.0 if wire == torch.int8 else torch.finfo(wire).max
        scale = torch.maximum(block.amax(), -block.amin()) / top
        safe = scale if scale > 0 else torch.ones(())
        q = (block / safe).round() if wire == torch.int8 else (block / safe).to(wire).float()
        out.append(q * scale)
    return torch.cat(out)


def mean_over_wire(deltas: list[torch.Tensor], wire: torch.dtype | None) -> torch.Tensor:
    """The workers' mean of one fragment's flat deltas, as the wire computes it."""
    n = len(deltas)
    if wire == torch.bfloat16:  # each scaled by 1/n in bfloat16, summed in bfloat16
        parts = [(d.to(torch.bfloat16) * (1 / n)).to(torch.bfloat16) for d in deltas]
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        return total.float()
    if wire is None:
        return torch.stack(deltas).mean(0)
    if n == 2:  # each whole vector rounded, summed in float32 in worker order, scaled
        total = _rounded(deltas[0], wire).clone()
        total += _rounded(deltas[1], wire)
        return total * 0.5
    # Chunk j of every worker's vector (chunks of ceil(len / n), the last padded),
    # rounded, summed in float32 in worker order, scaled, rounded again.
    chunk = -(-deltas[0].numel() // n)
    padded = [torch.nn.functional.pad(d, (0, chunk * n - d.numel())) for d in deltas]
    means = []
    for j in range(n):
        parts = [_rounded(p[j * chunk : (j + 1) * chunk], wire) for p in padded]
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        means.append(_rounded(total * (1.0 / n), wire))
    return torch.cat(means)[: deltas[0].numel()]


def simulate(
    case: str, workers: int, *, local_sgd: bool, steps: list[int] | None = None
) -> list[dict[str, Any]]:
    """The workers in one process; ``steps``: each worker's number of batches (join).

    A worker past its batches takes no inner step and sends zeros; the
    mean is over the workers still training. At the first synchronisation
    with none training the run ends: that one is dropped and the reductions
    in flight land in the order they started.
    """
    opts = options(case)
    fragment_of = fdp._tree.flatten(labels_of(opts))[0]
    tau, alpha, wire = opts.get("overlap", 0), opts.get("alpha", 0.0), opts.get("sync_dtype")
    frags, joined = max(fragment_of) + 1, steps is not None
    steps = steps if steps is not None else [STEPS] * workers
    opt = fdp.optim.sgd(0.1) if local_sgd else fdp.optim.adamw(0.05, weight_decay=0.01)
    spec = fdp._tree.flatten(init_params())[1]
    params = [fdp._tree.flatten(init_params())[0] for _ in range(workers)]
    inner = [opt.init(fdp._tree.unflatten(spec, p)) for p in params]
    anchor = fdp._tree.flatten(init_params())[0]
    bufs: list[torch.Tensor | None] = [None] * len(anchor)
    flying: list[tuple[int, int, list[list[torch.Tensor]], int]] = []

    def land(entry: tuple[int, int, list[list[torch.Tensor]], int]) -> None:
        i, _, sent, training = entry
        leaves = [k for k, f in enumerate(fragment_of) if f == i]
        flat = [torch.cat([d.reshape(-1) for d in s]) for s in sent]
        mean = mean_over_wire(flat, wire)
        mean = mean * (workers / training) if training < workers else mean
        for k, m in zip(
            leaves, torch.split(mean, [anchor[k].numel() for k in leaves]), strict=True
        ):
            delta = m.view(anchor[k].shape)
            if local_sgd:  # the outer step of plain averaging: lr 1, no momentum
                anchor[k] = anchor[k] - delta
            else:  # Nesterov SGD (torch.optim.SGD's rule, dampening 0)
                b = bufs[k]
                b = delta.clone() if b is None else OUTER_MOMENTUM * b + delta
                anchor[k], bufs[k] = anchor[k] - OUTER_LR * (delta + OUTER_MOMENTUM * b), b
            for w in range(workers):
                params[w][k] = alpha * params[w][k] + (1 - alpha) * anchor[k]

    c = 0
    while c < STEPS or joined:
        c += 1
        train = [w for w in range(workers) if c <= steps[w]]
        for w in train:
            tree = fdp._tree.unflatten(spec, params[w])
            g = grads_of("grad", tree, *batch(c - 1, w))
            tree, inner[w] = opt.update(g, inner[w], tree)
            params[w] = fdp._tree.flatten(tree)[0]
        landing = [f for f in flying if f[1] + tau == c]
        starting = [i for i in range(frags) if c % H == i * H // frags]
        for i in starting:
            leaves = [k for k, f in enumerate(fragment_of) if f == i]
            sent = [
                [
                    anchor[k] - params[w][k] if w in train else torch.zeros_like(anchor[k])
                    for k in leaves
                ]
                for w in range(workers)
            ]
            if train:
                landing += [(i, c, sent, len(train))] if tau == 0 else []
                flying += [(i, c, sent, len(train))] if tau > 0 else []
        for entry in landing:
            flying = [f for f in flying if f is not entry]
            land(entry)
        if joined and starting and not train:  # every worker has left join
            for entry in sorted(flying, key=lambda f: f[1]):
                land(entry)
            flying = []
            break
    return [
        {
            "params": fdp._tree.unflatten(spec, p),
            "anchor": fdp._tree.unflatten(spec, anchor),
            "in_flight": len(flying),
            **({"count": c} if joined else {}),
        }
        for p in params
    ]


def check(got: list[dict[str, Any]], expected: list[dict[str, Any]], tol: float) -> None:
    for rank, (mine, theirs) in enumerate(zip(got, expected, strict=True)):
        for key in ("params", "anchor"):
            a, _ = fdp._tree.flatten(mine[key])
            b, _ = fdp._tree.flatten(theirs[key])
            for x, y in zip(a, b, strict=True):
                torch.testing.assert_close(x, y, rtol=tol, atol=tol, msg=f"{rank} {key}")
        assert mine["in_flight"] == theirs["in_flight"]
        assert mine.get("count") == theirs.get("count")


@pytest.mark.parametrize(
    "case",
    ["fragments", "overlap", "overlap2_labels", "one_fragment_overlap", "int8", "float8", "bf16"],
)
def test_streaming_equals_the_one_process_simulation(case: str) -> None:
    got = ranks.world(2).run(_train, case, False, None)
    tol = 1e-6
    check(got, simulate(case, 2, local_sgd=False), tol)


def test_compiled_inner_steps_while_a_reduction_is_in_flight() -> None:
    """The inner step's gradients compiled (fullgraph); the gloo work runs beside them."""
    got = ranks.world(2).run(_train, "overlap2_labels", False, None, True)
    check(got, simulate("overlap2_labels", 2, local_sgd=False), 1e-5)


def test_three_workers_int8_and_local_sgd() -> None:
    got = ranks.world(3).run(_train, "int8", True, None)
    check(got, simulate("int8", 3, local_sgd=True), 1e-6)


@pytest.mark.parametrize(
    ("case", "via"),
    [("overlap", "torch.save"), ("int8", "torch.save"), ("overlap2_labels", "torch.save"),
     ("overlap", "fdp.PerRank"), ("int8", "fdp.PerRank")],
)  # fmt: skip
def test_a_state_saved_with_a_reduction_in_flight_resumes(
    tmp_path: Path, case: str, via: str
) -> None:
    """Saved after step 6 sent fragment 1 (it lands at 7 or 8): a new object redoes it."""
    path = None if via == "torch.save" else str(tmp_path / "c")
    got = ranks.world(2).run(_train, case, False, 6, False, path)
    check(got, simulate(case, 2, local_sgd=False), 1e-6)


def _train_joined(rank: int, size: int, case: str, local_sgd: bool, steps: list[int]) -> Any:
    """This rank's own number of batches, inside ``join``."""
    params, alg = init_params(), algorithm(options(case), local_sgd=local_sgd)
    state = alg.init(params)
    with alg.join(params, state) as joined:
        for step in range(steps[rank]):
            grads = grads_of("grad", params, *batch(step, rank))
            params, state = alg.update(grads, state, params)
    state = joined.state
    busy = sum(slot["started"] >= 0 for slot in state["in_flight"])
    return {
        "params": joined.params,
        "anchor": state["anchor"],
        "in_flight": busy,
        "count": int(state["count"]),
    }


@pytest.mark.parametrize(
    ("case", "steps"),
    [
        ("fragments", [11, 11]),  # equal shards: the block ends at the next synchronisation
        ("fragments", [11, 5]),
        ("overlap", [6, 11]),  # fragment 1 in flight when rank 0 leaves
        ("int8", [9, 0]),  # a rank with no batch at all
        ("one_fragment_overlap", [3, 10]),
    ],
)
def test_join_equals_the_simulation_with_uneven_shards(case: str, steps: list[int]) -> None:
    """A rank that leaves mirrors the others' synchronisations; no rank waits for a timeout."""
    got = ranks.world(2).run(_train_joined, case, False, steps)
    check(got, simulate(case, 2, local_sgd=False, steps=steps), 1e-6)


def test_join_with_three_workers_leaving_at_different_steps() -> None:
    """Three ranks, int8's two phases (an all-to-all, then an all-gather), LocalSGD."""
    steps = [7, 11, 2]
    got = ranks.world(3).run(_train_joined, "int8", True, steps)
    check(got, simulate("int8", 3, local_sgd=True, steps=steps), 1e-6)


def test_the_default_fragments_are_contiguous_shares() -> None:
    tree = {"a": torch.zeros(100), "b": torch.zeros(10), "c": None, "d": [torch.zeros(50)] * 3}
    state = fdp.DiLoCo(fdp.optim.sgd(0.1), sync_every=4, fragments=3).init(tree)
    # 260 values, shares of about 87: each leaf where its middle element falls
    # (a's at 50, b's at 105, the d's at 135, 185 and 235).
    assert state["fragments"].tolist() == [0, 1, -1, 1, 2, 2]
    state = fdp.DiLoCo(fdp.optim.sgd(0.1), sync_every=4, fragments=4).init(tree)
    assert state["fragments"].tolist() == [0, 1, -1, 2, 2, 3]  # shares of 65
    assert len(state["outer"]) == 4
    small = {"a": torch.zeros(100), "b": torch.zeros(1), "c": torch.zeros(1)}
    state = fdp.DiLoCo(fdp.optim.sgd(0.1), sync_every=4, fragments=3).init(small)
    assert state["fragments"].tolist() == [0, 1, 2]  # never an empty fragment


def _nested_join(rank: int, size: int) -> dict[str, Any]:
    local = fdp.LocalSGD(fdp.optim.sgd(0.1), sync_every=4)
    params = init_params()
    state = local.init(params)
    with local.join(params, state) as joined:
        with (
            pytest.raises(RuntimeError, match=r"fdp.LocalSGD.join: already inside join"),
            local.join(params, state),
        ):
            pass
        for step in range(3):  # one worker: the mirror ends at the first synchronisation
            params, state = local.update(grads_of("grad", params, *batch(step, 0)), state, params)
    return {"count": int(joined.state["count"]), "params": joined.params}


def test_a_join_inside_another_is_refused_and_one_worker_ends_at_the_next_sync() -> None:
    got = ranks.world(1).run(_nested_join)[0]
    assert got["count"] == H  # three updates, then the mirror's fourth: a sync with none training
    reference, state = init_params(), fdp.optim.sgd(0.1).init(init_params())
    for step in range(3):
        g = grads_of("grad", reference, *batch(step, 0))
        reference, state = fdp.optim.sgd(0.1).update(g, state, reference)
    check(
        [{**got, "anchor": init_params(), "in_flight": 0}],
        [{"params": reference, "anchor": init_params(), "in_flight": 0, "count": H}],
        1e-6,
    )


def _block(w: int, b: int) -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(w), "b": torch.zeros(b)}


def test_the_default_fragments_keep_each_block_whole() -> None:
    """A transformer's blocks, embeddings and head: never cut inside one (FSDP's units)."""
    tree = {
        "embed": {"tok": torch.zeros(100), "pos": torch.zeros(20)},
        "blocks": [_block(30, 5) for _ in range(4)],
        "head": {"norm": torch.zeros(5), "out": torch.zeros(50)},
    }
    # The tree's order: blocks 0-3 (35 values each), embed (120), head (55); 315 in all.
    # Two shares of 157.5: the blocks' middles fall in the first, embed's (at 200) and
    # head's in the second. Three shares of 105: block 3 (middle 122.5) and embed (200)
    # in the second, head (287.5) in the third.
    by_leaf = {2: [0] * 8 + [1] * 4, 3: [0] * 6 + [1] * 4 + [2] * 2}
    for p, expected in by_leaf.items():
        state = fdp.DiLoCo(fdp.optim.sgd(0.1), sync_every=4, fragments=p).init(tree)
        assert state["fragments"].tolist() == expected
    one_block = {"model": {"a": torch.zeros(10), "b": torch.zeros(10), "c": torch.zeros(10)}}
    state = fdp.DiLoCo(fdp.optim.sgd(0.1), sync_every=4, fragments=3).init(one_block)
    assert state["fragments"].tolist() == [0, 1, 2]  # fewer blocks than fragments: leaves


def _shard_fragments(rank: int, size: int, p: int) -> tuple[list[list[int]], list[int]]:
    params = {
        "embed": {"tok": torch.randn(40, 8), "pos": torch.randn(6, 8)},
        "blocks": [
            {"w": torch.randn(8, 8), "g": torch.ones(200, dtype=torch.float64)} for _ in range(3)
        ],
        "head": torch.randn(8, 40),
    }
    fsdp = fdp.FullyShardedDataParallel(params)
    shards = fsdp.shard(params)
    labels = fdp.DiLoCo(fdp.optim.sgd(0.1), sync_every=4, fragments=p).init(shards)
    got, at = labels["fragments"].tolist(), 0
    per_unit = []
    for name in sorted(shards):  # the tree's order
        per_unit.append(got[at : at + len(shards[name])])
        at += len(shards[name])
    in_order = [per_unit[sorted(shards).index(name)][0] for name in fsdp.unit_names]
    return per_unit, in_order


def test_the_default_fragments_of_fsdp_shards_are_whole_units() -> None:
    """``fsdp.shard``'s dict: a unit's flat tensors (one per dtype) in one fragment, the
    fragments contiguous in FSDP's unit order."""
    per_unit, in_order = ranks.world(1).run(_shard_fragments, 4)[0]
    assert any(len(labels) == 2 for labels in per_unit)  # the blocks: float32 and float64
    assert all(len(set(labels)) == 1 for labels in per_unit)
    assert in_order == sorted(in_order)
    assert set(in_order) == {0, 1, 2, 3}


def test_bad_streaming_options_are_refused() -> None:
    inner, tree = fdp.optim.sgd(0.1), init_params()
    with pytest.raises(ValueError, match=r"fdp.DiLoCo: `overlap` expected an int from 0 to"):
        fdp.DiLoCo(inner, sync_every=4, overlap=4)
    with pytest.raises(ValueError, match=r"fdp.DiLoCo: `alpha` expected a float in \[0, 1\]"):
        fdp.DiLoCo(inner, sync_every=4, alpha=1.5)
    with pytest.raises(ValueError, match=r"`fragments` expected an int from 1 to sync_every"):
        fdp.DiLoCo(inner, sync_every=4, fragments=5)
    with pytest.raises(ValueError, match=r"expected an int from 1 to the number of tensor"):
        fdp.DiLoCo(inner, sync_every=8, fragments=5).init(tree)
    bad = {"w1": 1, "b1": 0, "head": [0, "x"]}
    with pytest.raises(
        ValueError, match=r"`fragments` leaf fragments\['head'\]\[1\] expected a non-neg"
    ):
        fdp.DiLoCo(inner, sync_every=4, fragments=bad).init(tree)
    with pytest.raises(ValueError, match=r"expected labels 0..P-1, each used by a leaf; got"):
        fdp.DiLoCo(inner, sync_every=4, fragments={"w1": 2, "b1": 0, "head": [0, 0]}).init(tree)
    with pytest.raises(
        ValueError,
        match=r"`fragments` expected an int or a tree of ints with the parameters' structure; "
        r"expected 4 leaves, got 1; missing fragments\['b1'\], fragments\['head'\]\[0\], "
        r"fragments\['head'\]\[1\]$",
    ):
        fdp.DiLoCo(inner, sync_every=4, fragments={"w1": 0}).init(tree)
    # As many labels as leaves, one under a key the parameters do not have: not mapped by
    # position (it would label b1 with head's label)
    with pytest.raises(
        ValueError, match=r"missing fragments\['b1'\]; unexpected fragments\['bias'\]$"
    ):
        fdp.DiLoCo(inner, sync_every=4, fragments={"w1": 0, "bias": 1, "head": [1, 0]}).init(tree)
