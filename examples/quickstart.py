"""Quickstart: rematerialize a function, pick a policy, see what it keeps.

Run with ``python examples/quickstart.py``.
"""

from __future__ import annotations

import torch

import remat
from remat import print_saved_residuals


def mlp(x: torch.Tensor, params: dict[str, torch.Tensor]) -> torch.Tensor:
    """A two-layer MLP whose hidden activation is named "hidden"."""
    hidden = remat.checkpoint_name(torch.tanh(x @ params["w1"]), "hidden")
    return hidden @ params["w2"]


def main(small: bool = False) -> dict[str, float]:
    """Train-step an MLP under three policies; return each policy's loss.

    Args:
        small (bool, optional): use tiny sizes (for the test suite). Default: False.

    Returns:
        dict[str, float]: the loss under each policy (they are all equal).
    """
    width = 16 if small else 512
    torch.manual_seed(0)
    params = {
        "w1": (torch.randn(width, 4 * width) / width**0.5).requires_grad_(),
        "w2": (torch.randn(4 * width, width) / width**0.5).requires_grad_(),
    }
    x = torch.randn(8, width)

    reference = torch.autograd.grad(mlp(x, params).square().mean(), list(params.values()))
    losses = {}
    for policy in ("nothing-saveable", "dots-saveable", "save:hidden"):
        fn = remat.remat(mlp, policy=policy)  # or @remat.remat(policy=...) on the def
        loss = fn(x, params).square().mean()
        grads = torch.autograd.grad(loss, list(params.values()))
        for g, r in zip(grads, reference, strict=True):
            torch.testing.assert_close(g, r)  # same gradients, whatever the policy
        losses[policy] = loss.item()
        print(f"--- {policy}: loss {loss.item():.4f}")
        print_saved_residuals(mlp, x, params, policy=policy)
    return losses


if __name__ == "__main__":
    main()
