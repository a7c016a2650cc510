"""Exact divergence of a continuous normalizing flow's vector field, rematerialized.

A continuous normalizing flow (and the probability-flow ODE of a diffusion
model) moves samples along ``dz/dt = f(z, t)``; the log-density changes at the
rate ``-div f = -trace(df/dz)``. For small data dimensions the divergence is
computed exactly, as the trace of the Jacobian of ``f`` for each sample:
``vmap(jacrev(f))`` over the batch. Here ``f`` is a residual MLP whose blocks
are wrapped with ``remat.wrap``. The script checks that the divergence (and
the Jacobian computed forward-mode with ``jacfwd``) equals that of the same
network without remat, and prints the peak memory of the ``vmap(jacrev)``
call with and without remat (bytes of every tensor created during the call,
counted exactly on CPU). ``nothing-saveable`` keeps only each block's input;
``dots-saveable`` keeps each block's two wide matmul outputs (``fc1``'s and
``time``'s) so that the recompute re-runs no matmul, which is more than autograd
itself keeps here, where the parameters need no gradient.

``torch.utils.checkpoint`` cannot do this: ``jacrev`` is built on
``torch.func.vjp``, which refuses saved-tensor hooks; the script shows it raising.

Run with ``python examples/flow_divergence.py``.
"""

from __future__ import annotations

import copy
import gc
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import jacfwd, jacrev, vmap
from torch.utils.checkpoint import checkpoint

import remat
from remat.testing import MemoryMeter  # the exact CPU meter behind remat.measure_memory

POLICIES = ("nothing-saveable", "dots-saveable")


class Block(nn.Module):
    """A residual MLP block conditioned on time: ``h + fc2(silu(fc1(norm(h)) + time(t))))``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.time = nn.Linear(1, 4 * width)

    def forward(self, h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return h + self.fc2(F.silu(self.fc1(self.norm(h)) + self.time(t)))


class VectorField(nn.Module):
    """``f(z, t)``: lift ``z`` to ``width``, run ``depth`` blocks, project back."""

    def __init__(self, dim: int, width: int, depth: int) -> None:
        super().__init__()
        self.lift, self.out = nn.Linear(dim, width), nn.Linear(width, dim)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))

    def forward(self, z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = self.lift(z)
        for block in self.blocks:
            h = block(h, t)
        out: torch.Tensor = self.out(h)
        return out


def jacobians(field: nn.Module, z: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Return ``df/dz`` for each sample, shape ``(batch, dim, dim)``, and the call's peak bytes."""
    gc.collect()  # garbage of earlier runs must not be freed (and uncounted) inside the meter
    with MemoryMeter() as meter:
        meter.add_baseline((field, z, t))
        jac: torch.Tensor = vmap(jacrev(field))(z, t)
    return jac, meter.peak


def main(small: bool = False) -> dict[str, Any]:
    """Compute the exact divergence with and without remat; return the numbers printed.

    Args:
        small (bool, optional): use a tiny network (for the test suite). Default: False.

    Returns:
        dict[str, Any]: ``"divergence"``, the no-remat divergence of each sample
        (a list); ``"peak"``, the peak bytes of ``vmap(jacrev)`` by policy
        (``"none"`` is no remat); ``"max_abs_diff"``, the largest difference
        of the remat divergence (under ``jacrev`` and ``jacfwd``) from the
        no-remat one, by policy; ``"torch_checkpoint_error"``, the message
        ``torch.utils.checkpoint`` raised with.
    """
    dim, width, depth, batch = (3, 16, 2, 4) if small else (2, 256, 12, 512)
    torch.manual_seed(0)
    base = VectorField(dim, width, depth)
    for p in base.parameters():
        p.requires_grad_(False)  # only derivatives with respect to z are wanted
    z, t = torch.randn(batch, dim), torch.rand(batch, 1)

    jac, peak_none = jacobians(base, z, t)
    reference = jac.diagonal(dim1=-2, dim2=-1).sum(-1)
    # The trace of a Jacobian from autograd on one sample agrees.
    one = torch.autograd.functional.jacobian(lambda zi: base(zi, t[0]), z[0])
    torch.testing.assert_close(one.trace(), reference[0])

    peak = {"none": peak_none}
    max_abs_diff: dict[str, float] = {}
    for policy in POLICIES:
        field = copy.deepcopy(base)
        for block in field.blocks:
            remat.wrap(block, policy=policy)
        jac, peak[policy] = jacobians(field, z, t)
        # Forward mode holds nothing for a backward pass, so remat saves no memory
        # there; it must still give the same Jacobian.
        forward_jac = vmap(jacfwd(field))(z, t)
        diffs = []
        for j in (jac, forward_jac):
            divergence = j.diagonal(dim1=-2, dim2=-1).sum(-1)
            torch.testing.assert_close(divergence, reference, rtol=1e-4, atol=1e-5)
            diffs.append((divergence - reference).abs().max().item())
        max_abs_diff[policy] = max(diffs)

    print(f"exact divergence of a {dim}-d vector field ({depth} blocks of width {width}),")
    print(f"  {batch} samples: {', '.join(f'{d:.4f}' for d in reference[:4].tolist())}, ...")
    print(f"{'policy':<20}{'vmap(jacrev) peak':>19}{'vs none':>9}{'max |diff|':>13}")
    for policy, bytes_ in peak.items():
        diff = f"{max_abs_diff[policy]:.1e}" if policy in max_abs_diff else "-"
        print(f"{policy:<20}{bytes_:>19,}{bytes_ / peak_none:>8.2f}x{diff:>13}")

    field = copy.deepcopy(base)
    for block in field.blocks:
        block.forward = lambda h, t, f=block.forward: checkpoint(f, h, t, use_reentrant=False)
    try:
        jacobians(field, z, t)
    except RuntimeError as error:
        torch_checkpoint_error = str(error).splitlines()[0]
    else:  # pragma: no cover - would mean torch now supports it
        torch_checkpoint_error = ""
    print(f"torch.utils.checkpoint under vmap(jacrev): RuntimeError: {torch_checkpoint_error}")
    return {
        "divergence": reference.tolist(),
        "peak": peak,
        "max_abs_diff": max_abs_diff,
        "torch_checkpoint_error": torch_checkpoint_error,
    }


if __name__ == "__main__":
    main()
