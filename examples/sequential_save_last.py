"""The ``checkpoint_sequential`` question, answered with ``save-last``.

``torch.utils.checkpoint.checkpoint_sequential`` never checkpoints its last
segment: backward starts there, so recomputing it at once would cost a full
extra forward and lower no peak. People still ask how to checkpoint *every*
segment (so each one is a uniform, rematerialized unit) and keep the last
one's activations. Under the ``save-last`` policy every segment is
rematerialized except the most recently executed one, which keeps everything
until backward consumes it: the memory of ``nothing-saveable`` and (N-1)/N of
its recompute.

Run with ``python examples/sequential_save_last.py``.
"""

from __future__ import annotations

import torch
from torch import nn

import remat


class Counted(nn.Module):
    """A layer that counts how often it runs in a recompute."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.recomputed = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if remat.is_recomputing():
            self.recomputed += 1
        return torch.tanh(self.linear(x))


def main(small: bool = False) -> list[int]:
    """Checkpoint every segment with ``save-last``; return how often each layer recomputed.

    Args:
        small (bool, optional): use tiny sizes (for the test suite). Default: False.

    Returns:
        list[int]: recompute count per layer (zero for the last segment's layers).
    """
    width, depth, n_segments = (8, 8, 4) if small else (1024, 16, 4)
    torch.manual_seed(0)
    layers = [Counted(width) for _ in range(depth)]
    x = torch.randn(32, width, requires_grad=True)

    # Reference: no checkpointing.
    y = x
    for layer in layers:
        y = layer(y)
    expected = torch.autograd.grad(y.square().sum(), [x, *layers[0].parameters()])

    # Every segment checkpointed, the last one included; the last keeps its activations.
    y = remat.sequential(layers, x, segments=n_segments, policy="save-last")
    grads = torch.autograd.grad(y.square().sum(), [x, *layers[0].parameters()])
    for g, e in zip(grads, expected, strict=True):
        torch.testing.assert_close(g, e)

    counts = [layer.recomputed for layer in layers]
    per = depth // n_segments
    assert all(c == 1 for c in counts[:-per]) and all(c == 0 for c in counts[-per:]), counts
    print(f"recomputes per layer: {counts} (the last segment kept its activations)")
    return counts


if __name__ == "__main__":
    main()
