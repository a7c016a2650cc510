"""One save-last chain for both engines: only the most recent save-last region keeps everything.

The contract (DESIGN §1, ``save-last``): everything of the most recent region,
nothing (beyond its base policy) of the others, whichever engine ran each one.
Regions are forced onto an engine with ``engine=``; ``loss.backward()`` runs
both (the torch.func engine's Function works under eager autograd too).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import remat
from remat import measure_memory
from tests.helpers import OpCounter

Block = Callable[[torch.Tensor], torch.Tensor]
W = torch.randn(16, 16, generator=torch.Generator().manual_seed(1))
ENGINES = ("eager", "functional")


def block(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ W) @ W


def regions(engines: tuple[str, ...], policies: tuple[str, ...]) -> list[Block]:
    return [
        remat.remat(block, policy=p, engine=e)  # type: ignore[call-overload]
        for e, p in zip(engines, policies, strict=True)
    ]


def chain(blocks: list[Block]) -> Callable[[torch.Tensor], torch.Tensor]:
    def loss(x: torch.Tensor) -> torch.Tensor:
        for b in blocks:
            x = b(x)
        return x.pow(2).sum()

    return loss


def backward_tanh(blocks: list[Block], x: torch.Tensor) -> int:
    """How many ``tanh`` ops the backward ran: one per region recomputed."""
    loss = chain(blocks)(x)
    with OpCounter() as ops:
        loss.backward()
    return ops.counts["tanh"]


def grad_of(blocks: list[Block], x: torch.Tensor) -> torch.Tensor:
    x = x.detach().requires_grad_()
    chain(blocks)(x).backward()
    assert x.grad is not None
    return x.grad


@pytest.mark.parametrize("engines", [(a, b) for a in ENGINES for b in ENGINES])
@pytest.mark.parametrize("base", ["", "+dots-saveable"])
def test_the_latest_save_last_region_demotes_the_previous_one_whatever_its_engine(
    engines: tuple[str, str], base: str
) -> None:
    x = torch.randn(8, 16, requires_grad=True)
    save_last = regions(engines, ("save-last" + base,) * 2)
    # Only the first (demoted) region reruns its tanh in backward; the latest keeps it.
    assert backward_tanh(save_last, x) == 1
    expected = grad_of([block, block], x)
    torch.testing.assert_close(grad_of(save_last, x), expected)


@pytest.mark.parametrize("engines", [(a, b) for a in ENGINES for b in ENGINES])
def test_a_demoted_region_holds_what_its_base_policy_holds(engines: tuple[str, str]) -> None:
    x = torch.randn(8, 16, requires_grad=True)
    mixed = measure_memory(chain(regions(engines, ("save-last", "save-last"))), x)
    # The first region, demoted, holds what nothing-saveable holds; the latest everything.
    demoted = measure_memory(chain(regions(engines, ("nothing-saveable", "save-last"))), x)
    assert mixed.held_bytes == demoted.held_bytes
    assert mixed.peak_bytes == demoted.peak_bytes
    # And the latest region holds more than it would without being the latest.
    neither = measure_memory(chain(regions(engines, ("nothing-saveable",) * 2)), x)
    assert mixed.held_bytes > neither.held_bytes


def test_three_regions_alternating_engines_keep_only_the_last() -> None:
    x = torch.randn(8, 16, requires_grad=True)
    blocks = regions(("functional", "eager", "functional"), ("save-last",) * 3)
    assert backward_tanh(blocks, x) == 2
    torch.testing.assert_close(grad_of(blocks, x), grad_of([block] * 3, x))
