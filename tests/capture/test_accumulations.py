"""The ``.grad`` watch (NOTE [ State the forward changes ] rule 3) writes its entries
straight into each parameter's post-accumulate hook table: a user's own hook there
still runs, and nothing of remat's stays once the forward has ended."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat


class _InnerBackward(nn.Module):
    """Runs a ``.backward()`` inside its forward (a fitted statistic, a meta-step)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.lin(x.detach()).pow(2).sum().backward()
        return torch.tanh(self.lin(x)).exp()


@pytest.mark.parametrize("policy", ["nothing-saveable", "dots-saveable"])
def test_inner_backward_grads_and_hook_tables(policy: str) -> None:
    torch.manual_seed(0)
    net = _InnerBackward()
    seen: list[int] = []
    handle = net.lin.weight.register_post_accumulate_grad_hook(lambda t: seen.append(1))
    # (The recompute runs the inner backward again; its ``.grad`` is put back after.)
    x = torch.randn(2, 3, requires_grad=True)
    region = remat.remat(net, policy=policy, engine="eager")
    out = region(x)
    # Only the user's entry is left in the table once the forward has ended.
    assert list(net.lin.weight._post_accumulate_grad_hooks) == [handle.id]
    out.sum().backward()
    got = (net.lin.weight.grad.clone(), x.grad.clone())
    assert seen  # the user's hook ran
    net.zero_grad(set_to_none=True)
    x.grad = None
    net(x).sum().backward()  # no remat: the same inner backward, once
    torch.testing.assert_close(got, (net.lin.weight.grad, x.grad))
    handle.remove()
    assert not net.lin.weight._post_accumulate_grad_hooks
