"""Shared test material: pytrees and the model most tests train, comparisons, fake devices."""

from __future__ import annotations

import collections
import itertools
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


# ---------------------------------------------------------------------------
# The model the data-parallel, distributed and compile tests share: an MLP as
# a pytree (a list of layer dicts, a namedtuple head whose bias may be None),
# and the per-rank batch split of the multi-process tests.

PER_RANK = 4  # examples per rank
TOL: dict[str, Any] = {"rtol": 1e-5, "atol": 1e-6}  # averaging sums in another order
TINY: dict[str, Any] = {"bucket_cap_mb": 1e-6, "first_bucket_cap_mb": 1e-6}  # a bucket per leaf


def mlp_params(
    seed: int = 0, *, inputs: int = 6, depth: int = 2, head_bias: bool = False
) -> dict[str, Any]:
    """``{"layers": [{"w", "b"}, ...], "head": Pair(w, b or None)}``, all leaves requiring grad."""
    g = torch.Generator().manual_seed(seed)

    def p(*shape: int) -> torch.Tensor:
        t: torch.Tensor = torch.randn(*shape, generator=g) / shape[0] ** 0.5
        return t.requires_grad_()

    sizes = [inputs] + [8] * depth
    layers = [{"w": p(a, b), "b": p(b)} for a, b in itertools.pairwise(sizes)]
    return {"layers": layers, "head": Pair(first=p(8, 3), second=p(3) if head_bias else None)}


def mlp(params: dict[str, Any], x: torch.Tensor) -> torch.Tensor:
    for layer in params["layers"]:
        x = torch.tanh(x @ layer["w"] + layer["b"])
    weight, bias = params["head"]
    out: torch.Tensor = x @ weight
    return out if bias is None else out + bias


def batch(rows: int, *, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs (``rows`` x 6) and regression targets (``rows`` x 3)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 6, generator=g), torch.randn(rows, 3, generator=g)


def shard(t: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank ``rank``'s ``PER_RANK`` examples of a full batch."""
    return t[rank * PER_RANK : (rank + 1) * PER_RANK]


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


class BufferProbe(torch.nn.Module):
    """A weight and a buffer ``value`` the forward adds: which rank's buffer it used shows."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3))
        self.register_buffer("value", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w + self.get_buffer("value")


def benchmark_script(name: str) -> Any:
    """``benchmarks/<name>.py`` as a module (benchmarks/ is scripts, not a package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
