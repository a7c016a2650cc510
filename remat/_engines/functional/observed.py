"""An output whose gradient is read, that another output of the region is computed from.

NOTE [ What the backward gives back ] rule 2 (in ``function.py``): the region's
outputs are siblings, outputs of one `autograd.Function` node, so the gradient
autograd hands an output ``h`` is only what reaches it directly, not the part
through another output ``o = h @ W`` (which goes from ``o`` into the node). The
inputs' gradients are right (the node's backward differentiates ``fn`` as a
whole), but a hook or ``retain_grad()`` on ``h`` would see a wrong gradient. So
the Function notes its outputs (weakly); its backward, when one that another
output got a gradient through has a hook or retains its gradient, looks at the
recompute's graph and raises where ``o``'s graph goes through ``h``.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd.graph import get_gradient_edge

from ..._compat import current_level, gradient_observed
from ..._errors import RematError
from ..._state import is_recomputing, local

__all__ = ["Observed", "note_outputs", "observed_outputs"]


def note_outputs(outputs: Sequence[Any]) -> list[weakref.ref[torch.Tensor]]:
    """Weak references to the region's outputs as the user has them (its own, then the
    ones it let out, after their swap), where a hook on them can be eager autograd's:
    two outputs or more, no torch.func level live, not inside another region's run
    (whose swap of an output it lets out `torch.utils.swap_tensors` would refuse: a
    tensor with a weak reference)."""
    if len(outputs) < 2 or current_level() is not None or local.substitutions:
        return []
    if is_recomputing() or not all(isinstance(t, torch.Tensor) for t in outputs):
        return []
    return [weakref.ref(t) for t in outputs]


def observed_outputs(
    refs: Sequence[weakref.ref[torch.Tensor]], grads: Sequence[torch.Tensor | None]
) -> list[int]:
    """The outputs a hook or ``retain_grad()`` reads, when another output got a gradient."""
    if sum(g is not None for g in grads) == 0 or len(refs) < 2:
        return []
    seen = []
    for i, ref in enumerate(refs):
        t = ref()
        if t is not None and t.requires_grad and gradient_observed(t):
            seen.append(i)
    return seen


class Observed:
    """The check, for one backward's recompute: ``observed`` by position, ``graded``
    the positions whose gradients came in."""

    def __init__(self, label: str, observed: list[int], graded: list[int], own: int) -> None:
        self.label = label
        self.observed = observed
        self.graded = graded
        #: How many outputs are ``fn``'s return value's; the rest it let out.
        self.own = own

    def check(self, out: Sequence[torch.Tensor]) -> None:
        """Raise if a graded output's recomputed graph goes through an observed one."""
        for j in self.observed:
            h = out[j]
            if not h.requires_grad:
                continue
            target = get_gradient_edge(h)
            for i in self.graded:
                if i != j and out[i].requires_grad and _reaches(out[i], target):
                    raise self.error(i, j, tuple(h.shape))

    def _name(self, i: int) -> str:
        if i < self.own:
            return f"output #{i}"
        return f"the tensor #{i - self.own} it lets out (kept by a hook, a list, an attribute)"

    def error(self, i: int, j: int, shape: tuple[int, ...]) -> RematError:
        read, reader = self._name(j), self._name(i)
        return RematError(
            f"remat: {self.label} returns {read} (shape {shape}) and {reader}, which is "
            f"computed from it, and a hook or retain_grad() reads the gradient of {read}. "
            "Under the torch.func engine the region's outputs are outputs of one autograd "
            f"node, so that gradient would miss the part that flows through {reader} (the "
            "inputs' and parameters' gradients are right). Use engine='eager' for this "
            f"region, or split it into two regions, the first returning {read} and the "
            f"second computing {reader} from it."
        )


def _reaches(root: torch.Tensor, target: torch.autograd.graph.GradientEdge) -> bool:
    """Whether ``root``'s graph has ``target`` (a node and its output number) as an edge."""
    start = get_gradient_edge(root)
    if start.node is target.node and start.output_nr == target.output_nr:
        return True
    pending, visited = [start.node], {id(start.node)}
    while pending:
        node = pending.pop()
        for nxt, nr in node.next_functions:
            if nxt is None:
                continue
            if nxt is target.node and nr == target.output_nr:
                return True
            if id(nxt) not in visited:
                visited.add(id(nxt))
                pending.append(nxt)
    return False
