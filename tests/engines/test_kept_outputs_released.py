"""Kept op outputs go once the recompute has replayed them (NOTE [ The eager engine ] rule 7).

A policy that keeps op outputs (``dots-saveable``) holds them in the region's op
log for the recompute to replay. What backward itself reads, the holders keep;
the log's references go as the replay passes each record, so a kept output only
the recompute reads is freed at once, and one backward reads is freed when
backward consumes its holder (before: when the region's whole graph was freed).
A retained graph, a second backward, double backward and a second recompute
still give the plain gradients; a second recompute runs the released ops again.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from helpers import Fn, RecomputeCounter, assert_close_all
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import remat
from remat._offload.fake import FakeHostStore
from remat._policy import ops as _ops


class _LoraLinear(nn.Module):
    """A frozen ``n x n`` weight plus a trainable rank-``r`` update, as LoRA adds one."""

    def __init__(self, n: int, r: int, generator: torch.Generator) -> None:
        super().__init__()
        weight = torch.randn(n, n, generator=generator) / n**0.5
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.a = nn.Parameter(torch.randn(r, n, generator=generator) / n**0.5)
        self.b = nn.Parameter(torch.randn(n, r, generator=generator) / r**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight) + F.linear(F.linear(x, self.a), self.b)


class _Block(nn.Module):
    def __init__(self, n: int, r: int, generator: torch.Generator) -> None:
        super().__init__()
        self.l1 = _LoraLinear(n, r, generator)
        self.l2 = _LoraLinear(n, r, generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.l2(torch.tanh(self.l1(x)))


def _lora_stack() -> tuple[nn.Module, torch.Tensor]:
    """Four LoRA blocks (width 64, rank 4) and a (32, 64) input: one region around all."""
    generator = torch.Generator().manual_seed(0)
    blocks = nn.Sequential(*[_Block(64, 4, generator) for _ in range(4)])
    return blocks, torch.randn(32, 64, generator=generator)


def _step(region: nn.Module | functools.partial[torch.Tensor]) -> remat.MemoryReport:
    return remat.measure_memory(lambda x: region(x).pow(2).sum(), _X)


_BLOCKS, _X = _lora_stack()


def _fresh_grads() -> None:
    for p in _BLOCKS.parameters():
        p.grad = None


@pytest.mark.parametrize("policy", ["dots-saveable", "dots-no-batch-saveable", "offload-dots"])
def test_kept_outputs_go_as_the_recompute_replays_them(policy: str) -> None:
    """The step peak of the LoRA stack in one region, exact.

    Before the release, the log held every kept matmul output (the frozen
    weight's ``x @ W.T`` and the update's ``(x @ A.T) @ B.T``, which the recompute
    reads and no backward formula saves) until the region's whole backward had
    run: the step peaked at 210,440 B, above torch's selective checkpointing
    of the same ops (167,944 B). Now each goes as the replay passes it: 159,744 B.
    What the forward holds for backward is unchanged (126,980 B: kept outputs
    nothing reads were already let go when the forward ended). On CPU the
    default host store takes nothing, so ``offload-dots`` saves as ``dots-saveable``.
    """
    _fresh_grads()
    report = _step(remat.remat(_BLOCKS, policy=policy, engine="eager"))
    assert report.held_bytes == 126_980
    assert report.peak_bytes == 159_744


def test_the_peak_is_below_torch_selective_checkpointing_of_the_same_ops() -> None:
    def must_save_dots(ctx: object, op: object, *args: object, **kw: object) -> CheckpointPolicy:
        saved = getattr(op, "overloadpacket", None) in _ops.DOT_OPS
        return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE

    context = functools.partial(create_selective_checkpoint_contexts, must_save_dots)
    _fresh_grads()
    sac = functools.partial(checkpoint, _BLOCKS, use_reentrant=False, context_fn=context)
    torch_sac = _step(sac)
    _fresh_grads()
    ours = _step(remat.remat(_BLOCKS, policy="dots-saveable", engine="eager"))
    assert torch_sac.peak_bytes == 167_944  # it pops each cached output as it replays it
    assert ours.peak_bytes < torch_sac.peak_bytes
    assert ours.held_bytes < torch_sac.held_bytes


@pytest.mark.parametrize("policy", ["dots-saveable", "save:hidden", "offload-dots"])
def test_the_stack_gives_the_plain_gradients_and_recomputes_no_dot(policy: str) -> None:
    blocks, x = _lora_stack()
    blocks(x).pow(2).sum().backward()
    expected = [p.grad.clone() for p in blocks.parameters() if p.grad is not None]
    for p in blocks.parameters():
        p.grad = None
    region = remat.remat(
        blocks, policy=policy, engine="eager", offload_store=FakeHostStore(min_bytes=0)
    )
    with RecomputeCounter() as counter:
        region(x).pow(2).sum().backward()
    assert_close_all([p.grad for p in blocks.parameters() if p.grad is not None], expected)
    assert counter.counts["tanh"] == 4  # recomputed once per block, not more
    if policy != "save:hidden":
        assert counter.counts["mm"] == 0


def _kept_and_saved(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x @ w`` is kept (a dot) and saved by ``sin``; ``exp`` saves what it makes."""
    h = x @ w
    return h, h.sin() + remat.checkpoint_name(h.exp(), "hidden")


def _loss(out: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    h, y = out
    return h.sum() + y.pow(2).sum()


def _leaves() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(4, 3, generator=generator, dtype=torch.float64)
    w = torch.randn(3, 5, generator=generator, dtype=torch.float64)
    return x.requires_grad_(), w.requires_grad_()


@pytest.mark.parametrize("policy", ["dots-saveable", "save:hidden", "offload-dots"])
def test_a_retained_graph_backs_up_twice_and_recomputes_once(policy: str) -> None:
    x, w = _leaves()
    expected = torch.autograd.grad(_loss(_kept_and_saved(x, w)), (x, w))
    f = remat.remat(
        _kept_and_saved, policy=policy, engine="eager", offload_store=FakeHostStore(min_bytes=0)
    )
    loss = _loss(f(x, w))
    with RecomputeCounter() as first_counter:
        first = torch.autograd.grad(loss, (x, w), retain_graph=True)
    with RecomputeCounter() as second_counter:
        second = torch.autograd.grad(loss, (x, w))
    assert_close_all(first, expected)
    assert_close_all(second, expected)
    assert sum(first_counter.counts.values()) > 0
    assert sum(second_counter.counts.values()) == 0  # the holders kept what it read


def _two_dots(
    x: torch.Tensor, w: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both matmuls are kept; ``sin`` saves the second one's output, ``exp`` its own."""
    h2 = (x @ w) @ v
    return h2, h2.sin().exp()


def test_a_second_recompute_runs_the_released_ops_again() -> None:
    """A kept output written in place after the first backward empties its holder:
    the second backward recomputes it, from the region's inputs (the log let go
    of what the first recompute replayed). Plain autograd raises here; the
    recompute gives the forward's values, so the gradients are the first
    backward's."""
    x, w = _leaves()
    v = torch.randn(5, 2, dtype=torch.float64, requires_grad=True)

    def loss_of(out: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return out[0].sum() + out[1].pow(2).sum()  # nothing outside saves out[0]

    expected = torch.autograd.grad(loss_of(_two_dots(x, w, v)), (x, w, v))
    out = remat.remat(_two_dots, policy="dots-saveable", engine="eager")(x, w, v)
    loss = loss_of(out)
    with RecomputeCounter() as first_counter:
        first = torch.autograd.grad(loss, (x, w, v), retain_graph=True)
    assert first_counter.counts["mm"] == 0 and first_counter.counts["exp"] == 1
    with torch.no_grad():
        out[0].mul_(1.0)  # the same values at a new version: sin's holder empties
    with RecomputeCounter() as second_counter:
        second = torch.autograd.grad(loss, (x, w, v))
    assert_close_all(first, expected)
    assert_close_all(second, expected)
    assert second_counter.counts["mm"] == 2


def _exp_out(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = x @ w
    return h.exp(), h.sin()


def test_a_demotion_after_a_recompute_runs_the_released_ops_again() -> None:
    """``save-last+dots-saveable``: a region recomputed while latest (its output
    written in place) and demoted afterwards recomputes again, running the
    matmul its log no longer keeps (before: replayed)."""
    x, w = _leaves()

    def loss_of(out: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return out[0].sum() + out[1].pow(2).sum()

    expected = torch.autograd.grad(loss_of(_exp_out(x, w)), (x, w))
    f = remat.remat(_exp_out, policy="save-last+dots-saveable", engine="eager")
    out = f(x, w)
    loss = loss_of(out)
    with torch.no_grad():
        out[0].mul_(1.0)  # the same values at a new version: exp's holder empties
    with RecomputeCounter() as first_counter:
        first = torch.autograd.grad(loss, (x, w), retain_graph=True)
    assert first_counter.counts["mm"] == 0 and first_counter.counts["exp"] == 1
    f(out[1], w.t().contiguous())  # a save-last region reading f's output: demotes it
    with RecomputeCounter() as second_counter:
        second = torch.autograd.grad(loss, (x, w))
    assert_close_all(first, expected)
    assert_close_all(second, expected)
    assert second_counter.counts["mm"] == 1 and second_counter.counts["exp"] == 1


@pytest.mark.parametrize("policy", ["dots-saveable", "save:hidden", "save-last+dots-saveable"])
def test_double_backward_through_a_recomputed_region(policy: str) -> None:
    def second_order(f):  # type: ignore[no-untyped-def]
        x, w = _leaves()
        first = torch.autograd.grad(_loss(f(x, w)), (x, w), create_graph=True)
        return torch.autograd.grad(sum((g * g).sum() for g in first), (x, w))

    def doubled(t: torch.Tensor) -> torch.Tensor:
        return t * 2

    def model(f: Fn, g: Fn) -> Fn:
        def run(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h, y = f(x, w)
            return h, g(y)  # under save-last, g demotes f, which then recomputes

        return run

    f = remat.remat(_kept_and_saved, policy=policy, engine="eager")
    g = remat.remat(doubled, policy=policy, engine="eager")
    assert_close_all(second_order(model(f, g)), second_order(model(_kept_and_saved, doubled)))
