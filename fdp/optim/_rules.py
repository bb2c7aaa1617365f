"""``fdp.optim``'s optimizers: ``sgd``, ``adam``, ``adamw`` (``SGD``, ``Adam``).

Each is an :class:`fdp.optim._base.Optimizer`: the update rule over the live
leaves (real views of complex ones), as torch's ``foreach`` implementations
compute it, written once over ``fdp/optim/_lists.py``'s operations (torch's
foreach kernels, or plain ops where the step carries derivatives);
``fdp/optim/_base.py`` has what every optimizer shares (the contract, the
checks, donation).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fdp import _compat
from fdp.optim._base import Optimizer, Rate
from fdp.optim._fused import Kernel
from fdp.optim._hyper import check_hyper, float_betas, implementation, torch_options
from fdp.optim._lists import Lists, Ops, one_minus

Slots = dict[str, list[torch.Tensor]]
LR = float | torch.Tensor


class SGD(Optimizer):
    """``torch.optim.SGD`` (``foreach=True``) as a pure function; see :func:`sgd`."""

    name = "sgd"

    def __init__(
        self,
        lr: Rate,
        *,
        momentum: float = 0.0,
        dampening: float = 0.0,
        nesterov: bool = False,
        weight_decay: float = 0.0,
        maximize: bool = False,
        fused: bool | None = None,
    ) -> None:
        super().__init__(lr, maximize=maximize, fused=fused)
        check_hyper(self.name, "momentum", momentum, lambda v: v >= 0, ">= 0")
        check_hyper(self.name, "weight_decay", weight_decay, lambda v: v >= 0, ">= 0")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError(
                f"fdp.optim.sgd: `nesterov=True` expected momentum > 0 and dampening 0; "
                f"got momentum={momentum}, dampening={dampening}"
            )
        self.momentum, self.dampening = momentum, dampening
        self.nesterov, self.weight_decay = nesterov, weight_decay
        self.slots = ("momentum_buffer",) if momentum else ()

    def rule(
        self,
        ops: Ops,
        params: Lists,
        grads: Lists,
        slots: Mapping[str, Lists],
        steps: Lists,
        donate: bool,
        lr: float | torch.Tensor,
    ) -> tuple[Lists, Mapping[str, Lists]]:
        """SGD's update (momentum, dampening, Nesterov), as torch's foreach implementation.

        A run of leaves at a time (:meth:`Ops.runs`): eagerly on CPU a pure
        step's new buffer is still in cache when the parameters' add reads it
        (``benchmarks/bench_optim.py``; 200 leaves of 128x128: 4.6 -> 4.0 ms).
        """
        new_params: list[torch.Tensor] = []
        bufs: list[torch.Tensor] = []
        for run in ops.runs(params):
            buf = slots["momentum_buffer"][run] if self.momentum else ()
            p, b = self._run(ops, (params[run], grads[run], buf, steps[run]), donate, lr)
            new_params += p
            bufs += b
        return new_params, {"momentum_buffer": bufs} if self.momentum else {}

    def _run(
        self,
        ops: Ops,
        lists: tuple[Lists, Lists, Lists, Lists],
        donate: bool,
        lr: float | torch.Tensor,
    ) -> tuple[Lists, Lists]:
        """One run's new parameters and momentum buffers (empty without momentum)."""
        params, grads, bufs, steps = lists
        if self.weight_decay:
            grads = ops("add", grads, params, alpha=self.weight_decay)
        if self.momentum:
            # torch starts the buffer at the first gradient itself; from
            # zeros, "momentum * 0 + c * g" gives it with c = 1 at step 1.
            bufs = ops.scaled(bufs, self.momentum, own=donate, like="foreach_")
            if self.dampening:
                bufs = self._damped_add(ops, bufs, grads, steps)
            else:
                bufs = ops("add", bufs, grads, own=True)
            grads = ops("add", grads, bufs, alpha=self.momentum) if self.nesterov else bufs
        return self._scaled_add(ops, params, grads, -lr, donate), bufs

    def _damped_add(self, ops: Ops, bufs: Lists, grads: Lists, steps: Lists) -> Lists:
        """``bufs + (1 - dampening) * grads``, undamped at a leaf's first step, as torch.

        Eagerly, as torch: ``alpha`` of the add (one rounding, in float16 and
        bfloat16 too); where the counts cannot be read, a scale per leaf.
        """
        counts = ops.counts(steps)
        if counts is None:
            scales = [torch.where(s > 1, 1 - self.dampening, 1.0) for s in steps]
            return ops("add", bufs, ops("mul", grads, scales), own=True)
        for first, alpha in ((True, 1.0), (False, 1 - self.dampening)):
            idx = [j for j, c in enumerate(counts) if (c == 1) == first]
            if idx:  # written in place: these are bufs' own tensors
                ops("add", [bufs[j] for j in idx], [grads[j] for j in idx], alpha=alpha, own=True)
        return bufs

    def _fuses(self, donate: bool) -> bool:
        """The fused kernel by default only where it saves passes over memory.

        A pure step runs the kernel on copies of the parameters and buffers:
        two more passes. Undamped, without weight decay, Nesterov or
        ``maximize``, torch's foreach rule is at most three kernels that write
        the new tensors directly, and it is the faster pure step
        (``benchmarks/bench_optim.py``: 1.8x against 2.1x torch's in-place step).
        """
        if self.fused is not None:
            return self.fused
        extra_passes = self.weight_decay or self.dampening or self.nesterov or self.maximize
        return donate or bool(extra_passes)

    def _kernel(self) -> Kernel | None:
        """``torch._fused_sgd_``: the buffer from zeros at step 1 as torch starts it."""
        sgd = _compat.fused_optimizer_kernel("sgd")
        if sgd is None:
            return None

        def call(params: Lists, grads: Lists, slots: Slots, steps: Lists, lr: LR) -> None:
            bufs = list(slots.get("momentum_buffer", []))
            hyper = {"weight_decay": self.weight_decay, "momentum": self.momentum, "lr": lr}
            hyper |= {"dampening": self.dampening, "nesterov": self.nesterov}
            # Undamped, momentum * 0 + g is the first step's buffer; damped, torch's
            # first step skips the damping, so those leaves run on their own.
            firsts = [self.dampening != 0 and float(t) == 1 for t in steps]
            for first in {*firsts}:
                idx = [j for j, f in enumerate(firsts) if f == first]
                sgd(
                    [params[j] for j in idx],
                    [grads[j] for j in idx],
                    [bufs[j] for j in idx] if bufs else [],
                    **hyper,
                    maximize=self.maximize,
                    is_first_step=first,
                )

        return call


class Adam(Optimizer):
    """``torch.optim.Adam``/``AdamW`` (``foreach=True``) as pure functions; see :func:`adam`."""

    name = "adam"

    def __init__(
        self,
        lr: Rate,
        *,
        betas: tuple[float | torch.Tensor, float | torch.Tensor] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        decoupled: bool = False,
        maximize: bool = False,
        fused: bool | None = None,
    ) -> None:
        super().__init__(lr, maximize=maximize, fused=fused)
        betas = float_betas(self.name, betas)
        for i, beta in enumerate(betas):
            check_hyper(self.name, f"betas[{i}]", beta, lambda v: 0 <= v < 1, "in [0, 1)")
        check_hyper(self.name, "eps", eps, lambda v: v >= 0, ">= 0")
        check_hyper(self.name, "weight_decay", weight_decay, lambda v: v >= 0, ">= 0")
        self.betas, self.eps, self.weight_decay = betas, eps, weight_decay
        self.amsgrad, self.decoupled = amsgrad, decoupled
        if decoupled:
            self.name = "adamw"
        self.slots = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())

    def rule(
        self,
        ops: Ops,
        params: Lists,
        grads: Lists,
        slots: Mapping[str, Lists],
        steps: Lists,
        donate: bool,
        lr: float | torch.Tensor,
    ) -> tuple[Lists, Mapping[str, Lists]]:
        """Adam's (or AdamW's) update, as torch's foreach implementation computes it."""
        beta1, beta2 = self.betas
        if self.weight_decay and self.decoupled:
            params = ops.scaled(params, 1 - lr * self.weight_decay, own=donate, like="foreach_")
        elif self.weight_decay:
            grads = ops("add", grads, params, alpha=self.weight_decay)
        exp_avg = ops("lerp", slots["exp_avg"], grads, 1 - beta1, own=donate)
        exp_avg_sq = ops.scaled(slots["exp_avg_sq"], beta2, own=donate, like="foreach_")
        exp_avg_sq = ops("addcmul", exp_avg_sq, grads, grads, value=1 - beta2, own=True)
        new_slots: dict[str, Lists] = {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
        second = exp_avg_sq
        if self.amsgrad:
            second = ops("maximum", slots["max_exp_avg_sq"], exp_avg_sq, own=donate)
            new_slots["max_exp_avg_sq"] = second
        counts = ops.counts(steps)
        new_params: list[torch.Tensor] = []
        # The update's temporaries (the denominator) one run at a time.
        for run in ops.runs(params):
            new_params += self._update(
                ops,
                (params[run], exp_avg[run], second[run], steps[run]),
                None if counts is None else counts[run],
                donate,
                lr,
            )
        return new_params, new_slots

    def _update(
        self,
        ops: Ops,
        lists: tuple[Lists, Lists, Lists, Lists],
        counts: list[float] | None,
        donate: bool,
        lr: float | torch.Tensor,
    ) -> Lists:
        """The new parameters from the moments (``counts``: the steps as Python floats)."""
        params, exp_avg, second, steps = lists
        beta1, beta2 = self.betas
        if counts is not None:
            # Python floats as torch's eager foreach Adam uses: the
            # scalar-list kernels, and one addcdiv for the update.
            lr = float(lr)
            denom = ops("sqrt", second)
            denom = ops("div", denom, [(1 - beta2**c) ** 0.5 for c in counts], own=True)
            denom = ops("add", denom, self.eps, own=True)
            sizes = [-lr / (1 - beta1**c) for c in counts]
            return ops("addcdiv", params, exp_avg, denom, sizes, own=donate)
        # Bias corrections per leaf, in float64 like torch's Python floats.
        correction1 = one_minus(ops, ops.powers(beta1, steps))
        correction2 = one_minus(ops, ops.powers(beta2, steps))
        denom = ops("div", ops("sqrt", second), ops("sqrt", correction2), own=True)
        denom = ops("add", denom, self.eps, own=True)
        step_size = ops("mul", ops("reciprocal", correction1), -lr, own=True)
        direction = ops("mul", ops("div", exp_avg, denom), step_size, own=True)
        return ops("add", params, direction, own=donate)

    def _kernel(self) -> Kernel | None:
        """``torch._fused_adam_`` (``_fused_adamw_`` decoupled), as torch's ``fused=True``."""
        adam = _compat.fused_optimizer_kernel("adamw" if self.decoupled else "adam")
        if adam is None:
            return None
        beta1, beta2 = self.betas
        hyper = {"beta1": beta1, "beta2": beta2, "weight_decay": self.weight_decay}
        hyper |= {"eps": self.eps, "amsgrad": self.amsgrad, "maximize": self.maximize}

        def call(params: Lists, grads: Lists, slots: Slots, steps: Lists, lr: LR) -> None:
            exp_avg, exp_avg_sq = slots["exp_avg"], slots["exp_avg_sq"]
            most = slots.get("max_exp_avg_sq", [])
            adam(params, grads, exp_avg, exp_avg_sq, most, steps, lr=lr, **hyper)

        return call


def sgd(
    lr: Rate = 1e-3,
    *,
    momentum: float = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    maximize: bool = False,
    fused: bool | None = None,
    **torch_only: Any,
) -> SGD:
    """``torch.optim.SGD`` as a pure ``init``/``update`` pair over a parameter tree.

    Every option of ``torch.optim.SGD`` is taken: ``maximize`` ascends;
    ``foreach`` and ``differentiable`` change nothing here (fdp computes as
    the foreach implementation and differentiates when asked); ``fused=True``
    is refused with the reason (docs/optim.md has the table).

    Example:
        >>> import torch, fdp
        >>> params = {"w": torch.ones(2)}
        >>> opt = fdp.optim.sgd(0.1, momentum=0.9)
        >>> state = opt.init(params)
        >>> params, state = opt.update({"w": torch.ones(2)}, state, params)
        >>> params["w"]
        tensor([0.9000, 0.9000])
    """
    torch_options("sgd", torch_only, own=_SGD_OWN)
    return SGD(
        lr,
        momentum=momentum,
        dampening=dampening,
        nesterov=nesterov,
        weight_decay=weight_decay,
        maximize=maximize,
        fused=implementation("sgd", fused, torch_only),
    )


def adam(
    lr: Rate = 1e-3,
    *,
    betas: tuple[float | torch.Tensor, float | torch.Tensor] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    amsgrad: bool = False,
    maximize: bool = False,
    decoupled_weight_decay: bool = False,
    fused: bool | None = None,
    **torch_only: Any,
) -> Adam:
    """``torch.optim.Adam`` as a pure ``init``/``update`` pair over a parameter tree.

    Every option of ``torch.optim.Adam`` is taken: ``maximize`` ascends,
    ``decoupled_weight_decay=True`` is AdamW; ``foreach`` and
    ``differentiable`` change nothing here; ``fused=True`` and
    ``capturable=True`` are refused with the reason (docs/optim.md).

    Example:
        >>> import torch, fdp
        >>> params = {"w": torch.ones(2)}
        >>> opt = fdp.optim.adam(0.1)
        >>> params, state = opt.update({"w": torch.ones(2)}, opt.init(params), params)
        >>> params["w"]
        tensor([0.9000, 0.9000])
    """
    own = (*_ADAM_OWN, "decoupled_weight_decay")
    hyper = (lr, betas, eps, weight_decay, amsgrad)
    return _adam("adam", own, torch_only, *hyper, decoupled_weight_decay, maximize, fused)


def adamw(
    lr: Rate = 1e-3,
    *,
    betas: tuple[float | torch.Tensor, float | torch.Tensor] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    amsgrad: bool = False,
    maximize: bool = False,
    fused: bool | None = None,
    **torch_only: Any,
) -> Adam:
    """``torch.optim.AdamW`` (decoupled weight decay) as a pure ``init``/``update`` pair.

    Takes ``torch.optim.AdamW``'s options as :func:`adam` does.

    Example:
        >>> import torch, fdp
        >>> opt = fdp.optim.adamw(1e-3)
        >>> state = opt.init({"w": torch.ones(2)})
        >>> sorted(state)
        ['exp_avg', 'exp_avg_sq', 'step']
    """
    hyper = (lr, betas, eps, weight_decay, amsgrad)
    return _adam("adamw", _ADAM_OWN, torch_only, *hyper, True, maximize, fused)


def _adam(
    name: str,
    own: tuple[str, ...],
    torch_only: dict[str, Any],
    lr: Rate,
    betas: tuple[float | torch.Tensor, float | torch.Tensor],
    eps: float,
    weight_decay: float,
    amsgrad: bool,
    decoupled: bool,
    maximize: bool,
    fused: bool | None,
) -> Adam:
    """:func:`adam` and :func:`adamw`: torch's other options checked, then the optimizer."""
    torch_options(name, torch_only, own=own)
    return Adam(
        lr,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        amsgrad=amsgrad,
        decoupled=decoupled,
        maximize=maximize,
        fused=implementation(name, fused, torch_only),
    )


_SGD_OWN = ("lr", "momentum", "dampening", "nesterov", "weight_decay", "maximize", "fused")
_ADAM_OWN = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "fused")
