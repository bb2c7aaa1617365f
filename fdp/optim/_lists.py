"""Arithmetic on lists of tensors, two ways, so that each optimizer rule is written once.

A rule (``fdp/optim/_rules.py``) says ``ops("lerp", exp_avg, grads, 0.1)``
and the step chooses how that runs:

- :class:`Foreach`: torch's multi-tensor kernels (``torch._foreach_*``),
  called as torch.optim's foreach implementations call them, so a step
  agrees with torch's bitwise. ``own=True`` writes into the first list:
  a buffer this step made, or one the caller donated.
- :class:`Plain`: the same operations leaf by leaf in ordinary
  differentiable ops, nothing in place (``own`` is ignored), for a step
  that carries derivatives (hypergradients, MAML, a step under
  ``torch.func.vmap``, ``jvp`` or ``grad``). The foreach kernels cannot do
  that: on torch 2.13 they have no vmap rule and several lack forward-mode
  derivatives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, get_args

import torch

from fdp import _compat, _mode

Lists = tuple[torch.Tensor, ...] | list[torch.Tensor]

# The operations a rule may name: each a torch foreach kernel (in place and
# not) and a torch function, so that both forms below run it. A name outside
# them is a type error under mypy and a ValueError at the first step.
OpName = Literal[
    "abs", "add", "addcdiv", "addcmul", "clamp_max", "clamp_min", "div", "exp", "lerp",
    "maximum", "minimum", "mul", "neg", "reciprocal", "sign", "sqrt", "sub",
]  # fmt: skip
OPS: frozenset[str] = frozenset(get_args(OpName))
# Whose multiply a step's rounds as (see Foreach.scaled).
Rounding = Literal["foreach_", "tensor"]


def _check(name: str) -> None:
    if name not in OPS:
        raise ValueError(
            f"fdp.optim: an Optimizer.rule's op `name` expected one of {sorted(OPS)}; got {name!r}"
        )


class Foreach:
    """``torch._foreach_<name>`` over whole lists, in place on the first where owned."""

    def __call__(
        self, name: OpName, xs: Lists, *args: Any, own: bool = False, **kwargs: Any
    ) -> Lists:
        _check(name)
        if name in _TENSOR_OTHER and len(args) == 1 and type(args[0]) in (float, int):
            args = (_number(xs, args[0]),)
        if own:
            getattr(torch, f"_foreach_{name}_")(xs, *args, **kwargs)
            return xs
        out: Lists = getattr(torch, f"_foreach_{name}")(xs, *args, **kwargs)
        return out

    def powers(self, base: float, exponents: Lists) -> Lists:
        """``base ** e`` for each tensor ``e``."""
        out: Lists = torch._foreach_pow(base, exponents)
        return out

    def scaled(self, xs: Lists, scale: float | torch.Tensor, *, own: bool, like: Rounding) -> Lists:
        """``xs * scale``, rounded as torch's step rounds it (``like``).

        In float16 and bfloat16 torch's in-place foreach multiply by a number
        (``_foreach_mul_``, ``like="foreach_"``: torch.optim's foreach steps)
        rounds otherwise than its out-of-place one and ``Tensor.mul_``
        (``like="tensor"``: torch's single-tensor steps, Muon's); torch 2.11
        to 2.15. There a new list is a copy multiplied in place, or an owned
        one is multiplied tensor by tensor.
        """
        if not _any_half(xs):
            return self("mul", xs, scale, own=own)
        if like == "foreach_" and not own:
            xs, own = [x.clone() for x in xs], True
        elif like == "tensor" and own:
            for x in xs:
                x.mul_(scale)
            return xs
        return self("mul", xs, scale, own=own)

    def counted(self, steps: Lists, *, own: bool) -> Lists:
        """``steps + 1``: the step counts after this step (``own``: in place).

        A pure step's new counts are views of one new tensor (see
        :func:`_new_counts`).
        """
        if own:
            base = _one_base(steps)
            if base is None:
                return self("add", steps, 1, own=True)
            base.add_(1)  # every count at once: see _one_base
            return steps
        return _new_counts(steps)

    def counts(self, steps: Lists) -> list[float] | None:
        """The step counts as Python floats where they can be read (see :func:`_counts`)."""
        return _counts(steps)

    def runs(self, xs: Lists) -> list[slice]:
        """Consecutive runs of ``xs``, for a rule's temporaries (see :func:`runs`)."""
        return runs(xs)


class Plain:
    """``torch.<name>`` leaf by leaf; list arguments are taken element by element."""

    def __call__(
        self, name: OpName, xs: Lists, *args: Any, own: bool = False, **kwargs: Any
    ) -> Lists:
        _check(name)
        op = getattr(torch, name)
        return [
            op(x, *(_at(a, i) for a in args), **{k: _at(v, i) for k, v in kwargs.items()})
            for i, x in enumerate(xs)
        ]

    def powers(self, base: float, exponents: Lists) -> Lists:
        """``base ** e`` for each tensor ``e``."""
        return [torch.pow(base, e) for e in exponents]

    def scaled(self, xs: Lists, scale: float | torch.Tensor, *, own: bool, like: Rounding) -> Lists:
        """``xs * scale``, differentiable."""
        return self("mul", xs, scale)

    def counted(self, steps: Lists, *, own: bool) -> Lists:
        """``steps + 1``, leaf by leaf."""
        return self("add", steps, 1)

    def counts(self, steps: Lists) -> list[float] | None:
        """None: a differentiated or batched step count cannot be read."""
        return None

    def runs(self, xs: Lists) -> list[slice]:
        """One run: leaf by leaf already."""
        return [slice(None)]


Ops = Foreach | Plain


def one_minus(ops: Ops, xs: Lists) -> Lists:
    """``1 - x`` for each ``x``, as torch.optim's foreach Adam computes it."""
    return ops("add", ops("neg", xs), 1.0, own=True)


# Eagerly on CPU, a rule's temporaries (Adam's denominator) are made for
# runs of leaves of at most this many bytes, not for a whole tree at once,
# and a pure SGD step (and the fused kernel's copies) runs a run at a time,
# so that what one kernel writes is still in cache when the next reads it.
# There a foreach kernel is a loop over its tensors anyway; elsewhere one
# call launches fewer kernels, so other devices keep one run, as torch's
# foreach optimizers do.
RUN_BYTES = 4 * 2**20


def _runs_traced(xs: Lists) -> list[slice]:
    """One run: the compiler fuses a rule's kernels, temporaries included."""
    return [slice(None)]


@_mode.traced_as(_runs_traced)
def runs(xs: Lists) -> list[slice]:
    """``xs`` cut into runs of at most :data:`RUN_BYTES` (one tensor at least).

    Sizes in one pass, then the cuts where they add up to more: 200
    leaves, 0.10 ms for a Python loop asking each leaf, 0.04-0.06 ms so.
    """
    try:
        sizes = [x.nbytes if x.is_cpu else -1 for x in xs]
    except RuntimeError:  # .nbytes refuses sparse layouts
        sizes = [x.numel() * x.element_size() if x.is_cpu else -1 for x in xs]
    if -1 in sizes or sum(sizes) <= RUN_BYTES:
        return [slice(None)]
    cuts, start, size = [], 0, 0
    for i, nbytes in enumerate(sizes):
        if i > start and size + nbytes > RUN_BYTES:
            cuts.append(slice(start, i))
            start, size = i, 0
        size += nbytes
    return [*cuts, slice(start, len(xs))]


_HALF = (torch.float16, torch.bfloat16)
# The ops whose foreach kernels also take a 0-d tensor for a number (the
# ``Tensor`` overload; see _compat.number_as_tensor).
_TENSOR_OTHER = frozenset({"add", "div", "mul"})


def _any_half(xs: Lists) -> bool:
    for x in xs:  # noqa: SIM110  # a loop, not any(genexpr): every leaf of every step
        if x.dtype in _HALF:
            return True
    return False


def _number_traced(xs: Lists, number: float) -> float | torch.Tensor:
    """The number as it is: the compiler makes one kernel of either."""
    return number


@_mode.traced_as(_number_traced)
def _number(xs: Lists, number: float) -> float | torch.Tensor:
    """Eagerly, the number as the faster kernel's 0-d tensor where that is exact."""
    return _compat.number_as_tensor(xs, number)


def _new_counts_traced(steps: Lists) -> Lists:
    """One foreach add: views of a graph's intermediate would be aliased outputs."""
    out: Lists = torch._foreach_add(steps, 1)
    return out


@_mode.traced_as(_new_counts_traced)
def _new_counts(steps: Lists) -> Lists:
    """``steps + 1`` in new tensors: views of one stacked tensor where the counts allow.

    A tensor of its own per count costs 2.2 us a leaf (200 leaves: 0.44 ms,
    a tenth of torch's in-place SGD step on them); one stack, one add and
    the views of it, 0.16-0.21 ms. Plain tensors of one dtype only: stacking
    others would promote them or dispatch as a subclass; shapes and devices
    that differ fail the stack, and take the foreach add.
    """
    plain = torch.Tensor
    if len(steps) > 1 and type(steps[0]) is plain:
        dtype = steps[0].dtype
        for t in steps:
            if type(t) is not plain or t.dtype is not dtype:
                break
        else:
            try:
                return torch.stack(steps).add_(1).unbind()
            except RuntimeError:  # shapes or devices that differ
                pass
    out: Lists = torch._foreach_add(steps, 1)
    return out


def _one_base_traced(steps: Lists) -> torch.Tensor | None:
    """None: the compiled step adds to each count."""
    return None


@_mode.traced_as(_one_base_traced)
def _one_base(steps: Lists) -> torch.Tensor | None:
    """The tensor whose elements ``steps`` are, each once and in order; else None.

    ``init`` and a pure step make the counts so (:func:`counts_of`,
    :func:`_new_counts`). A donated step then adds to all of them in one
    call: the foreach add's 0-d tensors cost 1.9 us each (200 leaves:
    0.38 ms, most of what fdp's donated SGD step costs over torch's, which
    keeps no counts). Where a count is missing (a leaf without a gradient)
    or another tensor, the foreach add.
    """
    base = getattr(steps[0], "_base", None)
    if type(base) is not torch.Tensor or base.dim() != 1 or base.numel() != len(steps):
        return None
    ptr, size = base.data_ptr(), base.element_size()
    if base.stride(0) != 1:
        return None
    for i, t in enumerate(steps):
        if type(t) is not torch.Tensor or t._base is not base or t.dim() != 0:
            return None
        if t.data_ptr() != ptr + i * size:
            return None
    return base


def counts_of(like: list[torch.Tensor]) -> Lists:
    """Zero step counts (float64, 0-d) on each tensor's device, views of one where one device.

    One tensor for the lot where every tensor is on one device, so that a
    donated step adds to them at once (:func:`_one_base`).
    """
    if not like:
        return []
    device = like[0].device
    if any(t.device != device for t in like):
        return [torch.zeros((), dtype=torch.float64, device=t.device) for t in like]
    return torch.zeros(len(like), dtype=torch.float64, device=device).unbind()


def _at(arg: Any, i: int) -> Any:
    return arg[i] if isinstance(arg, Sequence) and not isinstance(arg, str) else arg


def _counts_traced(steps: Lists) -> list[float] | None:
    """None while dynamo traces: reading a count would break the graph."""
    return None


@_mode.traced_as(_counts_traced)
def _counts(steps: Lists) -> list[float] | None:
    """Eagerly torch's foreach Adam reads the step counts and uses the scalar-list kernels."""
    return [float(s) for s in steps]
