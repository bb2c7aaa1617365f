"""Bucket planning and flat pack/unpack (fdp._bucket), single process."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from fdp import _bucket
from tests.helpers import Labelled, fake


def f32(n: int) -> torch.Tensor:
    return torch.randn(n)


def test_reverse_order_and_caps() -> None:
    # 4-byte floats: 10 elements = 40 bytes.
    tensors: list[torch.Tensor | None] = [f32(10), f32(10), f32(10), f32(10), f32(10)]
    buckets = _bucket.plan(tensors, cap_bytes=80, first_cap_bytes=40)
    assert [b.indices for b in buckets] == [(4,), (3, 2), (1, 0)]
    assert [b.numel for b in buckets] == [10, 20, 20]
    assert buckets[1].offsets == (0, 10)


def test_every_leaf_its_own_bucket_under_a_tiny_cap() -> None:
    tensors: list[torch.Tensor | None] = [f32(3), None, f32(2), f32(1)]
    buckets = _bucket.plan(tensors, cap_bytes=1)
    assert [b.indices for b in buckets] == [(3,), (2,), (0,)]


def test_dtypes_and_devices_never_share_a_bucket() -> None:
    tensors: list[torch.Tensor | None] = [
        f32(4),
        torch.randn(4, dtype=torch.float64),
        f32(4),
        torch.randn(4, dtype=torch.float64),
        Labelled(torch.empty(4), fake(1)),
    ]
    buckets = _bucket.plan(tensors, cap_bytes=1 << 20)
    groups = {(b.dtype, b.device): b.indices for b in buckets}
    assert groups == {
        (torch.float32, torch.device("meta", 1)): (4,),
        (torch.float64, torch.device("cpu")): (3, 1),
        (torch.float32, torch.device("cpu")): (2, 0),
    }


def test_first_cap_applies_per_dtype() -> None:
    tensors: list[torch.Tensor | None] = [
        torch.randn(10, dtype=torch.float64),
        f32(10),
        torch.randn(10, dtype=torch.float64),
        f32(10),
    ]
    buckets = _bucket.plan(tensors, cap_bytes=1000, first_cap_bytes=40)
    # float32: leaf 3 fills the 40-byte first bucket; leaf 1 opens the next.
    # float64: leaf 2 (80 bytes) fills its first bucket alone.
    assert [b.indices for b in buckets] == [(3,), (2,), (1,), (0,)]


@pytest.mark.parametrize("with_none", [False, True])
def test_pack_and_views_round_trip(with_none: bool) -> None:
    tensors = [torch.randn(2, 3), torch.randn(4), torch.randn(())]
    (bucket,) = _bucket.plan(list(tensors), cap_bytes=1 << 20)
    ordered: list[torch.Tensor | None] = [tensors[i] for i in bucket.indices]
    if with_none:
        ordered[1] = None
    flat = bucket.pack(ordered)
    assert flat.shape == (bucket.numel,)
    for view, t in zip(bucket.views(flat), ordered, strict=True):
        expected = torch.zeros(view.shape) if t is None else t
        torch.testing.assert_close(view, expected)
        assert view.data_ptr() >= flat.data_ptr()
    # Contiguous real leaves take the one-split path; it must agree with the per-leaf views.
    assert bucket._split_sizes is not None
    for j, view in enumerate(bucket.views(flat)):
        one = bucket.view(flat, j)
        assert (view.data_ptr(), view.shape, view.stride()) == (
            one.data_ptr(),
            one.shape,
            one.stride(),
        )
    flat.add_(1)  # views alias the buffer
    for view, t in zip(bucket.views(flat), ordered, strict=True):
        expected = torch.zeros(view.shape) if t is None else t
        torch.testing.assert_close(view, expected + 1)


def mixed_leaves() -> list[torch.Tensor]:
    """A complex leaf, a channels_last one, a transposed one and a vector."""
    return [
        torch.randn(2, 3, dtype=torch.complex64),
        torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        torch.randn(4, 3).t(),
        torch.randn(3),
    ]


def test_complex_and_strided_leaves_round_trip() -> None:
    tensors = mixed_leaves()
    (bucket,) = _bucket.plan(list(tensors), cap_bytes=1 << 20)
    assert bucket.dtype == torch.float32  # complex leaves travel as their real view
    # Reverse leaf order: 3, 12, 120 real elements, then the complex leaf at
    # an even offset (one padding element), 12 real elements for its 6.
    assert bucket.numel == 3 + 12 + 120 + 1 + 2 * 6
    assert bucket.pads == (135,)
    ordered = [tensors[i] for i in bucket.indices]
    flat = bucket.pack(ordered, scale=0.5)
    for view, t in zip(bucket.views(flat), ordered, strict=True):
        assert view.dtype == t.dtype
        assert view.stride() == t.stride()  # the leaf's own layout
        torch.testing.assert_close(view, t * 0.5)
    assert flat[135] == 0
    assert bucket._split_sizes is None  # padded, complex and strided: a view per leaf


def test_pieces_pack_in_packs_order_and_unpack_gives_each_leaf_back() -> None:
    """The functional pieces (what traced and batched code packs) equal the in-place pack,
    for real leaves in logical order (one reshape each) and the others alike, also
    converted to another dtype; unpack gives each leaf back with its own strides."""
    tensors = mixed_leaves()
    (bucket,) = _bucket.plan(list(tensors), cap_bytes=1 << 20)
    ordered = [tensors[i] for i in bucket.indices]
    assert bucket._plain == tuple(  # the vector only: the others are complex or strided
        not t.is_complex() and t.is_contiguous() for t in ordered
    )
    flat = torch.cat(bucket.pieces(ordered, scale=0.5))
    torch.testing.assert_close(flat, bucket.pack(ordered, scale=0.5), rtol=0, atol=0)
    wide = torch.cat(bucket.pieces(ordered, dtype=torch.float64))
    assert wide.dtype == torch.float64
    torch.testing.assert_close(wide, bucket.pack(ordered).double(), rtol=0, atol=0)
    for view, t in zip(bucket.unpack(flat), ordered, strict=True):
        assert view.stride() == t.stride()
        torch.testing.assert_close(view, t * 0.5, rtol=0, atol=0)


def test_split_views_as_unpack_and_assembles_the_gradient_in_one_buffer() -> None:
    """Bucket.split: unpack's views (padding and a tail after numel included) through one
    split_with_sizes; its gradient equals slicing's, also under vmap and jvp."""
    tensors = mixed_leaves()
    (bucket,) = _bucket.plan(list(tensors), cap_bytes=1 << 20)
    ordered = [tensors[i] for i in bucket.indices]
    flat = torch.cat([bucket.pack(ordered), torch.zeros(6)])  # a padded tail, as FSDP's
    weights = [torch.randn(t.shape, dtype=t.dtype) for t in ordered]

    def loss(f: torch.Tensor, how: str) -> torch.Tensor:
        views = bucket.split(f) if how == "split" else bucket.unpack(f[: bucket.numel])
        return sum(
            ((v * w).real if v.is_complex() else v * w).sum()
            for v, w in zip(views, weights, strict=True)
        )  # type: ignore[return-value]

    for view, unpacked, t in zip(bucket.split(flat), bucket.unpack(flat), ordered, strict=True):
        assert view.stride() == unpacked.stride() == t.stride()
        torch.testing.assert_close(view, t)
    # Every leaf's gradient, and zeros in the padding and the tail.
    for how in ("split", "slice"):
        assert torch.func.grad(loss)(flat, how).shape == flat.shape
    torch.testing.assert_close(
        torch.func.grad(loss)(flat, "split"), torch.func.grad(loss)(flat, "slice")
    )
    batch = torch.stack([flat, 2 * flat])
    torch.testing.assert_close(
        torch.vmap(torch.func.grad(lambda f: loss(f, "split") ** 2))(batch),
        torch.vmap(torch.func.grad(lambda f: loss(f, "slice") ** 2))(batch),
    )
    tangent = torch.randn_like(flat)
    torch.testing.assert_close(
        torch.func.jvp(lambda f: loss(f, "split"), (flat,), (tangent,)),
        torch.func.jvp(lambda f: loss(f, "slice"), (flat,), (tangent,)),
    )
    # Autograd: one cat builds the flat gradient, not one buffer per leaf.
    leaf = flat.clone().requires_grad_()
    with _Ops() as ops:
        torch.autograd.backward(loss(leaf, "split"))
    assert ops.count("aten.cat.default") == 1
    assert ops.count("aten.slice_backward.default") == 0


class _Ops(TorchDispatchMode):  # type: ignore[no-untyped-call]
    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.seen: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))

    def count(self, name: str) -> int:
        return self.seen.count(name)


def test_empty_plan() -> None:
    assert _bucket.plan([None, None], cap_bytes=10) == []


def torch_buckets(tensors: list[torch.Tensor], first: int, cap: int) -> list[list[int]]:
    """torch's own DDP planner (a private API, used only as the reference here).

    DDP hands it the parameters in reverse order with [first cap, cap].
    """
    n = len(tensors)
    rev = list(range(n - 1, -1, -1))
    buckets, _ = dist._compute_bucket_assignment_by_size(  # type: ignore[attr-defined]
        [tensors[i] for i in rev], [first, cap], [False] * n
    )
    return [[rev[i] for i in bucket] for bucket in buckets]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("n_dtypes", [1, 3])
def test_plan_matches_torchs_ddp_bucket_assignment(seed: int, n_dtypes: int) -> None:
    g = torch.Generator().manual_seed(seed)
    n = 12
    sizes = torch.randint(1, 200_000, (n,), generator=g).tolist()
    dtypes = [torch.float32, torch.float64, torch.float16][:n_dtypes]
    pick = torch.randint(0, n_dtypes, (n,), generator=g).tolist()
    tensors = [torch.empty(s, dtype=dtypes[d]) for s, d in zip(sizes, pick, strict=True)]
    cap, first = 400_000, 100_000
    plan = _bucket.plan(list(tensors), cap_bytes=cap, first_cap_bytes=first)
    ours = [list(b.indices) for b in plan]
    theirs = torch_buckets(tensors, first, cap)
    if n_dtypes == 1:
        assert ours == theirs
    else:
        # The same buckets. The order differs on purpose: torch sorts buckets
        # by their first leaf, fdp by when they fill, so that a dtype whose
        # bucket only fills at the end of backward does not hold back the
        # buckets after it (both launch buckets strictly in order).
        assert sorted(ours) == sorted(theirs)


def test_layout_buffers_are_reused_until_a_result_views_them() -> None:
    tensors = [torch.randn(3, 4), torch.randn(5)]
    layout = _bucket.Layout(tensors, cap_bytes=1 << 20)
    first = layout.buffer(0, tail=4)  # the usage counts' tail of DDP's last bucket
    assert first.numel() == layout.buckets[0].numel + 4
    ptr = first.data_ptr()
    del first
    plain = layout.buffer(0)  # the longer buffer serves a step without a tail
    assert (plain.numel(), plain.data_ptr()) == (layout.buckets[0].numel, ptr)
    # A view still alive (a gradient handed out) keeps it: the next caller gets a new one.
    again = layout.buffer(0, tail=4)
    assert again.data_ptr() != ptr
    assert again.numel() == layout.buckets[0].numel + 4
    del plain, again
    assert layout.buffer(0, tail=4).numel() == layout.buckets[0].numel + 4


def test_layout_buffer_views_are_made_once_per_buffer_and_count_as_its_own() -> None:
    tensors = [torch.randn(3, 4), torch.randn(5), torch.randn(2, 3).t()]  # the last strided
    layout = _bucket.Layout(tensors, cap_bytes=1 << 20)
    bucket = layout.buckets[0]
    flat, views = layout.buffer_views(0, tail=4)
    ptr = flat.data_ptr()
    # The views are the bucket's views of that buffer: shapes, strides, memory.
    assert _described(views) == _described(bucket.views(flat[: bucket.numel]))
    del flat
    # Kept with the buffer, they do not count as results still alive: both come back.
    again, kept = layout.buffer_views(0)
    assert again.data_ptr() == ptr
    assert kept is views
    del again
    # A gradient handed out (a detach() of a view) keeps the buffer: new buffer, new views.
    handed = views[1].detach()
    fresh, new_views = layout.buffer_views(0, tail=4)
    assert fresh.data_ptr() != ptr
    assert new_views is not views
    assert handed.data_ptr() == views[1].data_ptr()
    assert [v.data_ptr() - fresh.data_ptr() for v in new_views] == [
        v.data_ptr() - ptr for v in views
    ]
    del fresh, handed
    # buffer() sees the kept views too: the buffer is free, not held by them.
    assert layout.buffer(0, tail=4).data_ptr() == new_views[0].data_ptr()
    layout.release()
    assert layout.buffer_views(0)[1] is not new_views


def _described(views: list[torch.Tensor]) -> list[tuple[Any, ...]]:
    return [(v.shape, v.stride(), v.data_ptr()) for v in views]
