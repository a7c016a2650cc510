"""Names in lowered regions: `checkpoint_name` as an op AOTAutograd's trace sees.

NOTE [ Names under torch.compile ]
1. Traced inside a lowered region whose policy reads names (on this thread:
   ``lowering_names`` of the thread state, set by ``lowered.py`` around the
   outermost lowered region's trace), `checkpoint_name`
   calls the custom op ``remat::checkpoint_name(x, name)`` on each tensor, so
   the name reaches AOTAutograd's trace of the region, where the region's
   forward mode (``lowered.py``) sees it. Anywhere else it stays Python and
   returns ``x``: graphs without a name policy do not change.
2. A name decides for the value of the op that produced the tensor, as the
   eager engine's tag does: backward formulas read the producer's output
   (``tanh``'s backward reads ``tanh``'s output, not a copy of it). So deciding
   for the name op's own output would keep a second tensor and still recompute
   the producer. The forward mode remembers, for each op output of the region,
   the graph nodes the op added and the policy's verdict on it, and on the
   name op gives those nodes the name's decision (``MUST_SAVE`` or
   ``PREFER_RECOMPUTE``), the tag torch's own forward mode gives the nodes of
   the op it decides. The partitioner then saves or recomputes that very value.
3. No public route exists for this: a selective-checkpoint policy function is
   asked about one op when it runs, before any name that follows, and answers
   for that op's nodes only. The graph AOTAutograd is building is reached
   through ``get_proxy_mode()``, as ``torch.utils.checkpoint``'s forward mode
   (torch 2.13) reaches it to tag the op it decides.
4. The name op never runs its kernel inside a region: the region's modes
   answer it with its input. Its output is not used: `checkpoint_name`
   returns ``x`` itself, as in eager mode, so the named value is the
   producer's own tensor (no copy, no view; an in-place write to it is what it
   is without remat), and the op is registered with
   ``torch.fx.node.has_side_effect`` so that dead-code elimination keeps it in
   Dynamo's graph until AOTAutograd's trace has seen it. No node for it
   reaches AOTAutograd's graphs. Its fake kernel serves Dynamo's tracing; its
   real kernel, a copy (a custom op may not return an alias of its input),
   serves a call outside any region's modes, which remat never makes.
5. Random and in-place producers keep their ``PREFER_RECOMPUTE`` (NOTE
   [ Lowering under torch.compile ] rule 2), as the eager engine keeps them
   unnamed. A name on a region input or a closed-over tensor changes nothing:
   it is kept anyway, or not ours to keep.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
from torch.utils.checkpoint import CheckpointPolicy

from .._compat import activation_memory_budget, torch_tree_leaves
from .._policy.base import Decision, Policy
from .._state import local

__all__ = ["NAME_OP", "Producers", "traced_name"]

T = TypeVar("T")


@torch.library.custom_op("remat::checkpoint_name", mutates_args=())
def _checkpoint_name(x: torch.Tensor, name: str) -> torch.Tensor:
    return x.clone()  # run only outside a region's modes (NOTE rule 4)


@_checkpoint_name.register_fake
def _fake(x: torch.Tensor, name: str) -> torch.Tensor:
    return torch.empty_like(x)


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    return grad, None


_checkpoint_name.register_autograd(_backward)

#: The name op as the dispatch modes see it.
NAME_OP: Any = torch.ops.remat.checkpoint_name.default
torch.fx.node.has_side_effect(NAME_OP)  # its output is unused (NOTE rule 4)


def traced_name(x: T, name: str) -> T:
    """`checkpoint_name` while Dynamo traces: the name op where it matters (NOTE rule 1).

    The op's output is not used: ``x`` itself goes on, as in eager mode (NOTE
    rule 4), and the op is marked a side effect so the graph keeps it.
    """
    if local.lowering_names:  # this thread traces a lowered region that reads names
        leaves = [x] if isinstance(x, torch.Tensor) else torch_tree_leaves(x)
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                _checkpoint_name(leaf, name)
    return x


class Producers:
    """The graph nodes behind each op output of one region's trace (NOTE rule 2)."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        #: ``id(output)`` -> (output, its verdict or None when never kept, its
        #: op's nodes, whether the op has several outputs).
        self._nodes: dict[int, tuple[torch.Tensor, Any, list[torch.fx.Node], bool]] = {}

    @staticmethod
    def graph() -> torch.fx.Graph | None:
        """The graph AOTAutograd is building, if any (NOTE rule 3)."""
        from torch.fx.experimental.proxy_tensor import get_proxy_mode

        mode = get_proxy_mode()
        return None if mode is None else mode.tracer.graph

    def record(self, out: Any, verdict: Any, new: list[torch.fx.Node]) -> None:
        """Remember the nodes ``new`` one op added for its outputs ``out``.

        Every output of the op maps to all its nodes: a name that keeps one
        output keeps its siblings, as in the eager engine (the op's backward
        reads them together: attention's output and log-sum-exp).
        """
        leaves = out if isinstance(out, (tuple, list)) else (out,)
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                self._nodes[id(leaf)] = (leaf, verdict, new, len(leaves) > 1)

    def name(self, tensor: torch.Tensor, name: str) -> None:
        """Give the producer of ``tensor`` the decision its ``name`` asks for."""
        found = self._nodes.get(id(tensor))
        if found is None or found[0] is not tensor or found[1] is None:
            return  # an input, a closed-over tensor, or random / in-place (rule 5)
        decision = self.policy.decide(found[1], name)
        assert decision is not Decision.OFFLOAD, "this is a bug in remat, please report it"
        tag = CheckpointPolicy.PREFER_RECOMPUTE
        if decision is Decision.SAVE:
            budget = activation_memory_budget()
            # NOTE [ Lowering under torch.compile ] rule 7: MUST_SAVE crashes there.
            tag = CheckpointPolicy.PREFER_SAVE if found[3] and budget < 1 else tag.MUST_SAVE
        for node in found[2]:
            node.meta["recompute"] = tag
