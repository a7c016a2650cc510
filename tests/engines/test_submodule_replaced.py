"""A submodule replaced between the forward and the backward raises in both engines.

Before, the torch.func engine's ``nothing-saveable`` recompute ran the new ``Linear``:
the old one's weights (the Function's inputs) got a silent zero gradient and
``scale`` the gradient of a forward that never ran (3.53 -> -1.70). Now it raises
the eager engine's `SavedInputMutatedError` (NOTE [ Bindings the recompute reads ]
rule 5; ``_engines/functional/submodules.py``), and the fix it names works.
"""

from __future__ import annotations

import pytest
import torch
from helpers import RecomputeCounter
from torch import nn

import remat
from remat._errors import SavedInputMutatedError

D = torch.double
ENGINES = ("eager", "functional")
POLICIES = ("nothing-saveable", "dots-saveable", "budget:0.3")
REPLACED = (r"submodule (module\.)?lin of _Replaceable\.forward \(.*\) was replaced after "
            r"its forward pass ran the Linear there \(it holds a Linear now\).*Replace it "
            r"after backward, or use policy='everything-saveable'")


class _Replaceable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 4, dtype=D)
        self.scale = nn.Parameter(torch.ones(4, dtype=D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * self.scale


def _grads(model: _Replaceable, out: torch.Tensor, old: nn.Linear) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(out.pow(2).sum(), [model.scale, old.weight, old.bias])


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("engine", ENGINES)
def test_replaced_submodule_raises_and_replacing_after_backward_works(
    engine: str, policy: str
) -> None:
    torch.manual_seed(0)
    model = _Replaceable()
    x = torch.randn(5, 3, dtype=D)
    old = model.lin
    want = _grads(model, model(x), old)

    out = remat.remat(model, policy=policy, engine=engine)(x)
    model.lin = nn.Linear(3, 4, dtype=D)  # model surgery before backward
    with pytest.raises(SavedInputMutatedError, match=REPLACED):
        out.pow(2).sum().backward()

    # The fix the message names: replace it after backward.
    model.lin = old
    counter = RecomputeCounter()
    with counter:
        out = remat.remat(model, policy=policy, engine=engine)(x)
        got = _grads(model, out, old)
    model.lin = nn.Linear(3, 4, dtype=D)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    assert counter.counts["tanh"] == (0 if policy == "budget:0.3" else 1) or (
        policy == "budget:0.3" and sum(counter.counts.values()) > 0
    ), counter.counts

    # The other fix: a policy that keeps everything reads no module again.
    model.lin = old
    out = remat.remat(model, policy="everything-saveable", engine=engine)(x)
    model.lin = nn.Linear(3, 4, dtype=D)
    for g, w in zip(_grads(model, out, old), want, strict=True):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("policy", ["nothing-saveable", "dots-saveable"])
def test_replaced_inside_torch_func_grad_raises(policy: str) -> None:
    """Under ``torch.func.grad`` (the torch.func engine): surgery inside the loss."""
    torch.manual_seed(0)
    model = _Replaceable()
    x = torch.randn(5, 3, dtype=D)
    params = dict(model.named_parameters())
    want = torch.func.grad(lambda p: torch.func.functional_call(model, p, (x,)).pow(2).sum())(
        params
    )
    region = remat.wrap(model, policy=policy)

    def loss(p: dict[str, torch.Tensor], swap: bool) -> torch.Tensor:
        out = torch.func.functional_call(region, p, (x,))
        if swap:
            model.lin = nn.Linear(3, 4, dtype=D)
        return out.pow(2).sum()

    old = model.lin
    with pytest.raises(SavedInputMutatedError, match=REPLACED):
        torch.func.grad(loss)(params, True)
    model.lin = old
    counter = RecomputeCounter()
    with counter:
        got = torch.func.grad(loss)(params, False)
    assert counter.counts["tanh"] == 1, counter.counts
    for name in want:
        torch.testing.assert_close(got[name], want[name])


def test_a_held_save_last_graph_differentiates_the_forward_that_ran() -> None:
    """No recompute, no check: the held graph is the forward's (torch.func engine)."""
    torch.manual_seed(0)
    model = _Replaceable()
    x = torch.randn(5, 3, dtype=D)
    params = {k: v.detach() for k, v in model.named_parameters()}  # held: NOTE rule 13
    old = model.lin
    want = torch.func.grad(lambda p: torch.func.functional_call(model, p, (x,)).pow(2).sum())(
        params
    )
    region = remat.wrap(model, policy="save-last")

    def loss(p: dict[str, torch.Tensor]) -> torch.Tensor:
        out = torch.func.functional_call(region, p, (x,))
        model.lin = nn.Linear(3, 4, dtype=D)
        return out.pow(2).sum()

    counter = RecomputeCounter()
    with counter:
        got = torch.func.grad(loss)(params)
    model.lin = old
    assert sum(counter.counts.values()) == 0, counter.counts
    for name in want:
        torch.testing.assert_close(got[name], want[name])
