"""accelerate with remat: wrap the blocks first, then ``prepare``.

remat wraps a module in place (its ``forward``), so wrap before
``accelerator.prepare``: whatever accelerate wraps the model in (DDP, FSDP,
mixed precision) then calls the rematerialized blocks. Code that takes a
checkpoint *function* instead (FSDP's ``apply_activation_checkpointing`` with
``checkpoint_wrapper``) gets it as ``checkpoint_fn=remat.compat.checkpoint``.

A small residual MLP stack trains a few steps on CPU, once with its blocks
under ``dots-saveable`` and once plainly; the losses are the same.

Run with ``python examples/accelerate_prewrap.py``.
"""

from __future__ import annotations

import functools
from typing import Any

import accelerate
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing,
    checkpoint_wrapper,
)

import remat
import remat.compat


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(self.norm(x)))))


def train(how: str, small: bool) -> dict[str, Any]:
    """Train a few steps with the blocks wrapped ``how``; return losses and wrapped blocks."""
    width, depth, steps = (16, 3, 3) if small else (256, 8, 20)
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(width) for _ in range(depth)], nn.Linear(width, 1))
    if how == "remat.apply":
        remat.apply(model, where=Block, policy="dots-saveable")  # before prepare
    elif how == "checkpoint_wrapper":
        wrapper = functools.partial(
            checkpoint_wrapper, checkpoint_fn=remat.compat.checkpoint, policy="dots-saveable"
        )
        apply_activation_checkpointing(
            model, checkpoint_wrapper_fn=wrapper, check_fn=lambda m: isinstance(m, Block)
        )
    wrapped = sum(
        remat.is_wrapped(m) or type(m).__name__ == "CheckpointWrapper" for m in model.modules()
    )
    accelerator = accelerate.Accelerator(cpu=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(8, width, generator=generator)
        loss = model(x).square().mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "wrapped": wrapped}


def main(small: bool = False) -> dict[str, Any]:
    """Train plainly, with ``remat.apply`` and with ``checkpoint_wrapper``; return each run.

    Args:
        small (bool, optional): use tiny sizes (for the test suite). Default: False.

    Returns:
        dict: per run, ``losses`` (per step) and ``wrapped`` (how many blocks remat runs).
    """
    result = {how: train(how, small) for how in ("plain", "remat.apply", "checkpoint_wrapper")}
    for how, run in result.items():
        losses = [round(v, 5) for v in run["losses"]]
        print(f"{how}: {run['wrapped']} blocks wrapped, losses {losses}")
    return result


if __name__ == "__main__":
    main()
