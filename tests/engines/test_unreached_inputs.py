"""An input no gradient reaches gets ``.grad = None``, as without remat, in both engines.

Under ``loss.backward()`` the torch.func engine took its gradients from
``torch.func.vjp``, which gives zeros for an input no gradient reaches: a
parameter of a skipped branch or of an expert no token was routed to got
``grad = zeros``, so AdamW's weight decay and moments moved it. Under a
torch.func transform zeros are what torch.func gives without remat too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest
import torch
from helpers import RecomputeCounter, assert_recomputed
from torch import nn

import remat

ENGINES = ("eager", "functional")
POLICIES = ("nothing-saveable", "dots-saveable", "save-last")


class Branchy(nn.Module):
    """``extra`` runs only when ``use_extra`` (a skipped branch)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.extra = nn.Linear(8, 8)
        self.use_extra = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(x))
        return self.extra(h) if self.use_extra else h


class TinyMoE(nn.Module):
    """Top-1 routing over three experts; an expert no token picks is not run (Mixtral's loop)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(8, 3)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        with torch.no_grad():  # every token prefers expert 0 or 1: expert 2 is unrouted
            self.router.bias.copy_(torch.tensor([5.0, 5.0, -50.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = torch.softmax(self.router(x), dim=-1)
        choice = weights.argmax(dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows = (choice == e).nonzero().flatten()
            if rows.numel() == 0:
                continue
            out = out.index_add(0, rows, expert(x[rows]) * weights[rows, e : e + 1])
        return out


class TwoHeads(nn.Module):
    """Returns two outputs; the loss reads only the first (the second's head gets None)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.used = nn.Linear(8, 8)
        self.unused = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.body(x))
        return self.used(h), self.unused(h)


def _first(out: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def _train(
    build: Callable[[], nn.Module], wrap: Callable[[nn.Module], Callable[..., object]]
) -> tuple[nn.Module, list[list[torch.Tensor | None]], RecomputeCounter]:
    """AdamW, 3 steps; the grads of every step; the last step's recomputes."""
    torch.manual_seed(0)
    model = build()
    f = wrap(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    seen: list[list[torch.Tensor | None]] = []
    counter = RecomputeCounter()
    for step in range(3):
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        with counter if step == 2 else contextlib.nullcontext():
            _first(f(x)).pow(2).sum().backward()  # type: ignore[arg-type]
        seen.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
        opt.step()
    return model, seen, counter


def _everything(build: Callable[[], nn.Module], engine: str) -> Callable[[], object]:
    def run() -> object:
        return _train(build, lambda m: remat.remat(m, engine=engine))[2].counts

    return run


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("build", [Branchy, TinyMoE, TwoHeads], ids=lambda b: b.__name__)
def test_unreached_parameters_get_none_and_adamw_matches(
    build: Callable[[], nn.Module], engine: str, policy: str
) -> None:
    ref, ref_grads, _ = _train(build, lambda m: m)
    got, got_grads, counter = _train(
        build, lambda m: remat.remat(m, engine=engine, policy=policy)
    )
    unreached = [i for i, g in enumerate(ref_grads[-1]) if g is None]
    assert unreached, "the program must leave a parameter unreached"
    for step, (r, g) in enumerate(zip(ref_grads, got_grads, strict=True)):
        for i, (a, b) in enumerate(zip(r, g, strict=True)):
            assert (a is None) == (b is None), f"step {step}: parameter {i}: {a} vs {b}"
            if a is not None:
                torch.testing.assert_close(b, a)
    for (name, p), q in zip(ref.named_parameters(), got.parameters(), strict=True):
        assert torch.equal(p, q), f"{name} moved differently after 3 AdamW steps"
    assert_recomputed(policy, counter.counts, _everything(build, engine))  # type: ignore[arg-type]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("engine", ENGINES)
def test_unused_input_tensor_gets_none(engine: str, policy: str) -> None:
    w = torch.randn(4, 4, requires_grad=True)

    def f(x: torch.Tensor, unused: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ w)

    def run(g: Callable[..., torch.Tensor]) -> tuple[torch.Tensor | None, ...]:
        w.grad = None
        x = torch.randn(3, 4, requires_grad=True)
        y = torch.randn(3, 4, requires_grad=True)
        g(x, y).sum().backward()
        return x.grad, y.grad, w.grad

    torch.manual_seed(1)
    ref = run(f)
    torch.manual_seed(1)
    counter = RecomputeCounter()
    with counter:
        got = run(remat.remat(f, engine=engine, policy=policy))
    assert ref[1] is None and got[1] is None
    for a, b in ((ref[0], got[0]), (ref[2], got[2])):
        assert a is not None and b is not None
        torch.testing.assert_close(b, a)

    def everything() -> object:
        torch.manual_seed(1)
        with RecomputeCounter() as c:
            run(remat.remat(f, engine=engine))
        return c.counts

    assert_recomputed(policy, counter.counts, everything)  # type: ignore[arg-type]


@pytest.mark.parametrize("policy", POLICIES)
def test_under_torch_func_grad_unused_inputs_get_zeros_like_no_remat(policy: str) -> None:
    """torch.func fills zeros for an input nothing reaches, with remat as without."""
    w = torch.randn(4, 4)
    x = torch.randn(3, 4)

    def f(x: torch.Tensor, w: torch.Tensor, unused: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ w).sum()

    args = (x, w, torch.randn(3))
    ref = torch.func.grad(f, argnums=(0, 1, 2))(*args)
    got = torch.func.grad(remat.remat(f, policy=policy), argnums=(0, 1, 2))(*args)
    for a, b in zip(ref, got, strict=True):
        torch.testing.assert_close(b, a)
    assert not torch.any(got[2])


def test_region_calling_torch_func_inside_auto_engine_leaves_unused_none() -> None:
    """The adversarial reproducer: auto picks the torch.func engine (a transform inside)."""

    class Block(Branchy):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            def energy(p: torch.Tensor) -> torch.Tensor:
                return torch.tanh(self.lin(p)).sum()

            h = torch.tanh(self.lin(x)) + torch.func.grad(energy)(x)
            return self.extra(h) if self.use_extra else h

    ref, ref_grads, _ = _train(Block, lambda m: m)
    got, got_grads, counter = _train(Block, lambda m: remat.remat(m))
    assert ref_grads[-1][2] is None and got_grads[-1][2] is None  # extra.weight
    for (name, p), q in zip(ref.named_parameters(), got.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert sum(counter.counts.values()) > 0
