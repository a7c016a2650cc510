"""`save_last` with several chains of regions in flight (NOTE [ The last region of a chain ]).

A pipeline stage runs several microbatches' forwards before their backwards.
In the eager engine each chain of dependent regions has its own last region,
kept until backward; a region demotes only the last regions it reads. The
torch.func engine keeps the rule "the most recent region is last" (a
transformed function runs one forward at a time): both are asserted here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from conftest import Engine
from helpers import OpCounter

import remat
from remat._inspect.memory import MemoryMeter


def _eager(fn: Callable[..., Any], **options: Any) -> Any:
    return remat.remat(fn, engine="eager", **options)


class Blocks:
    """Three ``save_last`` regions ``tanh(x @ w)`` that count their recomputes."""

    def __init__(self, make: Callable[..., Any] = _eager, width: int = 8) -> None:
        generator = torch.Generator().manual_seed(0)
        self.weights = [
            torch.randn(width, width, generator=generator, requires_grad=True) for _ in range(3)
        ]
        self.recomputes = [0, 0, 0]
        self.regions = [
            make(self._block(i), policy="save-last")
            for i in range(3)
        ]

    def _block(self, i: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def block(x: torch.Tensor) -> torch.Tensor:
            self.recomputes[i] += remat.is_recomputing()
            return torch.tanh(x @ self.weights[i])

        return block

    def chain(
        self, x: torch.Tensor, between: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """Blocks 0 and 1, with ``between`` run on what block 0 returns."""
        return self.regions[1](between(self.regions[0](x)))  # type: ignore[no-any-return]


def _plain(x: torch.Tensor, w0: torch.Tensor, w1: torch.Tensor) -> torch.Tensor:
    return torch.tanh((torch.tanh(x @ w0) * 2) @ w1)


def _microbatches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(4, 8, generator=generator) for _ in range(3)]


def test_each_microbatch_keeps_its_last_region_until_its_backward() -> None:
    blocks = Blocks()
    xs = _microbatches()
    outs = [blocks.chain(x, lambda h: h * 2) for x in xs]  # every forward before any backward
    for out in outs:
        out.sum().backward()
    # Block 0 recomputes once per microbatch, block 1 (each chain's last) never.
    assert blocks.recomputes == [3, 0, 0]
    w0, w1 = (w.detach().requires_grad_() for w in blocks.weights[:2])
    sum(_plain(x, w0, w1).sum() for x in xs).backward()  # type: ignore[union-attr]
    torch.testing.assert_close(blocks.weights[0].grad, w0.grad)
    torch.testing.assert_close(blocks.weights[1].grad, w1.grad)


def test_held_bytes_grow_by_one_chain_per_microbatch() -> None:
    """Exact: ``n`` microbatches in flight hold ``n`` times what one holds."""
    held = []
    for n in (1, 2, 3):
        blocks = Blocks()
        xs = _microbatches()[:n]
        with MemoryMeter() as meter:
            outs = [blocks.chain(x, lambda h: h * 2) for x in xs]
            held.append(meter.current)
        del outs
    # One chain holds what its last block keeps: its input ``2 * h`` (saved by ``mm``)
    # and its output (saved by ``tanh``), 4x8 floats each; block 0 holds nothing but
    # its input, made before the meter.
    assert held == [256, 512, 768]


def test_a_region_reading_the_last_region_demotes_it() -> None:
    """Within one chain, ops between regions do not hide the dependency: the old rule."""
    blocks = Blocks()
    x = _microbatches()[0]
    out = blocks.regions[2](blocks.chain(x, lambda h: (h * 2).relu()).exp())
    out.sum().backward()
    assert blocks.recomputes == [1, 1, 0]


def test_a_branch_off_a_demoted_region_keeps_both_last_regions() -> None:
    """Block 0 feeds blocks 1 and 2; 2 reads only block 0, demoted by 1 (rule 4)."""
    blocks = Blocks()
    h = blocks.regions[0](_microbatches()[0])
    a = blocks.regions[1](h)
    b = blocks.regions[2](h)
    (a.sum() + b.sum()).backward()
    assert blocks.recomputes == [1, 0, 0]


def test_two_microbatches_in_one_transformed_function(engine: Engine) -> None:
    """The torch.func engine demotes by recency: a third ``tanh`` is recomputed there.

    Counted as ops (the torch.func engine runs a kept region's Python again in
    backward, replaying its ops, so ``is_recomputing`` calls are no measure).
    """
    blocks = Blocks(engine.remat)
    xs = _microbatches()[:2]

    def loss(w0: torch.Tensor, w1: torch.Tensor) -> torch.Tensor:
        blocks.weights[0], blocks.weights[1] = w0, w1
        return sum(blocks.chain(x, lambda h: h * 2).sum() for x in xs)  # type: ignore[return-value]

    w0, w1 = (w.detach() for w in blocks.weights[:2])
    with OpCounter() as counter:
        got = engine.grads(loss, w0, w1)
    # Four forwards, then each microbatch's block 0; under torch.func also the first
    # microbatch's block 1, demoted by the second microbatch's block 0.
    assert counter.counts["tanh"] == {"eager": 6, "functional": 7}[engine.name]
    want = torch.func.grad(
        lambda a, b: sum(_plain(x, a, b).sum() for x in xs), argnums=(0, 1)  # type: ignore[misc]
    )(w0, w1)
    torch.testing.assert_close(got, want)
