"""What torch refuses under the torch.func engine raises `RematError` naming the region and a fix.

Each case runs under ``loss.backward()`` with ``engine="functional"`` (so the
torch.func engine runs a program torch.func cannot run), checks the message
names the region's function and source file, then applies the fix the message
gives and checks the gradients against no remat.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from helpers import RecomputeCounter
from torch import nn

import remat

W1 = torch.randn(8, 16, generator=torch.Generator().manual_seed(3))
W2 = torch.randn(16, 8, generator=torch.Generator().manual_seed(4))
FILE = "test_functional_refusals.py"


def _grads(
    fn: Callable[..., torch.Tensor], wrap: Callable[..., object] | None, **options: object
) -> tuple[list[torch.Tensor], RecomputeCounter]:
    """Gradients of ``fn(x * 1.0, w1, w2)``, ``fn`` the region (``wrap``: `remat.remat`)."""
    w1, w2 = W1.clone().requires_grad_(), W2.clone().requires_grad_()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(5), requires_grad=True)
    run: Callable[..., torch.Tensor] = fn if wrap is None else wrap(fn, **options)  # type: ignore[assignment]
    torch.manual_seed(0)
    with RecomputeCounter() as counter:
        run(x * 1.0, w1, w2).pow(2).sum().backward()
    return [x.grad, w1.grad, w2.grad], counter  # type: ignore[list-item]


def _in_place_input(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    x.add_(1.0)
    return torch.tanh(x @ w1) @ w2


def _cloned_input(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    x.add_(1.0)
    return torch.tanh(x @ w1) @ w2


def _hooked(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(x @ w1)
    h.register_hook(lambda g: g.clamp(-0.1, 0.1))
    return h @ w2


def _forces(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    with torch.enable_grad():
        pos = x.detach().requires_grad_(True)
        energy = (torch.tanh(pos @ w1) @ w2).sum()
        (force,) = torch.autograd.grad(energy, pos, create_graph=True)
    return -force * x


def _inner_checkpoint(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    h = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(t @ w1), x, use_reentrant=False)
    return h @ w2


def _attention_dropout(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        q = (x @ w1).reshape(2, 2, 2, 8)
        out = F.scaled_dot_product_attention(q, q, q, dropout_p=0.25, is_causal=True)
        return out.reshape(4, 16).float() @ w2


_CASES = {
    # name: (program, the message's words, the fix: (program, engine))
    "in-place input": (_in_place_input, "modifies its input in place", (_cloned_input, None)),
    "hook": (_hooked, "registers a gradient hook", (_hooked, "eager")),
    "requires_grad_": (_forces, "calls Tensor.requires_grad_()", (_forces, "eager")),
    "checkpoint": (_inner_checkpoint, "uses saved-tensor hooks", (_inner_checkpoint, "eager")),
    "autocast": (
        _attention_dropout,
        "torch.autocast entered inside the region",
        (_attention_dropout, "eager"),
    ),
}


@pytest.mark.parametrize("case", sorted(_CASES))
@pytest.mark.parametrize("policy", ["nothing-saveable", "dots-saveable"])
def test_refusal_names_the_region_and_a_fix_that_works(case: str, policy: str) -> None:
    program, words, (fixed, engine) = _CASES[case]
    if case == "hook" and policy != "nothing-saveable":
        # This policy's forward runs under torch.func.vjp, where the hook works.
        expected, _ = _grads(program, None)
        got, _ = _grads(program, remat.remat, policy=policy, engine="functional")
        torch.testing.assert_close(got, expected)
        return
    with pytest.raises(remat.RematError) as info:
        _grads(program, remat.remat, policy=policy, engine="functional")
    message = str(info.value)
    assert words in message and program.__name__ in message and FILE in message, message
    if engine is None:
        assert "Clone the input inside the function" in message
        assert isinstance(info.value, remat.SavedInputMutatedError)
    else:
        assert "engine='eager'" in message
    expected, _ = _grads(fixed, None)
    got, counter = _grads(fixed, remat.remat, policy=policy, engine=engine or "functional")
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert sum(counter.counts.values()) > 0  # the fix recomputes


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.out = nn.Linear(16, 8)
        self.calls = 0
        self.inner.register_full_backward_hook(self._hook)

    def _hook(self, module: nn.Module, grad_in: object, grad_out: object) -> None:
        self.calls += 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.inner(x))


@pytest.mark.parametrize("policy", ["nothing-saveable", "dots-saveable"])
def test_a_full_backward_hook_names_the_hook_and_eager_works(policy: str) -> None:
    x = torch.randn(4, 8, requires_grad=True)
    plain = _Block()
    plain(x).sum().backward()
    block = _Block()
    with pytest.raises(remat.RematError) as info:
        remat.remat(block, policy=policy, engine="functional")(x).sum().backward()
    message = str(info.value)
    assert "register_full_backward_hook" in message and "_Block.forward" in message
    assert "engine='eager'" in message
    block = _Block()
    remat.remat(block, policy=policy, engine="eager")(x).sum().backward()
    torch.testing.assert_close(
        [p.grad for p in block.parameters()], [p.grad for p in plain.parameters()]
    )
    assert block.calls == plain.calls == 1
