"""fdp._compat picks each private torch API by capability: both branches, against a reference.

Every torch release of the supported range (``nox -s torch_range``) runs the
branch it has; here the other branch is forced (the API patched away) and
must give the same answer, or the documented safe one.
"""

from __future__ import annotations

import datetime
import types
from typing import Any

import pytest
import torch
import torch.distributed as dist

from fdp import _compat
from tests import ranks


def test_storage_users_counts_the_tensors_that_share_a_storage() -> None:
    t = torch.ones(4)
    assert _compat.storage_users(t) == 1
    views = [t[:2], t.view(2, 2)]
    assert _compat.storage_users(t) == 1 + len(views)
    del views
    assert _compat.storage_users(t) == 1


def test_storage_users_without_the_api_never_allows_reuse(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(torch._C, "_storage_Use_Count")
    assert _compat.storage_users(torch.ones(2)) >= 1 << 30


@pytest.mark.parametrize("available", [True, False])
def test_foreach_copy_equals_copy_either_way(
    available: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not available:
        monkeypatch.delattr(torch, "_foreach_copy_")
    src = [torch.randn(3), torch.randn(2, 2).t(), torch.randn(1, dtype=torch.float64)]
    dst = [torch.empty(3), torch.empty(2, 2), torch.empty(1, dtype=torch.float64)]
    _compat.foreach_copy_(dst, src)
    for d, s in zip(dst, src, strict=True):
        torch.testing.assert_close(d, s)
    _compat.foreach_copy_([], [])  # foreach ops refuse empty lists; this must not


def test_current_autograd_node_inside_and_outside_backward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert _compat.current_autograd_node() is None
    seen: list[Any] = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2

    def hook(g: torch.Tensor) -> torch.Tensor:
        seen.append(_compat.current_autograd_node())
        return g

    y.register_hook(hook)  # type: ignore[no-untyped-call]
    torch.autograd.backward(y.sum())
    assert seen[0] is not None  # the node running the hook
    monkeypatch.delattr(torch._C, "_current_autograd_node")
    assert _compat.current_autograd_node() is None  # the documented fallback


def test_compiler_disable_with_and_without_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def eager(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)  # a side effect dynamo would refuse to trace under fullgraph
        return x + 1

    disabled = _compat.compiler_disable(eager, reason="test")
    compiled = torch.compile(lambda x: disabled(x) * 2, backend="eager")
    torch.testing.assert_close(compiled(torch.ones(2)), torch.full((2,), 4.0))
    assert calls

    real = torch.compiler.disable

    def old_disable(fn: Any = None, recursive: bool = True) -> Any:  # no `reason` (torch < 2.7)
        return real(fn, recursive=recursive)  # type: ignore[no-untyped-call]

    monkeypatch.setattr(torch.compiler, "disable", old_disable)
    again = _compat.compiler_disable(eager, reason="test")
    torch.testing.assert_close(again(torch.ones(2)), torch.full((2,), 2.0))


def _eager_form(x: torch.Tensor, ran: list[str], *, broken: bool) -> torch.Tensor:
    ran.append("eager")
    return x + 1


def _traced_form(x: torch.Tensor, ran: list[str], *, broken: bool) -> torch.Tensor:
    # Module-level, as fdp's: dynamo 2.13 drops a substituted closure's cell mutations.
    ran.append("traced")
    if broken:
        torch._dynamo.graph_break()
    return x + 1


def test_traced_whole_traces_its_twin_or_runs_the_eager_form_where_it_breaks() -> None:
    whole = _compat.traced_whole(_eager_form, _traced_form)
    x = torch.ones(2)
    ran: list[str] = []
    torch.testing.assert_close(whole(x, ran, broken=False), x + 1)
    assert ran == ["eager"]
    for broken, form in ((False, "traced"), (True, "eager")):
        ran.clear()
        torch._dynamo.reset()
        compiled = torch.compile(lambda x, b=broken: whole(x, ran, broken=b) * 2, backend="eager")
        torch.testing.assert_close(compiled(x), (x + 1) * 2)
        assert ran == [form], broken


def test_is_compiled_module() -> None:
    net = torch.nn.Linear(2, 2)
    assert not _compat.is_compiled_module(net)
    assert _compat.is_compiled_module(torch.compile(net))


def test_order_effects_answers_false_without_the_api() -> None:
    assert _compat.order_effects(types.SimpleNamespace()) is False


def test_inductor_overlap_passes_fall_back_to_the_older_pair(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from torch._inductor import comms

    preferred = _compat.inductor_overlap_passes()
    assert preferred
    assert all(hasattr(comms, name) for name in preferred)
    monkeypatch.delattr(comms, "reorder_communication_preserving_peak_memory", raising=False)
    fallback = _compat.inductor_overlap_passes()
    assert set(fallback) <= {"sink_waits", "raise_comms"}
    assert all(hasattr(comms, name) for name in fallback)


def test_inductor_spmd_check_off_names_a_config_torch_compile_accepts() -> None:
    # torch 2.12 checks by default that every rank compiled one graph (a
    # collective while compiling); ranks that use different leaves do not.
    # Set through config.patch, which restores it (monkeypatch would delete
    # a class attribute it did not find in the class's own __dict__).
    from torch._inductor import config

    sub = getattr(config, "aten_distributed_optimizations", None)
    if sub is None or not hasattr(sub, "spmd_check"):
        assert _compat.inductor_spmd_check_off() == {}
        return
    name = "aten_distributed_optimizations.spmd_check"

    def on() -> Any:
        return sub.spmd_check

    before = on()
    with config.patch({name: False}):
        assert _compat.inductor_spmd_check_off() == {}
    with config.patch({name: True}):
        options = _compat.inductor_spmd_check_off()
        assert options == {name: False}
        with config.patch(options):  # the name a torch.compile option is patched by
            assert on() is False
        assert on() is True
    assert on() is before


def _collectives_both_names(rank: int, size: int) -> list[list[float]]:
    out = []
    for new_names in (True, False):
        patched: dict[str, Any] = {}
        if not new_names:  # torch before 2.13: only the old names exist
            for name in ("reduce_scatter_single", "all_gather_single"):
                if hasattr(dist, name):
                    patched[name] = getattr(dist, name)
                    delattr(dist, name)
        try:
            flat = torch.arange(2.0 * size) + rank
            mine = torch.empty(2)
            _compat.reduce_scatter_single(mine, flat, None).wait()
            full = torch.empty(2 * size)
            _compat.all_gather_single(full, mine, None).wait()
            out.append(full.tolist())
        finally:
            for name, fn in patched.items():
                setattr(dist, name, fn)
    return out


def test_reduce_scatter_and_all_gather_under_either_name() -> None:
    size = 2
    # Every rank's flat is arange + rank: the sum over ranks, gathered back whole.
    expected = (torch.arange(2.0 * size) * size + sum(range(size))).tolist()
    for results in ranks.world(size).run(_collectives_both_names):
        assert results == [expected, expected]


def _all_reduce_sum_both_ways(rank: int, size: int) -> list[list[Any]]:
    out = []
    group = dist.new_group(list(range(size)))
    for direct in (True, False):
        options = dist.AllreduceOptions
        if not direct:  # without the options class: the public call
            delattr(dist, "AllreduceOptions")
        try:
            got = []
            for t, g in (
                (torch.arange(3.0) + rank, None),
                (torch.arange(3.0, dtype=torch.float64) * (rank + 1), group),
                (torch.tensor([1 + 2j, 3 - 1j]) * (rank + 1), None),  # complex: the public call
            ):
                _compat.all_reduce_sum(t, g).wait()
                got.append(t.tolist())
            out.append(got)
        finally:
            setattr(dist, "AllreduceOptions", options)  # noqa: B010
    return out


def test_all_reduce_sum_sums_in_place_either_way() -> None:
    size = 2
    ranks_ = range(size)
    expected = [
        torch.stack([torch.arange(3.0) + r for r in ranks_]).sum(0).tolist(),
        torch.stack([torch.arange(3.0, dtype=torch.float64) * (r + 1) for r in ranks_])
        .sum(0)
        .tolist(),
        torch.stack([torch.tensor([1 + 2j, 3 - 1j]) * (r + 1) for r in ranks_]).sum(0).tolist(),
    ]
    for results in ranks.world(size).run(_all_reduce_sum_both_ways):
        assert results == [expected, expected]


def _timeouts(rank: int, size: int) -> tuple[float | None, float | None]:
    timeout = _compat.group_timeout(None)
    broken = _compat.group_timeout(types.SimpleNamespace(_device_types=["cpu"]))
    return (
        None if timeout is None else timeout.total_seconds(),
        None if broken is None else broken.total_seconds(),
    )


def test_group_timeout_reads_the_groups_timeout_or_answers_none() -> None:
    for timeout, broken in ranks.world(2).run(_timeouts):
        assert timeout == datetime.timedelta(seconds=ranks.PG_TIMEOUT_S).total_seconds()
        assert broken is None


@pytest.mark.parametrize("available", [True, False])
def test_any_requires_grad_equals_a_loop_either_way(
    available: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not available:
        monkeypatch.delattr(torch._C, "_any_requires_grad")
    leaf = torch.ones(2, requires_grad=True)
    plain = [torch.ones(2), torch.zeros((), dtype=torch.float64), torch.ones(3, dtype=torch.int64)]
    cases: list[tuple[list[torch.Tensor], ...]] = [
        (),
        ([],),
        (plain,),
        (plain, [leaf]),
        ([leaf * 2], plain),
        ([leaf.detach()], []),
        (plain, [torch.ones(1, dtype=torch.complex64, requires_grad=True)]),
    ]
    for lists in cases:
        expected = False
        for xs in lists:
            for t in xs:
                expected = expected or t.requires_grad
        assert _compat.any_requires_grad(*lists) is expected, lists
        assert _compat.any_requires_grad(*map(tuple, lists)) is expected, lists


def test_any_transformed_answers_as_is_transformed_of_each() -> None:
    plain = [torch.ones(2), torch.zeros(3)]
    seen: list[tuple[bool, bool]] = []

    def f(x: torch.Tensor) -> torch.Tensor:
        both = [*plain, x]
        seen.append((_compat.any_transformed(both), any(map(_compat.is_transformed, both))))
        seen.append((_compat.any_transformed(plain), any(map(_compat.is_transformed, plain))))
        return x.sum()

    torch.func.grad(f)(torch.ones(2))
    torch.func.vmap(f)(torch.ones(3, 2))
    assert seen == [(True, True), (False, False)] * 2
    assert not _compat.any_transformed([])


NUMBERS = (0.9, 1e-3, 0.999, 1 / 3, 1e-8, 7, -2.5e-5, 1.0 - 0.9**3, 3.4e38, 1e-45)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", ["mul", "add", "div"])
def test_number_as_tensor_gives_the_numbers_results_to_the_bit(
    dtype: torch.dtype, name: str
) -> None:
    g = torch.Generator().manual_seed(0)
    shapes = [(), (7,), (33, 17), (128, 65)]
    xs = [
        torch.randn(s, generator=g, dtype=dtype) * 10.0 ** (4 * i - 6) for i, s in enumerate(shapes)
    ]
    for number in NUMBERS:
        by = _compat.number_as_tensor(xs, number)
        assert isinstance(by, torch.Tensor)
        assert (by.dtype, by.dim()) == (dtype, 0)
        for x in xs:  # the reference: the op given the Python number
            want = getattr(torch, name)(x, number)
            assert torch.equal(getattr(torch, name)(x, by), want), (name, number)
            own = x.clone()
            getattr(own, f"{name}_")(by)
            assert torch.equal(own, want), (name, number)
        foreach = getattr(torch, f"_foreach_{name}")(xs, by)
        for f, x in zip(foreach, xs, strict=True):
            assert torch.equal(f, getattr(torch, name)(x, number)), (name, number)


def test_number_as_tensor_keeps_the_number_where_a_tensor_would_differ() -> None:
    wide = torch.ones(3)
    kept: dict[str, list[Any]] = {
        "half precision": [torch.ones(3, dtype=torch.bfloat16)],
        "mixed dtypes": [wide, torch.ones(3, dtype=torch.float64)],
        "another device": [torch.ones(3, device="meta")],
        "a sparse tensor": [wide, torch.ones(3).to_sparse()],
        "a subclass": [wide, torch.ones(3).as_subclass(_Labelled)],
        "no tensors": [],
        "not a tensor": [None, wide],  # a corrupt optimizer state: torch's error, named later
    }
    for why, xs in kept.items():
        assert _compat.number_as_tensor(xs, 0.5) == 0.5, why
    param = torch.nn.Parameter(torch.ones(3))
    assert isinstance(_compat.number_as_tensor([wide, param], 0.5), torch.Tensor)
    # The half-precision case the kept number protects: a bf16 0-d tensor rounds it.
    h = torch.full((4,), 3.0, dtype=torch.bfloat16)
    assert not torch.equal(h * torch.tensor(0.3, dtype=torch.bfloat16), h * 0.3)


class _Labelled(torch.Tensor):
    pass


@pytest.mark.parametrize("available", [True, False])
def test_foreach_mul_equals_mul_either_way(
    monkeypatch: pytest.MonkeyPatch, available: bool
) -> None:
    if not available:
        monkeypatch.delattr(torch, "_foreach_mul_")
    xs = [torch.randn(5), torch.randn(2, 3)]
    want = [x * (1 / 3) for x in xs]
    _compat.foreach_mul_(xs, 1 / 3)
    assert all(torch.equal(x, w) for x, w in zip(xs, want, strict=True))
