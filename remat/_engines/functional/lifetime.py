"""How long a call holds what its forward made.

NOTE [ The functional engine ] rule 13 (in ``__init__.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..._compat import GRAD, backward_keeps_graph, physical


class Backwards:
    """Count the backwards of one call that may still read its forward's records.

    NOTE [ The functional engine ] rule 13. Each reverse level live at the call
    (``grad``, ``vjp``, ``jacrev``) and eager autograd (when an input requires
    grad below every level) has at most one node of the call. A backward that
    keeps its graph (a ``vjp_fn``, ``retain_graph=True``) may run again; one
    that does not frees that node's saved inputs, so it is the node's last.
    """

    def __init__(self, transforms: Sequence[tuple[Any, int]]) -> None:
        self.reverse_levels = sum(kind == GRAD for kind, _ in transforms)
        self.left: int | None = None

    def last(self, inputs: Sequence[torch.Tensor]) -> bool:
        """Before a backward with ``inputs`` (as saved): whether it is the last that can come."""
        if backward_keeps_graph():
            return False
        if self.left is None:
            eager = any(physical(t).requires_grad for t in inputs)
            self.left = self.reverse_levels + eager
        return self.left <= 1

    def ran(self, inputs: Sequence[torch.Tensor]) -> bool:
        """After one backward with ``inputs`` (as saved): whether none can come again."""
        if not self.last(inputs):
            if self.left is not None and not backward_keeps_graph():
                self.left -= 1
            return False
        self.left = 0
        return True
