"""Which engine runs a call is decided in one place (NOTE [ Engine selection ]).

A policy that recomputes nothing runs as plain autograd whatever the engine
asked for (and with ``debug=True`` too): the graph is the one without remat.
Any other policy gets the engine asked for, or under "auto" the one the
context needs.
"""

from __future__ import annotations

import pytest
import torch

import remat
from remat._engines.region import Region
from remat._engines.select import EngineKind, engine_for
from remat._policy.strings import resolve


def f(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x @ x.T).sum()


def region(policy: str, engine: str, debug: bool = False) -> Region:
    return Region(fn=f, policy=resolve(policy), engine=engine, debug=debug, label="f")


@pytest.mark.parametrize("engine", ["auto", "eager", "functional"])
@pytest.mark.parametrize("debug", [False, True])
def test_a_policy_that_recomputes_nothing_runs_plainly(engine: str, debug: bool) -> None:
    assert engine_for(region("everything-saveable", engine, debug), False) is EngineKind.PLAIN
    x = torch.randn(3, 3, requires_grad=True)
    out = remat.remat(f, policy="everything-saveable", engine=engine, debug=debug)(x)  # type: ignore[call-overload]
    assert out.grad_fn.name() == f(x).grad_fn.name() == "SumBackward0"
    assert out.grad_fn.next_functions[0][0].name() == "SinBackward0"  # no remat node between


@pytest.mark.parametrize(
    ("engine", "uses_torch_func", "expected"),
    [
        ("auto", False, EngineKind.EAGER),
        ("auto", True, EngineKind.FUNCTIONAL),
        ("eager", False, EngineKind.EAGER),
        ("functional", False, EngineKind.FUNCTIONAL),
    ],
)
def test_outside_transforms_the_engine_asked_for(
    engine: str, uses_torch_func: bool, expected: EngineKind
) -> None:
    assert engine_for(region("nothing-saveable", engine), uses_torch_func) is expected


def test_under_a_transform_auto_is_functional_and_eager_raises() -> None:
    seen: list[EngineKind] = []

    def probe(x: torch.Tensor) -> torch.Tensor:
        seen.append(engine_for(region("nothing-saveable", "auto"), False))
        with pytest.raises(remat.RematError, match="engine='auto'"):
            engine_for(region("nothing-saveable", "eager"), False)
        return x.sum()

    torch.func.grad(probe)(torch.randn(3))
    assert seen == [EngineKind.FUNCTIONAL]
