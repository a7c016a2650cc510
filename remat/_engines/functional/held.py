"""The latest ``save-last`` region holds its forward graph (NOTE [ The functional engine ] rule 6).

The eager engine's latest ``save-last`` region holds what autograd saves, no
more; recording every op's output (what a replay needs) holds more: outputs
autograd never saves (a ``Linear``'s ``addmm`` before its ``add``), and its
backward runs ``fn`` again under replay. Here the forward runs ``fn`` under
``torch.func.vjp`` anyway (rule 7), so the region keeps that ``vjp``'s graph:
it holds exactly what autograd saves, and the backward differentiates it once
(``torch.autograd.grad`` from its roots, as the ``vjp_fn`` would), without
running ``fn`` again. When the region is
demoted (the next ``save-last`` region starts) it lets the graph go and its
backward recomputes as its base policy's would.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from ..._compat import GRAD, physical
from ..._policy.base import Policy
from ..._state import is_recomputing, local
from .formulas import differ_by_grad_mode
from .levels import _forward_ad_active


class HeldCall(Protocol):
    """One call as this rule sees it (`_Call` in ``call.py``)."""

    transforms: list[tuple[Any, int]]
    inputs: tuple[torch.Tensor, ...]
    differentiated: list[int]
    batched: bool


class HeldGraph:
    """The forward graph of the latest ``save-last`` region, until demoted.

    It holds the graph's roots as gradient edges (the nodes, not the output
    tensors: an output nothing else holds goes, as in autograd) and the
    ``vjp``'s differentiated inputs. It is the region's handle in the save-last
    chain (NOTE [ The save-last chain ] in ``_engines/save_last.py``); the call
    holds it, the chain holds it weakly.
    """

    def __init__(self) -> None:
        #: The differentiated inputs as the forward's ``vjp`` wrapped them; empty once
        #: demoted or consumed.
        self.inputs: tuple[torch.Tensor, ...] = ()
        #: (output position, its gradient edge) of each root: ``fn``'s floating outputs
        #: that require grad, then the tensors ``fn`` let out (NOTE [ Escaped tensors ]).
        self.roots: list[tuple[int, GradientEdge]] = []
        #: Whether each output of ``fn`` is floating (``vjp``'s outputs; the rest is aux).
        self.kinds: list[bool] = []
        self.floats = 0

    def hold(self, inputs: Sequence[torch.Tensor], floats: Sequence[torch.Tensor]) -> None:
        """In the forward's ``vjp``: its differentiated inputs and floating outputs."""
        self.inputs, self.floats = tuple(inputs), len(floats)
        self.roots = [(i, get_gradient_edge(t)) for i, t in enumerate(floats) if t.requires_grad]

    def let_out(self, escaped: Iterable[torch.Tensor | None]) -> None:
        """After the forward: the tensors ``fn`` let out, extra outputs after its own."""
        start = len(self.kinds)
        self.roots += [
            (start + i, get_gradient_edge(t))
            for i, t in enumerate(escaped)
            if t is not None and t.requires_grad
        ]

    def before_swaps(self, found: Sequence[Any]) -> None:
        """Before the escaped tensors are swapped for the Function's outputs (NOTE [ Escaped
        tensors ] rule 4): a graph that saved one of them itself (``exp``'s output) holds
        its impl, and torch refuses to swap a tensor held elsewhere. Let the graph go then:
        the region recomputes in its backward, as its base policy's would."""
        if any(e.target is not None and e.target._use_count() > 1 for e in found):
            self.demote()

    def demote(self) -> None:
        """The next ``save-last`` region started: keep nothing but what the base policy keeps
        (here nothing, see `may_hold`), and recompute in the backward."""
        self.inputs, self.roots = (), []

    @property
    def held(self) -> bool:
        return bool(self.inputs)

    def backward(
        self,
        grads: Sequence[torch.Tensor | None],
        differentiated: Sequence[int],
        wanted: Sequence[int],
        retain: bool,
        formulas: bool = False,
    ) -> tuple[torch.Tensor | None, ...] | None:
        """The gradients of the ``wanted`` inputs from the held graph (None where nothing
        flows); None if it cannot give them (demoted, an input it does not differentiate).
        ``formulas``: the grad mode the caller's backward runs its formulas under (silu's
        differs by it); the graph that makes is let go at once."""
        if not self.held or any(i not in differentiated for i in wanted):
            return None
        # ``grads`` follow the Function's outputs: ``fn``'s, then the escaped ones.
        float_positions = [i for i, k in enumerate(self.kinds) if k]
        positions = [*float_positions, *range(len(self.kinds), len(grads))]
        pairs = [(edge, grads[positions[i]]) for i, edge in self.roots]
        pairs = [(edge, g) for edge, g in pairs if g is not None]
        inputs = self.inputs
        if not retain:
            self.demote()  # its graph goes as its backward consumes it
        if not pairs:
            return (None,) * len(wanted)
        # (Only where the formulas differ by it, ``formulas.py``: else no graph, less memory.)
        create = formulas and differ_by_grad_mode(edge.node for edge, _ in pairs)
        found = torch.autograd.grad(
            [edge for edge, _ in pairs],
            inputs,
            [g for _, g in pairs],
            retain_graph=retain,
            create_graph=create,
            allow_unused=True,
        )
        if create:
            found = tuple(None if t is None else t.detach() for t in found)
        order = list(differentiated)
        return tuple(found[order.index(i)] for i in wanted)


def may_hold(policy: Policy, call: HeldCall) -> bool:
    """Whether ``call``'s forward may hold its graph instead of recording (module docstring).

    Only where the held graph is what the backward differentiates: one reverse
    level and nothing else (no ``vmap``, whose rule runs a twin, nor that twin; no forward mode,
    which recomputes; no eager autograd below every level and no second reverse
    level, which differentiate the backward itself, NOTE [ The functional engine ]
    rule 4), not inside another region's run or recompute, and for a base policy
    that keeps nothing (``save-last`` itself: ``save-last+P`` records as before).
    """
    if not policy.saves_latest_region or policy.needs_op_trace or not call.differentiated:
        return False
    if call.batched or [kind for kind, _ in call.transforms] != [GRAD]:
        return False
    if _forward_ad_active() or is_recomputing() or local.substitutions:
        return False
    return not any(physical(t).requires_grad for t in call.inputs)
