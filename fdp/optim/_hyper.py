"""Hyperparameters as ``fdp.optim``'s optimizers take them: checked once, with fdp's errors.

What every optimizer's constructor asks of its arguments: a number in range
or a 0-d tensor (:func:`check_hyper`), ``betas`` as floats
(:func:`float_betas`), and torch.optim's implementation options
(``foreach``, ``fused``, ...) taken or refused with the reason
(:func:`torch_options`, docs/optim.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from fdp import _mode, _tree


def float_betas(name: str, betas: Any) -> tuple[float, float]:
    """``betas`` as floats: torch accepts 0-d tensors there; fdp reads them once."""
    if not isinstance(betas, tuple | list) or len(betas) != 2:
        raise ValueError(f"fdp.optim.{name}: `betas` expected a pair of floats; got {betas!r}")
    out = []
    for i, beta in enumerate(betas):
        if isinstance(beta, torch.Tensor):
            if beta.requires_grad or _mode.wrapped([beta]) or beta.numel() != 1:
                raise ValueError(
                    f"fdp.optim.{name}: `betas[{i}]` expected a float or a 1-element tensor "
                    f"that does not require grad (differentiate w.r.t. lr); got "
                    f"{_tree.describe(beta)}"
                )
            beta = float(beta)
        out.append(beta)
    return out[0], out[1]


# torch.optim's options that choose how, not what: accepted where fdp's result
# is theirs, refused (with why) where it cannot be.
_TORCH_HOW: dict[str, tuple[tuple[object, ...], str]] = {
    "foreach": (
        (None, True, False),
        "True: torch.optim's foreach implementation op for op (as fused=False)",
    ),
    "differentiable": (
        (False, True),
        "fdp's step is differentiable whenever its inputs require grad or are under a "
        "torch.func transform",
    ),
    "capturable": (
        (False,),
        "fdp's eager step reads the step counts on the host; for CUDA graphs compile the "
        "update with torch.compile (its steps are tensors) and drop capturable",
    ),
}


def torch_options(name: str, options: Mapping[str, Any], *, own: tuple[str, ...]) -> None:
    """Accepts torch.optim's implementation options, or refuses with fdp's reason.

    ``own`` lists the optimizer's own keyword arguments, for the message.
    """
    call = f"fdp.optim.{name}"
    for key, value in options.items():
        how = _TORCH_HOW.get(key)
        if how is None:
            raise TypeError(
                f"{call}: got an unexpected keyword argument `{key}`; expected one of "
                f"{sorted(own)} or torch.optim's {sorted(_TORCH_HOW)} (docs/optim.md lists "
                "every torch.optim option)"
            )
        accepted, why = how
        if not any(value is v or (v is not None and value == v) for v in accepted):
            raise ValueError(
                f"{call}: `{key}` expected one of {list(accepted)}; got {value!r} ({why})"
            )


def implementation(name: str, fused: bool | None, options: Mapping[str, Any]) -> bool | None:
    """``fused`` as the optimizer takes it: ``foreach=True`` asks for the foreach step."""
    foreach = options.get("foreach")
    if foreach is True and fused is True:
        raise ValueError(
            f"fdp.optim.{name}: `foreach` and `fused` expected at most one True; got both "
            "(torch.optim refuses both too)"
        )
    return False if foreach is True else fused


def _readable_traced(value: torch.Tensor) -> bool:
    return False


@_mode.traced_as(_readable_traced)
def _readable(value: torch.Tensor) -> bool:
    """Whether a tensor hyperparameter's values can be read to check them.

    Vmapped or differentiated, they cannot (they are checked where the
    transform is not); while dynamo traces, reading one would break the graph.
    """
    return not _mode.wrapped([value])


def check_hyper(name: str, arg: str, value: Any, ok: Callable[[Any], bool], expected: str) -> None:
    if isinstance(value, torch.Tensor) and not _readable(value):
        return
    scalar = (
        float(value.detach()) if isinstance(value, torch.Tensor) and value.dim() == 0 else value
    )
    if isinstance(value, torch.Tensor) and value.dim() != 0:
        raise ValueError(
            f"fdp.optim.{name}: `{arg}` expected a float or a 0-d tensor; "
            f"got a tensor of shape {tuple(value.shape)}"
        )
    if not isinstance(scalar, int | float) or not ok(scalar):
        raise ValueError(f"fdp.optim.{name}: `{arg}` expected {expected}; got {value!r}")
