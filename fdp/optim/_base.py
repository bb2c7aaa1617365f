"""``fdp.optim``: functional optimizers over parameter pytrees (SGD, Adam, AdamW).

An optimizer is two pure functions: ``init(params) -> state`` and
``update(grads, state, params) -> (params, state)``. Nothing the caller
passes is changed; the new parameters and state are new tensors. They
follow torch.optim's multi-tensor (``foreach``) implementations op for op,
so ten steps agree with ``torch.optim.SGD/Adam/AdamW`` to about 1e-7.

The state is a dict of trees shaped like ``params``: ``"step"`` (a 0-d
float64 tensor per leaf, on the leaf's device, as torch keeps one step per
parameter) and the optimizer's slots (``"momentum_buffer"``, ``"exp_avg"``,
``"exp_avg_sq"``, ``"max_exp_avg_sq"``). A ``None`` gradient leaves its
parameter, step and slots untouched, as torch skips parameters without
``.grad``. Steps are tensors and ``lr`` may be a 0-d tensor, so a compiled
update (``fullgraph=True``) is traced once for every step and schedule.

Eagerly, a new parameter requires grad when the old one did, so a loop
that calls ``loss.backward()`` keeps working. Inside ``torch.compile``
that flag cannot be set without a graph break, and the new parameters do
not require grad: compile the update in ``torch.func.grad`` loops, or set
``requires_grad_()`` on its results.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch

from fdp import _compat, _mode, _tree
from fdp.optim import _checks, _fused, _lists
from fdp.optim._checks import is_param as is_param
from fdp.optim._donate import untied as _untied
from fdp.optim._hyper import check_hyper
from fdp.optim._lists import Lists

T = TypeVar("T")
# Optimizer.rule's signature: (ops, params, grads, slots, steps, donate, lr) -> (params, slots).
Rule = Callable[..., tuple[Lists, Mapping[str, Lists]]]
# A learning rate: a number, a 0-d tensor, or a schedule of the step count.
Rate = float | torch.Tensor | Callable[[torch.Tensor], float | torch.Tensor]


@runtime_checkable
class OptimizerProtocol(Protocol):
    """The optimizer contract that ``ZeroRedundancy`` and ``param_groups`` rely on.

    Every ``fdp.optim`` optimizer keeps it; an optimizer of your own that
    keeps it works with both. ``init(params)`` returns a dict with an entry
    for each name in ``("step", *slots)``, each a tree shaped like
    ``params`` (``None`` where a leaf has no state); ``update(grads, state,
    params)`` returns the new parameters and a state of the same form, and
    may take ``donate=True`` (write in place). ``ZeroRedundancy`` calls both
    on flat 1-D slices of the parameters, so the update must work per
    element or per leaf.

    Example::

        >>> import fdp
        >>> isinstance(fdp.optim.adamw(lr=1e-3), fdp.optim.OptimizerProtocol)
        True
    """

    slots: tuple[str, ...]  # the per-leaf state tensors besides "step" (e.g. exp_avg)

    def init(self, params: Any) -> dict[str, Any]:
        """The state before the first step: ``{"step": tree, slot: tree, ...}``."""
        ...

    def update(self, grads: Any, state: dict[str, Any], params: Any) -> tuple[Any, Any]:
        """One step: ``(new params, new state)``, ``state`` in :meth:`init`'s form."""
        ...


@runtime_checkable
class Grouped(OptimizerProtocol, Protocol):
    """An optimizer per label of the parameter leaves (``param_groups``)."""

    def labels(self, params: Any) -> list[str | None]: ...

    def bind(self, labels: Any) -> OptimizerProtocol: ...


class Optimizer:
    """``init(params) -> state`` and ``update(grads, state, params) -> (params, state)``.

    The extension point for an optimizer of your own: subclass it, set
    ``name`` and ``slots`` (the per-leaf state besides ``"step"``), and
    write :meth:`rule` over lists of tensors with the ``ops`` it is given.
    ``Optimizer`` does the rest as for ``sgd`` and ``adamw``: the checks,
    complex leaves, ``maximize``, schedules, ``donate=True``, torch's
    foreach kernels eagerly and plain differentiable ops under autograd or
    a ``torch.func`` transform, ``ZeroRedundancy``, ``FullyShardedDataParallel``
    and ``param_groups``. A subclass without ``rule`` is refused when it is
    defined, an op name outside ``fdp.optim._lists.OpName`` by mypy and at
    the first step.

    Example::

        >>> import torch, fdp
        >>> class SignSGD(fdp.optim.Optimizer):
        ...     name = "sign_sgd"
        ...     def rule(self, ops, params, grads, slots, steps, donate, lr):
        ...         return ops("sub", params, ops("mul", ops("sign", grads), lr), own=donate), {}
        >>> opt = SignSGD(0.5)
        >>> p = {"w": torch.tensor([1.0, -1.0])}
        >>> p, state = opt.update({"w": torch.tensor([3.0, -2.0])}, opt.init(p), p)
        >>> p["w"].tolist()
        [0.5, -0.5]
    """

    name = "optimizer"
    slots: tuple[str, ...] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        where = f"fdp.optim.Optimizer subclass {cls.__qualname__}"
        if cls.rule is Optimizer.rule:
            raise TypeError(f"{where}: expected a `rule` method (see Optimizer's docstring)")
        if not isinstance(cls.name, str) or not cls.name:
            raise TypeError(f"{where}: `name` expected a non-empty string; got {cls.name!r}")
        slots = cls.__dict__.get("slots", ())
        if not isinstance(slots, tuple) or not all(isinstance(s, str) for s in slots):
            raise TypeError(f"{where}: `slots` expected a tuple of strings; got {slots!r}")
        if "step" in slots:
            raise ValueError(f'{where}: `slots` must not name "step", the step count\'s key')

    def __init__(self, lr: Rate, *, maximize: bool = False, fused: bool | None = None) -> None:
        if not callable(lr):  # a schedule: a function of the step count (fdp/optim/_schedules.py)
            check_hyper(self.name, "lr", lr, lambda v: v >= 0, ">= 0")
        for option, value in (("maximize", maximize), ("fused", fused)):
            if not isinstance(value, bool) and not (option == "fused" and value is None):
                want = "a bool" + (" or None" if option == "fused" else "")
                raise TypeError(f"fdp.optim.{self.name}: `{option}` expected {want}; got {value!r}")
        if fused and type(self)._kernel is Optimizer._kernel:
            raise ValueError(
                f"fdp.optim.{self.name}: `fused=True` expected an optimizer with torch's fused "
                "kernel (sgd, adam, adamw); this one has none: drop fused"
            )
        self.lr = lr
        self.maximize = maximize  # ascend: the gradients negated first, as torch.optim does
        # None: torch's fused kernel where it applies (fdp/optim/_fused.py); False: foreach only.
        self.fused = fused

    def __repr__(self) -> str:
        hyper = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"fdp.optim.{self.name}({hyper})"

    def init(self, params: Any) -> dict[str, Any]:
        """The state before the first step: zero steps and zero slots."""
        leaves, spec = _tree.flatten(params)
        live = [i for i, t in enumerate(leaves) if is_param(t)]
        _checks.explain_layout(f"fdp.optim.{self.name}.init", params, leaves, leaves, live)
        counts = iter(_lists.counts_of([leaves[i] for i in live]))
        state: dict[str, Any] = {
            "step": _tree.unflatten(spec, [next(counts) if is_param(t) else None for t in leaves])
        }
        for slot in self.slots:
            zeros = [
                torch.zeros_like(t, memory_format=torch.preserve_format) if is_param(t) else None
                for t in leaves
            ]
            state[slot] = _tree.unflatten(spec, zeros)
        return state

    def update(
        self, grads: Any, state: dict[str, Any], params: T, *, donate: bool = False
    ) -> tuple[T, dict[str, Any]]:
        """One step: the new parameters and state (``grads`` are this step's gradients).

        With ``donate=True`` the step writes into ``params`` and ``state``'s
        tensors, as torch's optimizers do, and returns them: the caller
        gives them up (as with JAX's donated buffers). That saves the
        allocations and the memory traffic of pure results (eagerly 1.3x
        torch's step otherwise); the values are the same.
        """
        return self._update_with(self.rule, grads, state, params, donate=donate)

    def _update_with(
        self, rule: Rule, grads: Any, state: dict[str, Any], params: T, *, donate: bool
    ) -> tuple[T, dict[str, Any]]:
        """:meth:`update` running ``rule`` (``WholeLeafOptimizer`` runs its parts so)."""
        call = f"fdp.optim.{self.name}.update"
        p, spec = _tree.flatten(params)
        g = _checks.matching(call, "grads", grads, spec, params)
        s = {
            k: _checks.matching(call, f"state[{k!r}]", state.get(k), spec, params)
            for k in self._keys()
        }
        live = _checks.live(call, params, p, g, s, self.slots)
        if not live:  # nothing to step (foreach ops refuse empty lists)
            return params, {k: state[k] for k in self._keys()}
        ops: _lists.Ops = _lists.Foreach()
        # The leaves' part, asked once.
        carries = differentiable(None, p, g, s, checked=len(live) == len(p))
        lr = self._rate(s["step"][live[0]], carries or _carries(self.lr))
        if carries or _carries(lr):
            _checks.refuse_derivative(call, donate=donate, fused=self.fused is True)
            ops = _lists.Plain()
        elif self._fuses(donate) and not _mode.traced() and rule == self.rule:
            if donate:
                p = _untied(p, live)
            p, s, live = self._fused_step(call, params, (p, g, s), live, donate, lr)
            if not live:
                return _tree.unflatten(spec, p), {k: _tree.unflatten(spec, v) for k, v in s.items()}
        leaves = (p, g, s)
        return self._update_lists(rule, ops, call, params, leaves, live, spec, donate, lr)

    def _kernel(self) -> _fused.Kernel | None:
        """torch's fused kernel for this rule (see ``fdp/optim/_fused.py``), or ``None``."""
        return None

    def _fuses(self, donate: bool) -> bool:
        """Whether an eager step tries the fused kernel (``fused=None``: where it pays)."""
        return self.fused is not False

    def _fused_step(
        self,
        call: str,
        params: Any,
        leaves: tuple[list[Any], list[Any], dict[str, list[Any]]],
        live: list[int],
        donate: bool,
        lr: float | torch.Tensor,
    ) -> tuple[list[Any], dict[str, list[Any]], list[int]]:
        """Steps the live leaves the fused kernel can; returns the lists and the leaves left."""
        p, g, s = leaves
        kernel = self._kernel()
        devices = _compat.fused_optimizer_devices()
        by_leaf = list(zip(p, g, *(s[k] for k in self.slots), strict=True))  # one pass, in C
        fused = (
            [i for i in live if _fused.fusable(by_leaf[i], devices)] if kernel is not None else []
        )
        if self.fused and len(fused) < len(live):
            i = next(i for i in live if i not in set(fused))
            raise ValueError(
                f"{call}: `fused=True` leaf {_tree.path(params, i, 'params')} expected a "
                "float16/bfloat16/float32/float64 tensor on a device with torch's fused kernels "
                "(gradient and state in its strides); got "
                f"{_tree.describe(p[i])} of strides {p[i].stride()}, gradient strides "
                f"{g[i].stride()} (drop fused to step it with foreach ops)"
            )
        if kernel is None or not fused:
            return p, s, live
        try:
            with torch.no_grad():
                steps = _lists.Foreach().counted([s["step"][i] for i in fused], own=donate)
                cplx = _any_complex(p, fused)
                slots = {k: _picked(s[k], fused, cplx) for k in self.slots}
                real = (_picked(p, fused, cplx), _picked(g, fused, cplx), slots)
                new_p, new_slots = _fused.run(kernel, real, list(steps), donate, lr)
        except (RuntimeError, TypeError):
            _checks.explain_state(call, params, p, s, fused)
            _checks.explain_layout(call, params, p, g, fused)
            raise
        p, s = _placed(
            (p, s), fused, (steps, new_p, new_slots), cplx=cplx, donate=donate, leaf=True
        )
        done = set(fused)
        return p, s, [i for i in live if i not in done]

    def _rate(self, count: torch.Tensor, keep_tensor: bool) -> float | torch.Tensor:
        """This update's learning rate: ``lr``, or the schedule at the updates done so far.

        Eagerly a schedule's rate becomes a Python float, the number torch's
        schedulers put in ``group["lr"]``, so the step is torch's op for op;
        compiled (or differentiated) it stays a tensor: no recompile per step.
        """
        if not callable(self.lr):
            return self.lr
        rate = self.lr(count.detach())
        if keep_tensor or _mode.traced() or not isinstance(rate, torch.Tensor):
            return rate
        return float(rate)

    def _update_lists(
        self,
        rule: Rule,
        ops: _lists.Ops,
        call: str,
        params: Any,
        leaves: tuple[list[Any], list[Any], dict[str, list[Any]]],
        live: list[int],
        spec: Any,
        donate: bool,
        lr: float | torch.Tensor,
    ) -> tuple[Any, dict[str, Any]]:
        """The step over the live leaves, in ``ops`` (see ``fdp/optim/_lists.py``).

        With :class:`~fdp.optim._lists.Plain` nothing is detached or written
        in place, so derivatives reach the parameters, gradients, state and
        a tensor ``lr`` under autograd and every ``torch.func`` transform.
        """
        p, g, s = leaves
        foreach = isinstance(ops, _lists.Foreach)
        try:
            with torch.no_grad() if foreach else contextlib.nullcontext():
                if donate:
                    p = _untied(p, live)
                steps = ops.counted([s["step"][i] for i in live], own=donate)
                # Complex leaves as real pairs, as torch's foreach implementations
                # do: Adam's second moment is per component, not g * g.
                cplx = _any_complex(p, live)
                slots = {k: _picked(s[k], live, cplx) for k in self.slots}
                live_g = _picked(g, live, cplx)
                if self.maximize:
                    live_g = list(ops("neg", live_g))
                new_p, new_slots = rule(
                    ops, _picked(p, live, cplx), live_g, slots, steps, donate, lr
                )
        except (RuntimeError, TypeError):
            _checks.explain_state(call, params, p, s, live)  # a corrupt state, named
            _checks.explain_layout(call, params, p, g, live)  # a sparse leaf, named; else torch's
            raise
        news = (steps, new_p, new_slots)
        out_p, out = _placed((p, s), live, news, cplx=cplx, donate=donate, leaf=foreach)
        return _tree.unflatten(spec, out_p), {k: _tree.unflatten(spec, v) for k, v in out.items()}

    def _keys(self) -> tuple[str, ...]:
        return ("step", *self.slots)

    def rule(
        self,
        ops: _lists.Ops,
        params: Lists,
        grads: Lists,
        slots: Mapping[str, Lists],
        steps: Lists,
        donate: bool,
        lr: float | torch.Tensor,
    ) -> tuple[Lists, Mapping[str, Lists]]:
        """The update rule: new params and slots of this step's live leaves.

        Args:
            ops: ``ops(name, xs, *args, own=False, **kwargs)`` runs torch's
                ``name`` over the list ``xs`` (list arguments element by
                element), foreach kernels or plain ops; ``own=True`` may
                write into ``xs`` (pass ``own=donate`` for inputs, ``True``
                for lists this rule made); ``ops.scaled(xs, s, own=...,
                like=...)`` multiplies as torch's step does, to the bit.
            params, grads: the live leaves (real views of complex ones), and
                their gradients (negated under ``maximize``).
            slots: each slot's list, aligned with ``params``.
            steps: the step counts (float64 0-d tensors), already incremented.
            donate: whether ``params`` and ``slots`` may be written.
            lr: this step's rate (a float, or a 0-d tensor from a schedule).

        Returns:
            ``(new params, {slot: new list})``, every slot of ``slots``.
        """
        raise NotImplementedError

    def _scaled_add(
        self,
        ops: _lists.Ops,
        params: Lists,
        direction: Lists,
        scale: float | torch.Tensor,
        donate: bool,
    ) -> Lists:
        """``params + scale * direction``, as torch adds (``alpha`` for a float)."""
        if isinstance(scale, torch.Tensor):
            return ops("add", params, ops("mul", direction, scale), own=donate)
        return ops("add", params, direction, alpha=scale, own=donate)


def differentiable(
    lr: Any, p: list[Any], g: list[Any], s: dict[str, list[Any]], *, checked: bool = False
) -> bool:
    """Whether a step must carry derivatives: see :meth:`Optimizer._update_lists`.

    Parameters that are leaves of the autograd graph do not count: a
    ``loss.backward()`` loop passes them every step and wants new leaves,
    not a graph that grows with every step. ``checked``: every leaf passed
    :func:`fdp.optim._checks.live`, so ``g`` and ``s`` hold tensors (a step
    count that is not one fails the step), which torch's C loop can ask.
    """
    if _mode.transform_running():
        return True
    if _mode.dual(itertools.chain((lr,), g, *s.values(), p)):
        return True
    if not torch.is_grad_enabled():
        return False
    if isinstance(lr, torch.Tensor) and lr.requires_grad:
        return True
    if checked:
        if _compat.any_requires_grad(g, *s.values()):
            return True
        if not _compat.any_requires_grad(p):  # a pure loop's parameters
            return False
    elif _requires_grad([g, *s.values()]):
        return True
    # A loop, not any(): this runs over every leaf of every step.
    for t in p:  # noqa: SIM110
        if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None:
            return True
    return False


def _requires_grad(lists: list[list[Any]]) -> bool:
    """Whether a tensor in ``lists``, which may hold anything, requires grad."""
    for xs in lists:
        for t in xs:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                return True
    return False


def _carries(lr: Any) -> bool:
    """Whether a tensor learning rate alone makes the step carry derivatives."""
    return isinstance(lr, torch.Tensor) and differentiable(lr, [], [], {})


def _like_leaves_traced(new: Lists, old: list[Any]) -> Lists:
    """``new`` as it is: setting ``requires_grad`` would break the graph."""
    return new


@_mode.traced_as(_like_leaves_traced)
def like_leaves(new: Lists, old: list[Any]) -> Lists:
    """Each ``new`` as a leaf that requires grad if its ``old`` did (see the module doc).

    Asks once per list whether dynamo traces: the per-leaf loop stays plain.
    """
    return [n.requires_grad_() if o.requires_grad else n for n, o in zip(new, old, strict=True)]


def _placed(
    inputs: tuple[list[Any], dict[str, list[Any]]],
    idx: list[int],
    news: tuple[Lists, Lists, Mapping[str, Lists]],
    *,
    cplx: bool,
    donate: bool,
    leaf: bool,
) -> tuple[list[Any], dict[str, list[Any]]]:
    """The flat parameters and state with a step's results at ``idx``.

    ``news``: the new steps, parameters and slots (real views where
    ``cplx``), aligned with ``idx``; donated, only the steps are new (the
    rest was written in place, through the real views). ``leaf``: new
    parameters require grad where the old did (:func:`like_leaves`).
    """
    p, s = inputs
    steps, new_p, new_slots = news
    out_p, out = list(p), {k: list(v) for k, v in s.items()}
    results: list[tuple[list[Any], Lists]] = [(out["step"], steps)]
    if not donate:
        slots = [(out[k], v) for k, v in new_slots.items()]
        if cplx:  # back from real views, leaf by leaf
            back = [p[i].is_complex() for i in idx]
            new_p = [_complex(t, b) for t, b in zip(new_p, back, strict=True)]
            slots = [(d, [_complex(t, b) for t, b in zip(v, back, strict=True)]) for d, v in slots]
        new_p = like_leaves(new_p, [p[i] for i in idx]) if leaf else new_p
        results += [*slots, (out_p, new_p)]
    whole = len(idx) == len(p)  # every leaf, in order: the lists themselves
    for dst, values in results:
        if whole:
            dst[:] = values
            continue
        for j, i in enumerate(idx):
            dst[i] = values[j]
    return out_p, out


def _any_complex(p: list[Any], idx: list[int]) -> bool:
    # A loop, not any(genexpr): this runs over every leaf of every step.
    for i in idx:  # noqa: SIM110
        if p[i].is_complex():
            return True
    return False


def _picked(xs: list[Any], idx: list[int], real: bool) -> list[torch.Tensor]:
    """``xs`` at ``idx``; complex ones as real views where ``real`` (any is complex)."""
    return [_real(xs[i]) for i in idx] if real else [xs[i] for i in idx]


def _real(t: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(t) if t.is_complex() else t


def _complex(t: torch.Tensor, back: bool) -> torch.Tensor:
    return torch.view_as_complex(t) if back else t
