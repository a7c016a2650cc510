"""A name policy whose names match no `checkpoint_name` of its region warns once (both engines)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator

import pytest
import torch

import remat
from remat._policy import name_check as _name_check
from remat.policies import Decision
from tests.conftest import Engine


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    # Once per region, for the process: each engine's run of a test is a fresh start.
    _name_check._warned.clear()
    yield
    _name_check._warned.clear()


def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    hidden = remat.checkpoint_name(torch.tanh(x @ w), "hidden")
    return (torch.sin(hidden) @ w).sum()


def train(
    engine: Engine,
    fn: Callable[..., torch.Tensor],
    reference: Callable[..., torch.Tensor] = block,
    steps: int = 3,
) -> list[warnings.WarningMessage]:
    """Run ``steps`` gradient computations (checked against ``reference``); return the
    RematWarnings they gave."""
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    expected = torch.func.grad(reference, argnums=(0, 1))(x, w)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(steps):
            got = engine.grads(fn, x, w)
            for a, e in zip(got, expected, strict=True):
                torch.testing.assert_close(a, e)
    return [m for m in seen if issubclass(m.category, remat.RematWarning)]


@pytest.mark.parametrize("policy", ["save:hiden", "offload:hiden", "everything-except:hiden",
                                    "save-except:hiden", "save:hiden+dots-saveable"])
def test_a_misspelled_name_warns_once_listing_the_names_seen(engine: Engine, policy: str) -> None:
    seen = train(engine, engine.remat(block, policy=policy))
    assert len(seen) == 1
    message = str(seen[0].message)
    assert "block (" in message and "test_name_warning.py" in message  # the region, by line
    assert "'hiden'" in message and "The names it saw: 'hidden'." in message
    assert "Did you mean 'hidden' (for 'hiden')?" in message


def test_the_fix_it_suggests_keeps_the_named_value_and_is_silent(engine: Engine) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", remat.RematWarning)
        assert train(engine, engine.remat(block, policy="save:hidden")) == []
    held = remat.saved_residuals(block, torch.randn(4, 8), torch.randn(8, 8, requires_grad=True),
                                 policy="save:hidden")
    assert [(r.name, r.decision) for r in held if r.name] == [("hidden", Decision.SAVE)]


@pytest.mark.parametrize("policy", ["save:hidden", "save:hidden,other", "save-except:hidden",
                                    "dots-saveable", "nothing-saveable", "save-last"])
def test_no_warning_when_a_name_matches_or_no_name_is_used(engine: Engine, policy: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", remat.RematWarning)
        assert train(engine, engine.remat(block, policy=policy)) == []


def test_a_region_that_names_nothing_says_so(engine: Engine) -> None:
    def unnamed(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (torch.sin(torch.tanh(x @ w)) @ w).sum()

    seen = train(engine, engine.remat(unnamed, policy="save:hidden"), unnamed)
    assert len(seen) == 1
    assert "called remat.checkpoint_name on nothing" in str(seen[0].message)
    assert "remat.checkpoint_name(h, 'hidden')" in str(seen[0].message)


def test_each_region_warns_once_for_itself(engine: Engine) -> None:
    first = engine.remat(block, policy="save:hiden")

    def second_block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return block(x, w)

    second = engine.remat(second_block, policy="save:hiden")
    seen = train(engine, lambda x, w: first(x, w) + second(x, w), lambda x, w: 2 * block(x, w))
    assert len(seen) == 2
    regions = {str(m.message).split(" of ")[1].split(" (")[0] for m in seen}
    assert regions == {"block", "test_each_region_warns_once_for_itself.<locals>.second_block"}


def test_a_name_given_to_a_region_input_counts_as_seen(engine: Engine) -> None:
    def named_input(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        x = remat.checkpoint_name(x, "hidden")  # an input: kept anyway, but the name is used
        return (torch.sin(x @ w) @ w).sum()

    with warnings.catch_warnings():
        warnings.simplefilter("error", remat.RematWarning)
        assert train(engine, engine.remat(named_input, policy="save:hidden"), named_input) == []
