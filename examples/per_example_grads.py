"""Per-example gradients of a rematerialized transformer with ``vmap(grad(...))``.

Per-example gradients (for DP-SGD clipping, gradient-noise statistics, influence
functions) are ``torch.func.vmap(torch.func.grad(loss))``: one gradient of the
whole parameter dict per example, in one batched call. This script wraps every
block of a small transformer with ``remat.wrap``, calls it through
``torch.func.functional_call`` inside ``vmap(grad(...))``, checks that the
per-example gradients equal those of the same model without remat, and prints
the peak memory of the call with and without remat (bytes of every tensor
created during the call, counted exactly on CPU).

``torch.utils.checkpoint`` cannot do this: it works through saved-tensor hooks,
which ``torch.func.grad`` refuses, so the last part shows it raising.

Run with ``python examples/per_example_grads.py``.
"""

from __future__ import annotations

import copy
import gc
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils.checkpoint import checkpoint

import remat
from remat.testing import MemoryMeter  # the exact CPU meter behind remat.measure_memory

POLICIES = ("nothing-saveable", "dots-saveable")


class Block(nn.Module):
    """Pre-norm causal self-attention then a pre-norm MLP, each with a residual."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(w, dim=-1)
        q, k, v = (t.reshape(b, s, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        scores = (q @ k.transpose(-1, -2)) / (w // self.heads) ** 0.5
        attn = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, w))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Regressor(nn.Module):
    """``depth`` blocks, mean-pooled over the sequence, then a linear head to one number."""

    def __init__(self, width: int, depth: int, heads: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(x.mean(dim=1)).squeeze(-1)
        return out


def per_example_grads(
    model: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor
) -> tuple[dict[str, torch.Tensor], int]:
    """Return ``vmap(grad(loss))`` over the batch, and the peak bytes the call created."""

    def loss(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        # vmap strips the batch dimension; the model wants one, of size 1.
        prediction = functional_call(model, p, (xi.unsqueeze(0),))
        return (prediction - yi).pow(2).sum()

    gc.collect()  # garbage of earlier runs must not be freed (and uncounted) inside the meter
    with MemoryMeter() as meter:
        meter.add_baseline((params, x, y))
        grads: dict[str, torch.Tensor] = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    return grads, meter.peak


def main(small: bool = False) -> dict[str, Any]:
    """Compute per-example gradients with and without remat; return the numbers printed.

    Args:
        small (bool, optional): use a tiny model (for the test suite). Default: False.

    Returns:
        dict[str, Any]: ``"peak"``, the peak bytes by policy (``"none"`` is no
        remat); ``"max_abs_diff"``, the largest difference from the no-remat
        gradients by policy; ``"torch_checkpoint_error"``, the message
        ``torch.utils.checkpoint`` raised with.
    """
    width, depth, heads, batch, seq = (16, 2, 2, 4, 8) if small else (128, 8, 4, 16, 128)
    torch.manual_seed(0)
    base = Regressor(width, depth, heads)
    params = {name: p.detach() for name, p in base.named_parameters()}
    x, y = torch.randn(batch, seq, width), torch.randn(batch)

    reference, peak_none = per_example_grads(base, params, x, y)
    peak = {"none": peak_none}
    max_abs_diff: dict[str, float] = {}
    for policy in POLICIES:
        model = copy.deepcopy(base)
        for block in model.blocks:
            remat.wrap(block, policy=policy)
        grads, peak[policy] = per_example_grads(model, params, x, y)
        for name, g in grads.items():
            torch.testing.assert_close(g, reference[name], rtol=1e-4, atol=1e-5)
        max_abs_diff[policy] = max((grads[n] - reference[n]).abs().max().item() for n in grads)

    norms = torch.stack([g.flatten(1).norm(dim=1) for g in reference.values()]).norm(dim=0)
    count = sum(p.numel() for p in params.values())
    print(f"per-example gradients of {count:,} parameters ({depth} blocks of width {width}),")
    print(f"  {batch} examples; gradient norms {', '.join(f'{n:.3f}' for n in norms[:4])}, ...")
    print(f"{'policy':<20}{'peak bytes':>14}{'vs none':>9}{'max |diff|':>13}")
    for policy, bytes_ in peak.items():
        diff = f"{max_abs_diff[policy]:.1e}" if policy in max_abs_diff else "-"
        print(f"{policy:<20}{bytes_:>14,}{bytes_ / peak_none:>8.2f}x{diff:>13}")

    # The same per-example gradients with torch.utils.checkpoint around each block.
    model = copy.deepcopy(base)
    for block in model.blocks:
        block.forward = lambda x, f=block.forward: checkpoint(f, x, use_reentrant=False)
    try:
        per_example_grads(model, params, x, y)
    except RuntimeError as error:
        torch_checkpoint_error = str(error).splitlines()[0]
    else:  # pragma: no cover - would mean torch now supports it
        torch_checkpoint_error = ""
    print(f"torch.utils.checkpoint under vmap(grad): RuntimeError: {torch_checkpoint_error}")
    return {
        "peak": peak,
        "max_abs_diff": max_abs_diff,
        "torch_checkpoint_error": torch_checkpoint_error,
    }


if __name__ == "__main__":
    main()
