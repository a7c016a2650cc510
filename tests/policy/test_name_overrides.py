"""A ``checkpoint_name`` overrides its producer's decision, wherever the value goes.

``save_anything_except_these_names("h2")`` keeps every op output but ``h2``. An op
such as ``exp`` saves its own result for backward before ``checkpoint_name`` can
name it; the name must still win, so backward recomputes ``h2``'s producer,
including when ``h2`` is the region's own output.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from helpers import OpCounter

import remat
from remat import policies as P
from tests.conftest import Engine

Producer = Callable[[torch.Tensor], torch.Tensor]
PRODUCERS: dict[str, Producer] = {"exp": torch.exp, "tanh": torch.tanh, "sigmoid": torch.sigmoid}


def _program(producer: Producer, shape: str) -> Callable[[torch.Tensor, torch.Tensor], object]:
    def block(x: torch.Tensor, w: torch.Tensor) -> object:
        h1 = torch.sin(x @ w)
        h2 = remat.checkpoint_name(producer(h1 @ w), "h2")
        if shape == "output":
            return h2
        if shape == "tuple":
            return h2, h1
        return h2 @ w  # used further inside the region

    return block


def _loss(block: Callable[..., object]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def loss(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = block(x, w)
        if isinstance(out, tuple):
            return (out[0] * 2).sum() + out[1].sum()
        assert isinstance(out, torch.Tensor)
        return (out * 2).sum()

    return loss


def _backward_counts(
    engine: Engine, loss: Callable[..., torch.Tensor], x: torch.Tensor, w: torch.Tensor
) -> tuple[dict[str, int], tuple[torch.Tensor, ...]]:
    """Op counts of the backward alone (eager) or of the whole grad call (functional)."""
    if engine.name == "eager":
        xs = [x.detach().requires_grad_(), w.detach().requires_grad_()]
        out = loss(*xs)
        with OpCounter() as counter:
            found = torch.autograd.grad(out, xs)
        return dict(counter.counts), found
    with OpCounter() as counter:
        found = engine.grads(loss, x, w)
    return dict(counter.counts), found


@pytest.mark.parametrize("shape", ["output", "tuple", "inner"])
@pytest.mark.parametrize("name", sorted(PRODUCERS))
@pytest.mark.parametrize(
    "policy",
    ["everything-except:h2", P.save_anything_except_these_names("h2", "other"),
     "everything-except:h2+save:other"],
    ids=["string", "object", "combined"],
)
def test_named_value_is_recomputed(engine: Engine, shape: str, name: str, policy: object) -> None:
    producer = PRODUCERS[name]
    x, w = torch.randn(4, 3), torch.randn(3, 3)
    block = _program(producer, shape)
    reference = engine.grads(_loss(block), x, w)
    counts, found = _backward_counts(engine, _loss(engine.remat(block, policy=policy)), x, w)
    for a, b in zip(found, reference, strict=True):
        torch.testing.assert_close(a, b)
    forward_runs = 1 if engine.name == "functional" else 0  # grad counts the forward too
    # The name overrides "save everything": h2's producer runs again in backward...
    assert counts.get(name, 0) == forward_runs + 1, counts
    # ...and only it: sin (kept, not named) is replayed, not recomputed.
    assert counts.get("sin", 0) == forward_runs, counts


@pytest.mark.parametrize("shape", ["output", "tuple", "inner"])
def test_unnamed_policy_keeps_the_producer(engine: Engine, shape: str) -> None:
    """The same program when the name is not excepted: nothing is recomputed."""
    x, w = torch.randn(4, 3), torch.randn(3, 3)
    block = _program(torch.exp, shape)
    reference = engine.grads(_loss(block), x, w)
    rematted = _loss(engine.remat(block, policy="everything-except:other"))
    counts, found = _backward_counts(engine, rematted, x, w)
    for a, b in zip(found, reference, strict=True):
        torch.testing.assert_close(a, b)
    forward_runs = 1 if engine.name == "functional" else 0
    assert counts.get("exp", 0) == forward_runs, counts


def test_save_last_keeps_the_named_output_until_demoted() -> None:
    """Under save-last the last region keeps everything; demoted, the name decides."""
    x = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(3, 3, requires_grad=True)
    block = remat.remat(_program(torch.exp, "output"), policy="save-last+everything-except:h2")
    first = block(x, w)
    with OpCounter() as counter:
        torch.autograd.grad(first.sum(), (x, w), retain_graph=True)
    assert counter.counts["exp"] == 0  # the most recent region: kept
    second = block(first, w)  # demotes the first region
    with OpCounter() as counter:
        found = torch.autograd.grad((second * 2).sum(), (x, w))
    assert counter.counts["exp"] == 1  # the first region's h2 is recomputed, the last's kept
    f = _program(torch.exp, "output")
    xs = x.detach().requires_grad_(), w.detach().requires_grad_()
    reference = torch.autograd.grad((f(f(*xs), xs[1]) * 2).sum(), xs)  # type: ignore[arg-type]
    for a, b in zip(found, reference, strict=True):
        torch.testing.assert_close(a, b)
