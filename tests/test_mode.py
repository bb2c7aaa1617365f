"""fdp._mode: the one place that asks "eager or traced?", and the forms it picks."""

from __future__ import annotations

import pytest
import torch

from fdp import _mode


def _eager_form(x: torch.Tensor) -> torch.Tensor:
    """Doubles ``x`` (the eager form)."""
    return x * 2


def _traced_form(x: torch.Tensor) -> torch.Tensor:
    return x * 3


PICK = _mode.by_mode(_eager_form, _traced_form)


def test_by_mode_runs_the_eager_form_eagerly_and_the_traced_form_in_a_graph() -> None:
    torch._dynamo.reset()
    x = torch.arange(3.0)
    torch.testing.assert_close(PICK(x), x * 2)
    compiled = torch.compile(lambda t: PICK(t) + 1, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), x * 3 + 1)
    assert PICK.__name__ == "_eager_form"
    assert PICK.__doc__ == _eager_form.__doc__


def test_by_mode_binds_as_a_method() -> None:
    class Scaled:
        def __init__(self, k: float) -> None:
            self.k = k

        def _eager(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.k

        def _traced(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.k + 100

        apply = _mode.by_mode(_eager, _traced)

    torch._dynamo.reset()
    s, x = Scaled(2.0), torch.ones(2)
    torch.testing.assert_close(s.apply(x), x * 2)
    compiled = torch.compile(s.apply, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), x * 2 + 100)


def test_traced_is_true_only_while_dynamo_traces() -> None:
    torch._dynamo.reset()

    def probe(x: torch.Tensor) -> torch.Tensor:
        return x + 1 if _mode.traced() else x - 1

    assert not _mode.traced()
    x = torch.zeros(1)
    torch.testing.assert_close(torch.compile(probe, backend="eager")(x), x + 1)
    torch.testing.assert_close(probe(x), x - 1)


def test_refuse_compiled_transform_raises_only_inside_a_compiled_transform() -> None:
    def loss(x: torch.Tensor) -> torch.Tensor:
        _mode.refuse_compiled_transform("fdp.test", "testing", lost="the gradient")
        return (x**2).sum()

    torch._dynamo.reset()
    x = torch.arange(3.0)
    torch.testing.assert_close(torch.func.grad(loss)(x), 2 * x)  # eager transform: fine
    torch.testing.assert_close(torch.compile(loss, backend="eager")(x), (x**2).sum())
    with pytest.raises(
        NotImplementedError, match=r"fdp.test: testing .* lose the gradient.*#193279"
    ):
        torch.compile(torch.func.grad(loss), backend="eager")(x)


def _tripled_traced(x: torch.Tensor) -> torch.Tensor:
    return x * 3


@_mode.traced_as(_tripled_traced)
def doubled(x: torch.Tensor) -> torch.Tensor:
    """Twice ``x``."""
    return x * 2


def test_traced_as_keeps_the_eager_def_and_runs_its_twin_in_a_graph() -> None:
    torch._dynamo.reset()
    x = torch.arange(3.0)
    torch.testing.assert_close(doubled(x), x * 2)
    compiled = torch.compile(lambda t: doubled(t) + 1, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), x * 3 + 1)
    assert doubled.__name__ == "doubled"
    assert doubled.__doc__ == "Twice ``x``."
