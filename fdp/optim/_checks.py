"""The checks of an ``fdp.optim`` step's inputs, and the errors that name a bad leaf.

The common path pays one loop over the leaves (:func:`live`); a state that
cannot be the parameters' is named only after the step failed
(:func:`explain_state`).
"""

from __future__ import annotations

from typing import Any

import torch

from fdp import _tree


def live(
    call: str, params: Any, p: list[Any], g: list[Any], s: dict[str, list[Any]], slots: Any
) -> list[int]:
    """The leaves this step updates (a parameter with a gradient), their inputs checked.

    One loop over the leaves: it runs on every step of every leaf.
    """
    live = []
    slot_lists = [s[k] for k in slots]
    plain, inexact = torch.Tensor, _INEXACT
    for i, (pi, gi) in enumerate(zip(p, g, strict=True)):
        if gi is None:
            continue
        if type(pi) is plain:  # one set lookup, not two method calls
            dtype = pi.dtype
            if dtype not in inexact:
                continue
        elif is_param(pi):
            dtype = pi.dtype
        else:
            continue
        if type(gi) is not plain or gi.dtype is not dtype or gi.shape != pi.shape:
            check_grad(call, params, i, pi, gi)  # a subclass passes; others raise
        live.append(i)
        for leaves in slot_lists:
            # A slot of another dtype would be promoted silently (a float64
            # parameter out of a float32 one); other corruption fails in the step.
            if getattr(leaves[i], "dtype", None) is not dtype:
                explain_state(call, params, p, s, live)
    return live


# The dtypes ``is_param`` takes: floating point and complex.
_INEXACT = frozenset(
    d
    for d in vars(torch).values()
    if isinstance(d, torch.dtype) and (d.is_floating_point or d.is_complex)
)


def refuse_derivative(call: str, *, donate: bool, fused: bool) -> None:
    """A step that must carry derivatives cannot write in place nor run a fused kernel."""
    for option, on, why in (
        ("donate", donate, "writes in place"),
        ("fused", fused, "runs torch's fused kernel"),
    ):
        if on:
            raise ValueError(
                f"{call}: `{option}=True` {why}, which cannot carry a derivative; got inputs "
                "that require grad or are under a torch.func transform "
                f"(drop {option}=True to differentiate through the step)"
            )


def explain_state(
    call: str, params: Any, p: list[Any], s: dict[str, list[Any]], live: list[int]
) -> None:
    """Raises a ValueError naming the first state leaf that cannot be this leaf's state.

    Checked only after the step failed: the fast path pays nothing for it.
    """
    for key, leaves in s.items():
        for i in live:
            t, want = leaves[i], p[i]
            if key == "step":
                ok = isinstance(t, torch.Tensor) and t.numel() == 1
                expected = "a 1-element tensor (the step count)"
            else:
                ok = isinstance(t, torch.Tensor) and (t.shape, t.dtype) == (want.shape, want.dtype)
                expected = f"shape {tuple(want.shape)} and dtype {want.dtype}, as the parameter"
            if not ok:
                raise ValueError(
                    f"{call}: `state` leaf {_tree.path(params, i, f'state[{key!r}]')} expected "
                    f"{expected}; got {_tree.describe(t)}"
                )


def explain_layout(call: str, params: Any, p: list[Any], g: list[Any], live: list[int]) -> None:
    """Raises a ValueError naming the first parameter or gradient that is not dense.

    Checked only after the step failed: most rules' ops (``lerp``, ``sqrt``)
    have no sparse kernels; SGD's do, and step a sparse gradient as torch's SGD.
    """
    for i in live:
        for arg, t in (("params", p[i]), ("grads", g[i])):
            if t.layout is not torch.strided:
                raise ValueError(
                    f"{call}: `{arg}` leaf {_tree.path(params, i, arg)} expected a strided "
                    f"(dense) tensor; got {_tree.describe(t)}, layout {t.layout} (no sparse "
                    "form here: pass `.to_dense()`)"
                )


def is_param(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def matching(call: str, arg: str, tree: Any, spec: Any, params: Any) -> list[Any]:
    """``tree``'s leaves, checked to have ``params``' structure."""
    if tree is None:
        raise ValueError(f"{call}: `{arg}` expected a tree shaped like `params`; got None")
    leaves, got = _tree.flatten(tree)
    _tree.require_structure(call, arg, got, spec, of="`params`")
    return leaves


def check_grad(call: str, params: Any, i: int, p: torch.Tensor, g: Any) -> None:
    if not isinstance(g, torch.Tensor) or g.shape != p.shape or g.dtype != p.dtype:
        raise ValueError(
            f"{call}: `grads` leaf {_tree.path(params, i, 'grads')} expected a tensor of shape "
            f"{tuple(p.shape)} and dtype {p.dtype}; got {_tree.describe(g)}"
        )


def dense_grad(call: str, params: Any, i: int, g: torch.Tensor) -> torch.Tensor:
    """``g`` as a dense tensor for a dense bucket: a sparse COO gradient densified.

    ``nn.Embedding(sparse=True)`` gives one; its reduction as the dense
    tensor it stands for steps SGD to the values of torch's sparse step.
    Other layouts are refused by name.
    """
    if g.layout is torch.strided:
        return g
    if g.layout is torch.sparse_coo:
        return g.to_dense()
    raise ValueError(
        f"{call}: `grads` leaf {_tree.path(params, i, 'grads')} expected a dense (strided) or "
        f"sparse COO tensor; got {_tree.describe(g)}, layout {g.layout}"
    )
