"""Outputs that are views of another output (``return h, h.t()``), made again outside.

An `autograd.Function` output that is a view of another of its outputs is a
"multiple views" output: torch refuses an in-place write to it (``b.mul_(3)``
after the region), which works without remat and in the eager engine. So, under
eager autograd, the forward notes each output whose base is another output, and
after ``apply`` the user gets that view made again from the Function's base
output (``as_strided`` with the forward's geometry): a plain autograd view, whose
gradient flows into the base output's and whose in-place writes autograd handles
as without remat. The Function's own view output goes unused (no gradient).
Views of a base the region does not return (``return h.t(), h[0]``) stay as
they were: an in-place write to one of them raises torch's error.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..._compat import view_base

__all__ = ["OutputViews"]


class OutputViews:
    """Each output that is a view of another: (its position, the base's, its geometry)."""

    __slots__ = ("views",)

    def __init__(self, out: Sequence[torch.Tensor]) -> None:
        at = {id(t): j for j, t in enumerate(out)}
        self.views: list[tuple[int, int, tuple[int, ...], tuple[int, ...], int]] = []
        for i, t in enumerate(out):
            base = view_base(t)
            j = at.get(id(base)) if base is not None else None
            if j is not None and j != i:
                geometry = (tuple(t.shape), t.stride(), int(t.storage_offset()))
                self.views.append((i, j, *geometry))

    def remade(self, flat: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The Function's outputs with each view made again from its base output."""
        out = list(flat)
        for i, j, size, stride, offset in self.views:
            out[i] = out[j].as_strided(size, stride, offset)
        return out
