"""``fdp.optim.muon``: ``torch.optim.Muon`` as a pure function, for stacks of matrices too.

Muon keeps a momentum per weight matrix, orthogonalizes the (Nesterov)
momentum by a Newton-Schulz iteration in bfloat16, and adds the result,
scaled by a rate that depends on the matrix's shape, after decoupled weight
decay (``torch/optim/_muon.py``, op for op). It is a
:class:`fdp.optim.WholeLeafOptimizer`: the momentum and the step are
element by element, the iteration needs the whole matrix. A leaf of three
or more dimensions is a stack of matrices over its last two (MoE experts),
each orthogonalized on its own, which torch refuses.

One departure from torch 2.13: with bfloat16 parameters and
``nesterov=False`` torch's iteration divides the momentum buffer itself in
place (``grad.bfloat16()`` is the buffer); here the buffer stays the
momentum.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from fdp.optim._base import Rate
from fdp.optim._hyper import check_hyper
from fdp.optim._lists import Lists, Ops
from fdp.optim._whole import WholeLeafOptimizer

COEFFICIENTS = (3.4445, -4.775, 2.0315)
_ADJUST = (None, "original", "match_rms_adamw")


def newton_schulz(
    g: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float
) -> torch.Tensor:
    """The orthogonalized matrices of ``g`` (``(..., m, n)``), in bfloat16, as torch's Muon.

    Each matrix is scaled to Frobenius norm at most 1 and put wide
    (``m <= n``), then ``steps`` quintic iterations run with ``coefficients``
    ``(a, b, c)``: ``X <- a X + (b A + c A @ A) @ X`` with ``A = X @ X^T``.
    Matrix by matrix, in torch's 2-D ops: a batched ``baddbmm`` rounds a
    transposed bfloat16 operand differently now and then (1 in 70 tall
    matrices on CPU), one bfloat16 step of the update.
    """
    flat = g.reshape(-1, *g.shape[-2:])
    out = [_orthogonalized(m, coefficients, steps, eps) for m in flat.unbind(0)]
    return torch.stack(out).reshape(g.shape)


def _orthogonalized(
    g: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float
) -> torch.Tensor:
    """One matrix, ``torch/optim/_muon.py``'s iteration op for op."""
    a, b, c = coefficients
    x = g.bfloat16()
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)  # not in place: see the module doc
    for _ in range(steps):
        gram = x @ x.T
        update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, update, x, beta=a)
    return x.T if tall else x


def adjusted_ratio(adjust_lr: str | None, shape: torch.Size) -> float:
    """The factor on ``lr`` for a matrix of ``shape`` (its last two dimensions), as torch's."""
    rows, cols = shape[-2], shape[-1]
    if adjust_lr is None or adjust_lr == "original":
        return math.sqrt(max(1, rows / cols))
    return 0.2 * math.sqrt(max(rows, cols))  # "match_rms_adamw"


class Muon(WholeLeafOptimizer):
    """``torch.optim.Muon`` as a pure function; see :func:`muon`."""

    name = "muon"
    slots = ("momentum_buffer",)
    min_ndim = 2

    def __init__(
        self,
        lr: Rate = 1e-3,
        *,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr: str | None = None,
    ) -> None:
        super().__init__(lr)
        check_hyper(self.name, "momentum", momentum, lambda v: v >= 0, ">= 0")
        check_hyper(self.name, "weight_decay", weight_decay, lambda v: v >= 0, ">= 0")
        check_hyper(self.name, "eps", eps, lambda v: v >= 0, ">= 0")
        if isinstance(ns_steps, bool) or not isinstance(ns_steps, int) or not 0 <= ns_steps < 100:
            raise ValueError(
                f"fdp.optim.muon: `ns_steps` expected an int in [0, 100); got {ns_steps!r}"
            )
        coefficients = tuple(ns_coefficients) if isinstance(ns_coefficients, tuple | list) else ()
        if len(coefficients) != 3 or not all(isinstance(v, int | float) for v in coefficients):
            raise ValueError(
                "fdp.optim.muon: `ns_coefficients` expected three numbers (a, b, c); "
                f"got {ns_coefficients!r}"
            )
        if adjust_lr not in _ADJUST:
            raise ValueError(
                f"fdp.optim.muon: `adjust_lr` expected one of {list(_ADJUST)}; got {adjust_lr!r}"
            )
        if not isinstance(nesterov, bool):
            raise TypeError(f"fdp.optim.muon: `nesterov` expected a bool; got {nesterov!r}")
        self.weight_decay, self.momentum, self.nesterov = weight_decay, momentum, nesterov
        self.ns_coefficients = (
            float(coefficients[0]),
            float(coefficients[1]),
            float(coefficients[2]),
        )
        self.eps, self.ns_steps, self.adjust_lr = eps, ns_steps, adjust_lr

    def direction(
        self,
        ops: Ops,
        params: Lists,
        grads: Lists,
        slots: Mapping[str, Lists],
        steps: Lists,
        donate: bool,
    ) -> tuple[Lists, Mapping[str, Lists]]:
        """The momentum (``lerp`` toward the gradient), and the Nesterov direction from it."""
        bufs = ops("lerp", slots["momentum_buffer"], grads, 1 - self.momentum, own=donate)
        direction = ops("lerp", grads, bufs, self.momentum) if self.nesterov else bufs
        return direction, {"momentum_buffer": bufs}

    def transform(self, directions: torch.Tensor) -> torch.Tensor:
        """Newton-Schulz over each matrix of the stack (see :func:`newton_schulz`)."""
        return newton_schulz(directions, self.ns_coefficients, self.ns_steps, self.eps)

    def apply(
        self,
        ops: Ops,
        params: Lists,
        updates: Lists,
        shapes: list[torch.Size],
        lr: float | torch.Tensor,
        donate: bool,
    ) -> Lists:
        """Decoupled decay by ``lr``, then the update at the shape's adjusted rate, as torch."""
        decayed = list(ops.scaled(params, 1 - lr * self.weight_decay, own=donate, like="tensor"))
        by_ratio: dict[float, list[int]] = {}
        for j, shape in enumerate(shapes):
            by_ratio.setdefault(adjusted_ratio(self.adjust_lr, shape), []).append(j)
        for ratio, idx in by_ratio.items():
            rate = lr * ratio
            done = self._scaled_add(
                ops, [decayed[j] for j in idx], [updates[j] for j in idx], -rate, True
            )
            for j, t in zip(idx, done, strict=True):
                decayed[j] = t
        return decayed


def muon(
    lr: Rate = 1e-3,
    *,
    weight_decay: float = 0.1,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_coefficients: tuple[float, float, float] = COEFFICIENTS,
    eps: float = 1e-7,
    ns_steps: int = 5,
    adjust_lr: str | None = None,
) -> Muon:
    """Muon: momentum, orthogonalized per weight matrix, as ``torch.optim.Muon``.

    The same meaning and defaults as ``torch.optim.Muon`` (``adjust_lr`` is
    its ``adjust_lr_fn``: ``None``/``"original"`` scales ``lr`` by
    ``sqrt(max(1, rows / cols))``, ``"match_rms_adamw"`` by ``0.2 *
    sqrt(max(rows, cols))``), pure, over a tree. Leaves of three or more
    dimensions are stacks of matrices over their last two (each
    orthogonalized on its own); 1-D leaves (biases, norms) are refused: give
    them, the embeddings and the head AdamW with :func:`fdp.optim.param_groups`,
    as the Muon papers do.

    Args:
        lr: the learning rate, a 0-d tensor, or a schedule of the step count.
        weight_decay: decoupled weight decay (``p *= 1 - lr * weight_decay``).
        momentum: the momentum factor.
        nesterov: orthogonalize the Nesterov direction (else the momentum).
        ns_coefficients: the quintic Newton-Schulz coefficients ``(a, b, c)``.
        eps: the floor of each matrix's norm before the iteration.
        ns_steps: Newton-Schulz iterations.
        adjust_lr: ``None``, ``"original"`` or ``"match_rms_adamw"``.

    Example:
        >>> import torch, fdp
        >>> matrices = lambda name, t: "muon" if t.ndim >= 2 else "adamw"
        >>> opt = fdp.optim.param_groups(
        ...     matrices, {"muon": fdp.optim.muon(0.02), "adamw": fdp.optim.adamw(3e-4)}
        ... )
        >>> params = {"w": torch.randn(8, 4), "b": torch.zeros(8)}
        >>> state = opt.init(params)
        >>> grads = {"w": torch.randn(8, 4), "b": torch.randn(8)}
        >>> params, state = opt.update(grads, state, params)
        >>> sorted(state)
        ['exp_avg', 'exp_avg_sq', 'momentum_buffer', 'step']
    """
    return Muon(
        lr,
        weight_decay=weight_decay,
        momentum=momentum,
        nesterov=nesterov,
        ns_coefficients=ns_coefficients,
        eps=eps,
        ns_steps=ns_steps,
        adjust_lr=adjust_lr,
    )
