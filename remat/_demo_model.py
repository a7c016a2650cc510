"""A small GPT-style block stack, shared by the demo, the tests and the benchmark.

Each `Block` is pre-norm attention then a pre-norm MLP, each with a residual,
and tags two values with `remat.checkpoint_name`: the attention output
(``"attn_out"``) and the MLP's hidden activation (``"mlp_hidden"``). A `Stack`
runs its blocks under one *checkpointing* choice, a string:

- ``"none"``: plain autograd, nothing rematerialized;
- ``"torch-checkpoint"``: ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``;
- ``"torch-selective:<policy>"``: torch's selective checkpointing saving the ops
  that the remat policy ``dots-saveable`` or ``dots-no-batch-saveable`` saves;
- anything else: a remat policy string, ``remat.remat(block, policy=...)``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from ._api import checkpoint_name
from ._api import remat as remat_fn
from ._policy import ops as _ops

__all__ = [
    "DEMO_SEQ", "DEMO_WIDTH", "NO_REMAT", "TORCH_CHECKPOINT", "TORCH_SELECTIVE", "Block", "Stack",
    "make_input",
]

NO_REMAT = "none"
TORCH_CHECKPOINT = "torch-checkpoint"
TORCH_SELECTIVE = "torch-selective:"

#: The demo's default size (``python -m remat``): width 256, 128 tokens per sequence.
#: Saving the matmuls pays on CPU only where they cost more than the per-op
#: bookkeeping of saving them: measured side by side (``benchmarks/width_sweep.py``),
#: torch's selective checkpointing beats its full checkpointing, and remat's
#: ``dots-saveable`` its ``nothing-saveable``, from about width 256 at 64 to 128
#: tokens; at width 64 both run slower than full checkpointing (issue 17).
DEMO_WIDTH, DEMO_SEQ = 256, 128

#: The op sets a torch selective-checkpointing variant saves, by remat policy name.
_SELECTIVE_OPS: dict[str, frozenset[Any]] = {
    "dots-saveable": _ops.DOT_OPS,
    "dots-no-batch-saveable": _ops.DOT_NO_BATCH_OPS,
}


class Block(nn.Module):
    """One GPT block: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``, causal attention.

    Args:
        width (int): the model width (a multiple of ``heads``).
        heads (int): the number of attention heads.

    Examples:
        >>> import torch
        >>> Block(8, 2)(torch.randn(2, 5, 8)).shape
        torch.Size([2, 5, 8])
    """

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"Block: width {width} is not a multiple of heads {heads}")
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(width, dim=-1)
        q, k, v = (t.view(batch, seq, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attn = checkpoint_name(F.scaled_dot_product_attention(q, k, v, is_causal=True), "attn_out")
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, seq, width))
        hidden = checkpoint_name(F.gelu(self.fc1(self.ln2(x))), "mlp_hidden")
        out: torch.Tensor = x + self.fc2(hidden)
        return out


class Stack(nn.Module):
    """``depth`` blocks in sequence, each rematerialized as ``checkpointing`` says.

    Args:
        depth (int, optional): the number of blocks. Default: 8.
        width (int, optional): the model width. Default: 64.
        heads (int, optional): attention heads per block. Default: 4.
        seed (int, optional): the seed of the (deterministic) initialization. Default: 0.

    Examples:
        >>> import torch
        >>> model = Stack(depth=2, width=16, heads=2)
        >>> x = make_input(model, batch=2, seq=4)
        >>> torch.allclose(model(x, "nothing-saveable"), model(x, "none"))
        True
    """

    def __init__(self, depth: int = 8, width: int = 64, heads: int = 4, seed: int = 0) -> None:
        super().__init__()
        # A private generator: initialization never depends on (or disturbs) global RNG state.
        generator = torch.Generator().manual_seed(seed)
        self.width = width
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, nn.Linear):
                    bound = 1 / math.sqrt(module.in_features)
                    module.weight.uniform_(-bound, bound, generator=generator)
                    module.bias.uniform_(-bound, bound, generator=generator)
        # Wrappers per (block, checkpointing): building one resolves the policy.
        self._runners: dict[tuple[int, str], Callable[[torch.Tensor], torch.Tensor]] = {}

    def forward(self, x: torch.Tensor, checkpointing: str = NO_REMAT) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = self._runner(i, block, checkpointing)(x)
        return x

    def loss(self, x: torch.Tensor, checkpointing: str = NO_REMAT) -> torch.Tensor:
        """Return a scalar training loss: the mean square of the stack's output."""
        loss: torch.Tensor = self(x, checkpointing).pow(2).mean()
        return loss

    def _runner(
        self, i: int, block: nn.Module, checkpointing: str
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        key = (i, checkpointing)
        if key not in self._runners:
            self._runners[key] = _make_runner(block, checkpointing)
        return self._runners[key]


def _make_runner(block: nn.Module, checkpointing: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if checkpointing == NO_REMAT:
        return block
    if checkpointing == TORCH_CHECKPOINT:
        return functools.partial(checkpoint, block, use_reentrant=False)
    if checkpointing.startswith(TORCH_SELECTIVE):
        context_fn = _selective_context(checkpointing[len(TORCH_SELECTIVE) :])
        return functools.partial(checkpoint, block, use_reentrant=False, context_fn=context_fn)
    return remat_fn(block, policy=checkpointing)


def _selective_context(policy: str) -> Callable[[], Any]:
    if policy not in _SELECTIVE_OPS:
        raise ValueError(
            f"Stack: torch selective checkpointing supports {sorted(_SELECTIVE_OPS)}, "
            f"got {policy!r}"
        )
    saved = _SELECTIVE_OPS[policy]

    def policy_fn(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op.overloadpacket in saved:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, policy_fn)


def make_input(model: Stack, batch: int = 4, seq: int = 64, seed: int = 1) -> torch.Tensor:
    """Return a deterministic input of shape ``(batch, seq, model.width)``.

    Examples:
        >>> make_input(Stack(depth=1, width=8, heads=2), batch=2, seq=3).shape
        torch.Size([2, 3, 8])
    """
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, seq, model.width, generator=generator)
