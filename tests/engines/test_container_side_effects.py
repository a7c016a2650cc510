"""Python containers a region mutates see the same effects under both engines.

The torch.func engine once rebuilt the arguments and the closed-over
containers as copies and ran ``fn`` on those: an append to a list passed
through ``static_argnums``, a counter in a dict argument, a note in a
closed-over dict were lost under ``torch.func.grad`` and kept under eager.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import CORE_POLICIES
from torch import nn

import remat

D = torch.float64


def _body(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = remat.checkpoint_name(torch.tanh(x @ w), "hidden")
    return (h @ w).sin().sum()


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(3, 4, dtype=D), torch.randn(4, 4, dtype=D)


def _reference(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    leaves = [x.detach().requires_grad_(), w.detach().requires_grad_()]
    return torch.autograd.grad(_body(*leaves), leaves)


@pytest.mark.parametrize("policy", CORE_POLICIES)
def test_static_list_argument(engine: Any, policy: str) -> None:
    def f(x: torch.Tensor, w: torch.Tensor, log: list[str]) -> torch.Tensor:
        if not remat.is_recomputing():  # as the docs recommend
            log.append("forward")
        return _body(x, w)

    region = engine.remat(f, policy=policy, static_argnums=(2,))
    log: list[str] = []
    x, w = _inputs()
    got = engine.grads(lambda x, w: region(x, w, log), x, w)
    assert log == ["forward"]
    torch.testing.assert_close(got, _reference(x, w))


@pytest.mark.parametrize("policy", CORE_POLICIES)
def test_dict_argument_holding_tensors(engine: Any, policy: str) -> None:
    # The dict is an argument whose tensor is an input: it must still be the user's dict.
    def f(x: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
        if not remat.is_recomputing():
            state["calls"] = state.get("calls", 0) + 1
            state["ids"].append(id(state))
        return _body(x, state["w"])

    region = engine.remat(f, policy=policy)
    x, w = _inputs()
    seen: list[dict[str, Any]] = []

    def loss(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        state: dict[str, Any] = {"w": w, "ids": []}
        seen.append(state)
        return region(x, state)  # type: ignore[no-any-return]

    got = engine.grads(loss, x, w)
    (state,) = seen
    assert state["calls"] == 1
    assert state["ids"] == [id(state)]  # ``fn`` got the very dict the caller passed
    torch.testing.assert_close(got, _reference(x, w))


@pytest.mark.parametrize("policy", CORE_POLICIES)
def test_keyword_list_argument(engine: Any, policy: str) -> None:
    def f(x: torch.Tensor, *, ws: list[torch.Tensor]) -> torch.Tensor:
        out = _body(x, ws[0])
        if not remat.is_recomputing():
            ws.append(ws[0])  # the caller reads it back
        return out

    region = engine.remat(f, policy=policy)
    x, w = _inputs()
    lists: list[list[torch.Tensor]] = []

    def loss(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ws = [w]
        lists.append(ws)
        return region(x, ws=ws)  # type: ignore[no-any-return]

    got = engine.grads(loss, x, w)
    (ws,) = lists
    assert len(ws) == 2 and ws[0] is ws[1]
    torch.testing.assert_close(got, _reference(x, w))


@pytest.mark.parametrize("policy", CORE_POLICIES)
def test_closed_over_dict_and_list(engine: Any, policy: str) -> None:
    x, w = _inputs()

    def loss(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        params = {"w": w}
        notes: list[Any] = [w]

        def f(x: torch.Tensor) -> torch.Tensor:
            if not remat.is_recomputing():
                params["calls"] = params.get("calls", 0) + 1
                notes.append("forward")
            return _body(x, params["w"])

        out = engine.remat(f, policy=policy)(x)
        assert params["calls"] == 1  # read back inside the differentiated function
        assert notes[1:] == ["forward"] and notes[0] is w
        CLOSED.append((params, notes))
        return out  # type: ignore[no-any-return]

    CLOSED.clear()
    got = engine.grads(loss, x, w)
    ((params, notes),) = CLOSED
    assert params["calls"] == 1 and notes[1:] == ["forward"]
    torch.testing.assert_close(got, _reference(x, w))


CLOSED: list[Any] = []


class Recorder(nn.Module):
    """A module that notes what its forward saw on its own attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4, dtype=D)
        self.history: list[tuple[int, ...]] = []
        self.extra = {"scale": nn.Parameter(torch.tensor(1.5, dtype=D))}
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not remat.is_recomputing():
            self.history.append(tuple(x.shape))
            self.calls += 1
            self.extra["seen"] = True
        h = remat.checkpoint_name(torch.tanh(self.lin(x)), "hidden")
        return (h * self.extra["scale"]).pow(2).sum()


@pytest.mark.parametrize("policy", CORE_POLICIES)
def test_module_attributes(engine: Any, policy: str) -> None:
    torch.manual_seed(0)
    plain, module = Recorder(), Recorder()
    module.load_state_dict(plain.state_dict())
    module.extra["scale"] = plain.extra["scale"]
    region = engine.remat(module, policy=policy)
    x, _ = _inputs()
    got = engine.grads(lambda x: region(x), x)
    assert module.history == [(3, 4)] and module.calls == 1 and module.extra["seen"] is True
    torch.testing.assert_close(got, engine.grads(lambda x: plain(x), x))
