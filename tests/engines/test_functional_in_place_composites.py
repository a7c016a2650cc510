"""Composite ops that write in place (``gru_cell``) under the torch.func engine.

Autograd saves a copy (``clone``) of what an in-place op overwrites, once per
level that records it. Where the forward and the recompute are recorded by the
same levels (``torch.func.grad`` of tensors that do not require grad) the
replay follows; where not (parameters that require grad: eager autograd
records the forward, or a backward that may be differentiated) the engine
recomputes in full. Either way: no remat's gradients, and no
`NondeterministicRecomputeError` on a deterministic program. And CPU
``nn.LSTM`` (``mkldnn_rnn_layer``, float32), whose backward needs grad mode
on in its forward.
"""

from __future__ import annotations

import collections

import pytest
import torch
from helpers import RecomputeCounter
from torch import nn
from torch.func import functional_call, grad

import remat

F64 = torch.float64
POLICIES = ("nothing-saveable", "dots-saveable", "save-last", "budget:0.3")


def _cell(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return (nn.GRUCell(8, 16) if kind == "GRUCell" else nn.GRU(8, 16)).to(F64)


def _inputs(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x, h = ((4, 8), (4, 16)) if kind == "GRUCell" else ((3, 4, 8), (1, 4, 16))
    return torch.randn(x, dtype=F64, generator=g), torch.randn(h, dtype=F64, generator=g)


def _first(out: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def _backward(kind: str, policy: str | None) -> tuple[list[torch.Tensor], RecomputeCounter]:
    cell = _cell(kind)
    x, h = _inputs(kind)
    run = cell if policy is None else remat.remat(cell, policy=policy, engine="functional")
    with RecomputeCounter() as counter:
        _first(run(x, h)).pow(2).sum().backward()
    return [p.grad for p in cell.parameters()], counter


@pytest.mark.parametrize("kind", ["GRUCell", "GRU"])
@pytest.mark.parametrize("policy", POLICIES)
def test_gru_under_backward(kind: str, policy: str) -> None:
    expected, _ = _backward(kind, None)
    got, counter = _backward(kind, policy)
    torch.testing.assert_close(got, expected)
    everything = _backward(kind, "nothing-saveable")[1].counts
    if policy == "nothing-saveable":
        _check_recomputed(policy, counter.counts, everything)
    elif policy != "save-last":
        # The parameters require grad: eager autograd recorded the forward too, and not
        # the recompute (nothing differentiates a loss.backward()): in full.
        assert all(counter.counts[op] >= n for op, n in everything.items()), counter.counts


def _check_recomputed(
    policy: str, counts: collections.Counter[str], everything: collections.Counter[str]
) -> None:
    """What was kept was replayed. ``gru_cell`` adds into the hidden matmul's output in
    place, so that matmul reruns under every policy (a written kept output is never
    replayed, in the eager engine too); the input one is kept."""
    if policy == "nothing-saveable":
        assert counts == everything and counts["addmm"] > 0
    else:
        assert counts["addmm"] < everything["addmm"], (counts, everything)
        assert sum(counts.values()) < sum(everything.values())


def _grad(
    kind: str, policy: str | None, frozen: bool
) -> tuple[dict[str, torch.Tensor], RecomputeCounter]:
    """``grad(functional_call)`` of a region closing over the module; ``frozen``: its own
    parameters do not require grad (else the backward may be differentiated by eager
    autograd, so the recompute is recorded there too)."""
    cell = _cell(kind).requires_grad_(not frozen)
    x, h = _inputs(kind)
    params = {k: v.detach() for k, v in cell.named_parameters()}

    def block(p: dict[str, torch.Tensor], x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return _first(functional_call(cell, p, (x, h)))

    run = block if policy is None else remat.remat(block, policy=policy)
    with RecomputeCounter() as counter:
        grads = grad(lambda p: run(p, x, h).pow(2).sum())(params)
    return grads, counter


@pytest.mark.parametrize("frozen", [True, False])
@pytest.mark.parametrize("kind", ["GRUCell", "GRU"])
@pytest.mark.parametrize("policy", POLICIES)
def test_gru_under_torch_func_grad(kind: str, policy: str, frozen: bool) -> None:
    """nn.GRU's ``_flat_weights`` (a private list of its parameters, which
    ``functional_call`` rewrites) is not walked: walking it gave every parameter a
    zero gradient."""
    expected, _ = _grad(kind, None, frozen)
    got, counter = _grad(kind, policy, frozen)
    torch.testing.assert_close(got, expected)
    everything = _grad(kind, "nothing-saveable", frozen)[1].counts
    if frozen or policy == "nothing-saveable":
        _check_recomputed(policy, counter.counts, everything)
    elif policy != "save-last":  # (save-last holds the forward's graph: no recompute)
        # Eager autograd may differentiate this backward: its recompute is recorded
        # by two levels, whose in-place copies the replay cannot follow; in full.
        assert all(counter.counts[op] >= n for op, n in everything.items()), counter.counts


@pytest.mark.parametrize("policy", POLICIES)
def test_lstm_float32_under_backward(policy: str) -> None:
    def run(policy: str | None) -> tuple[list[torch.Tensor], RecomputeCounter]:
        torch.manual_seed(0)
        lstm = nn.LSTM(8, 16, batch_first=True)  # float32: the mkldnn kernel on CPU
        x = torch.randn(4, 3, 8)
        fn = (lambda x: lstm(x)[0]) if policy is None else remat.remat(
            lambda x: lstm(x)[0], policy=policy, engine="functional"
        )
        with RecomputeCounter() as counter:
            fn(x).pow(2).sum().backward()
        return [p.grad for p in lstm.parameters()], counter

    expected, _ = run(None)
    got, counter = run(policy)
    torch.testing.assert_close(got, expected)
    if policy == "nothing-saveable":
        assert counter.counts["mkldnn_rnn_layer"] == 1, counter.counts
