"""Outputs no input's gradient flows to: ``return y, h.detach()`` (NOTE [ What the backward
gives back ] rule 3, in ``function.py``).

Without remat such an output has ``requires_grad=False``; an `autograd.Function`
output requires grad unless marked non-differentiable. A forward that runs
under ``torch.func.vjp`` (the recorded ones and a held ``save-last`` graph: NOTE [
The functional engine ] rule 7) sees which outputs do not require grad there.
A plain forward (``nothing-saveable``) has no graph: there the maker of each
output (the determinism check's trace, NOTE [ Recompute signatures ] in
``_replay/checks.py``) tells a ``detach`` apart; other constants (made under
``no_grad`` inside the region) still come back requiring grad, with a zero
gradient: the gradients stay right. (Why: the plain forward runs inside the
Function's ``forward``, under ``no_grad`` already, so a ``no_grad`` block in
``fn`` changes nothing there; a `TorchFunctionMode` sees its
``_set_grad_enabled(False)`` on entering and the same call on leaving, so it
cannot tell the block's inside from its outside. Telling them apart needs the
plain forward run with grad mode on and every call under ``no_grad``, noting
the mode each call saw.) Only under eager autograd (no torch.func level
at the call), where ``requires_grad`` is what the user sees: under a vmap level
the twin's outputs and the per-example runs (NOTE [ The functional engine ] rule
10) do not say it the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..._replay.checks import OpTrace
from .levels import _differentiable

__all__ = ["constant_outputs"]

_DETACH = (torch.Tensor.detach, torch.detach)


def constant_outputs(
    made: Sequence[torch.Tensor],
    trace: OpTrace,
    tensors: Sequence[torch.Tensor],
    differentiated: Sequence[int],
) -> set[int]:
    """Positions in ``made`` (the forward's tensor outputs) that are constants.

    ``tensors``: the run's inputs; ``differentiated``: those some level differentiates.
    """
    if not differentiated:
        return set()
    graph = torch.is_grad_enabled() and all(tensors[i].requires_grad for i in differentiated)
    if graph:  # under the forward's vjp: its graph says
        return {i for i, t in enumerate(made) if _differentiable(t) and not t.requires_grad}
    makers = trace.output_calls or []
    return {
        i
        for i, index in enumerate(makers)
        if index is not None and trace.calls[index][0] in _DETACH
    }
