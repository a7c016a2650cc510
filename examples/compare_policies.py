"""Compare policies on a whole model, per block, and plot what each costs.

``remat.compare(model, x, where=Block)`` applies each policy to every ``Block``
of the model (as ``remat.apply`` does), measures one training step under it
(peak and held bytes, exact on CPU; ops recomputed; time as the median ratio
to no remat, with its spread over the repeats) and, with ``plot=True``, draws
the rows. Then ``saved_residuals`` on the applied model (no policy: the model as
it is) lists what its blocks keep. The figure in the docs' inspection page is
this script's output.

Run with ``python examples/compare_policies.py`` (needs matplotlib:
``pip install remat[plot]``); it writes ``docs/images/compare.png``.
"""

from __future__ import annotations

import pathlib

import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat import residual_totals, saved_residuals

POLICIES = ("nothing-saveable", "dots-saveable", "save:hidden", "everything-saveable")
FIGURE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "images" / "compare.png"


class Block(nn.Module):
    """A residual MLP block whose hidden activation is named for ``save:hidden``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = remat.checkpoint_name(F.gelu(self.fc1(self.norm(x))), "hidden")
        return x + self.fc2(hidden)


def main(small: bool = False, figure: pathlib.Path | None = FIGURE) -> dict[str, int]:
    """Compare ``POLICIES`` per block; save the plot to ``figure``; return peaks by policy.

    Args:
        small (bool, optional): a tiny model and one timing round (for the test
            suite). Default: False.
        figure (Path, optional): where to save the plot; None: no plot. Default:
            ``docs/images/compare.png``.

    Returns:
        dict[str, int]: the peak bytes of one training step, by policy ("none" included).
    """
    width, depth, batch, repeats = (16, 3, 32, 1) if small else (128, 6, 256, 7)
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(width) for _ in range(depth)])
    x = torch.randn(batch, width)
    if figure is None:
        rows = remat.compare(model, x, policies=POLICIES, where=Block, repeats=repeats)
    else:
        rows, drawn = remat.compare(
            model, x, policies=POLICIES, where=Block, repeats=repeats, plot=True
        )
        figure.parent.mkdir(parents=True, exist_ok=True)
        drawn.savefig(figure, dpi=100)
    remat.apply(model, policy="save:hidden", where=Block)
    totals = residual_totals(saved_residuals(model, x))  # what the applied model keeps
    print(f"save:hidden per block keeps {totals['saved']:,} bytes for backward")
    return {r.policy: r.peak_bytes for r in rows}


if __name__ == "__main__":
    main()
