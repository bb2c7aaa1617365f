"""Shared test material: a corpus of pytrees, comparisons, and fake devices."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import optree
import torch
from torch.utils._pytree import tree_map

CPU = torch.device("cpu")


class Pair(NamedTuple):
    first: Any
    second: Any


def params_corpus(seed: int = 0) -> dict[str, Any]:
    """Parameter trees of every shape fdp must handle, all leaves requiring grad."""
    g = torch.Generator().manual_seed(seed)

    def p(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype).requires_grad_()

    return {
        "dict": {"w": p(3, 4), "b": p(4)},
        "nested_list": [[p(2), p(3, 2)], [p(1)]],
        "namedtuple": Pair(first=p(4), second={"x": p(2, 2)}),
        "none_leaves": {"w": p(3), "bias": None, "more": [None, p(2)]},
        "mixed_dtypes": {
            "f32": p(3),
            "f64": p(2, 3, dtype=torch.float64),
            "f16": p(4, dtype=torch.float16),
        },
        "ordered": collections.OrderedDict([("z", p(2)), ("a", p(3))]),
    }


def leaves(tree: Any) -> list[Any]:
    return optree.tree_leaves(tree, none_is_leaf=True)


def tensor_leaves(tree: Any) -> list[torch.Tensor]:
    return [x for x in leaves(tree) if isinstance(x, torch.Tensor)]


def tree_allclose(actual: Any, expected: Any, **tolerances: Any) -> None:
    """Asserts equal structure (types included), close tensors and equal other leaves."""
    a_leaves, a_spec = optree.tree_flatten(actual, none_is_leaf=True)
    e_leaves, e_spec = optree.tree_flatten(expected, none_is_leaf=True)
    assert a_spec == e_spec, f"structure differs:\n  actual   {a_spec}\n  expected {e_spec}"
    for i, (a, e) in enumerate(zip(a_leaves, e_leaves, strict=True)):
        if isinstance(e, torch.Tensor):
            assert isinstance(a, torch.Tensor), f"leaf {i}: expected a tensor, got {a!r}"
            assert a.device == e.device, f"leaf {i}: device {a.device} != {e.device}"
            torch.testing.assert_close(plain(a), plain(e), **tolerances)
        else:
            assert a == e, f"leaf {i}: {a!r} != {e!r}"


def grads_of(tree: Any) -> list[torch.Tensor | None]:
    return [t.grad for t in tensor_leaves(tree)]


def detached_copy(tree: Any) -> Any:
    """A fresh tree of leaf tensors with the same values and requires_grad flags."""

    def copy(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.detach().clone().requires_grad_(x.requires_grad)
        return x

    return optree.tree_map(copy, tree, none_is_leaf=True)


# ---------------------------------------------------------------------------
# Fake devices: CPU data labelled meta:N. Ops refuse tensors of different
# labels, as real devices do, so a test on them checks fdp's placement; the
# data is real, so numerics (forward and autograd) can be checked too.


class Labelled(torch.Tensor):
    """CPU data that reports ``device`` ``meta:N``."""

    data_: torch.Tensor
    copies: int = 0  # aten._to_copy calls that changed the label, for coalescing tests

    @staticmethod
    def __new__(cls, data: torch.Tensor, device: torch.device) -> Labelled:
        out = torch.Tensor._make_wrapper_subclass(
            cls,
            data.shape,
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            dtype=data.dtype,
            device=device,
            requires_grad=data.requires_grad,
        )
        out.data_ = data
        return out

    def __repr__(self) -> str:  # type: ignore[override]
        return f"Labelled({self.data_!r}, device={self.device})"

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        seen: set[torch.device] = set()

        def unwrap(x: Any) -> Any:
            if isinstance(x, Labelled):
                seen.add(x.device)
                return x.data_
            if isinstance(x, torch.Tensor) and x.dim() > 0:
                seen.add(x.device)
            return x

        args = tree_map(unwrap, args)
        kwargs = tree_map(unwrap, kwargs or {})
        target = kwargs.get("device")
        moves = func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default)
        if len(seen) > 1 and not moves:
            raise RuntimeError(
                f"{func}: expected tensors on one device, got {sorted(map(str, seen))}"
            )
        if target is not None:
            kwargs["device"] = CPU
            if torch.device(target) not in seen:
                Labelled.copies += 1
        out = func(*args, **kwargs)
        device = torch.device(target) if target is not None else next(iter(seen), CPU)
        if device.type == "cpu":
            return out
        return tree_map(lambda x: Labelled(x, device) if isinstance(x, torch.Tensor) else x, out)


def fake(index: int) -> torch.device:
    return torch.device("meta", index)


def label(tree: Any, index: int) -> Any:
    """Moves every tensor leaf onto fake device ``index`` (keeping requires_grad leaves)."""

    def move(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        return Labelled(x.detach(), fake(index)).requires_grad_(x.requires_grad)

    return optree.tree_map(move, tree, none_is_leaf=True)


def plain(x: torch.Tensor) -> torch.Tensor:
    """The CPU data behind a (possibly labelled) tensor."""
    x = x.detach()
    return x.data_ if isinstance(x, Labelled) else x


@contextmanager
def count_copies() -> Iterator[Callable[[], int]]:
    before = Labelled.copies
    yield lambda: Labelled.copies - before


requires_cuda = torch.cuda.is_available()
