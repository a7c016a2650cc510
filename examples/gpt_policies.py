"""A GPT training step under several remat policies, with what each keeps for backward.

Every block of a small GPT is wrapped with ``remat.remat(block, policy=...)``. For
each policy the script runs one AdamW step from the same starting point, checks
that the loss and gradients equal those of the model without remat, and prints
the bytes one block keeps for backward (from ``saved_residuals``).

Run with ``python examples/gpt_policies.py``.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat import residual_totals, saved_residuals

POLICIES = (
    "nothing-saveable",
    "dots-saveable",
    "dots-no-batch-saveable",
    "save:attn_out",
    "save-last",
    "everything-saveable",
)


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP, with named attention output."""

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
        attn = remat.checkpoint_name(attn, "attn_out")
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, w))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    """Token and position embeddings, ``depth`` blocks, a language-model head."""

    def __init__(self, vocab: int, width: int, depth: int, heads: int, context: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.policy: str | None = None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = remat.remat(block, policy=self.policy)(x) if self.policy else block(x)
        return self.head(self.ln(x))


def train_step(model: GPT, idx: torch.Tensor, targets: torch.Tensor) -> float:
    """One AdamW step; returns the loss."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    logits = model(idx)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    optimizer.step()
    return loss.item()


def main(small: bool = False) -> dict[str, int]:
    """Run one step per policy; return the bytes one block keeps under each.

    Args:
        small (bool, optional): use a tiny model (for the test suite). Default: False.

    Returns:
        dict[str, int]: bytes one block keeps for backward beyond its inputs, by policy.
    """
    vocab, width, depth, heads, context, batch = (
        (50, 16, 2, 2, 8, 2) if small else (1000, 256, 6, 8, 128, 8)
    )
    torch.manual_seed(0)
    base = GPT(vocab, width, depth, heads, context)
    idx = torch.randint(vocab, (batch, context))
    targets = torch.randint(vocab, (batch, context))

    reference = copy.deepcopy(base)
    ref_loss = train_step(reference, idx, targets)
    x = torch.randn(batch, context, width)
    kept: dict[str, int] = {}
    print(f"{'policy':<24}{'loss':>10}{'block keeps (bytes)':>22}")
    for policy in POLICIES:
        model = copy.deepcopy(base)
        model.policy = policy
        loss = train_step(model, idx, targets)
        assert abs(loss - ref_loss) < 1e-5, (policy, loss, ref_loss)
        for p, r in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p, r, rtol=1e-4, atol=1e-5)  # same update
        totals = residual_totals(saved_residuals(model.blocks[0], x, policy=policy))
        kept[policy] = totals["saved"] + totals["offloaded"]
        print(f"{policy:<24}{loss:>10.4f}{kept[policy]:>22,}")
    return kept


if __name__ == "__main__":
    main()
