"""The recorded forward, run as the backward's ``vjp`` will run it.

NOTE [ The functional engine ] rule 7 (in ``__init__.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from ..._capture.bindings import Bindings
from ..._compat import current_level, wrap_for_grad
from ..escapes import EscapeWatch
from .guard import _HiddenInputGuard
from .held import HeldGraph
from .levels import _differentiable, _writable_inside


class DifferentiatedCall(Protocol):
    """One call as this run sees it (`_Call` in ``call.py``)."""

    differentiated: list[int]
    guard: _HiddenInputGuard | None
    escapes: EscapeWatch

    @property
    def bindings(self) -> Bindings: ...

    @property
    def transforms(self) -> Sequence[Any]: ...

    def run(
        self, tensors: Sequence[torch.Tensor], writable: dict[int, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, ...]: ...


def run_as_differentiated(
    call: DifferentiatedCall, tensors: Sequence[torch.Tensor], held: HeldGraph | None = None
) -> tuple[torch.Tensor, ...]:
    """Run ``fn`` under ``torch.func.vjp`` with respect to the inputs some level differentiates.

    Composite ops decompose by whether their inputs require grad, so the
    forward and the backward's ``vjp`` see the same aten ops only when both
    differentiate the same inputs (rule 7). ``held`` keeps the graphs roots
    (the latest ``save-last`` region's graph, ``held.py``).
    """
    if not call.differentiated:
        return call.run(tensors)
    kinds: list[bool] = []

    def primal(
        *moved: torch.Tensor,
    ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        if call.guard is not None:
            call.guard.know(moved)
        call.escapes.taint(moved)
        full = list(tensors)
        _writable_inside(full, call.differentiated)  # an op may write them in place
        if call.guard is not None:
            call.guard.know(full)
        for i, t in zip(call.differentiated, moved, strict=True):
            full[i] = t
        # Under an outer torch.func transform torch refuses the write without remat too.
        writable = {} if call.transforms else _writable_buffers(call.bindings)
        if call.guard is not None and writable:
            call.guard.know(list(writable.values()))
        out = call.run(full, writable)
        kinds[:] = [_differentiable(t) for t in out]
        # vjp takes floating outputs only; integer ones travel as aux.
        floats = tuple(t for t in out if _differentiable(t))
        if held is not None:
            held.hold(moved, floats)
        return floats, tuple(t for t in out if not _differentiable(t))

    with torch.enable_grad():
        result: Any = torch.func.vjp(
            primal, *(tensors[i] for i in call.differentiated), has_aux=True
        )
    floats, others = result[0], result[2]
    if held is not None:
        held.kinds = list(kinds)
    it_f, it_o = iter(floats), iter(others)
    return tuple(next(it_f) if k else next(it_o) for k in kinds)


def _writable_buffers(bindings: Bindings) -> dict[int, torch.Tensor]:
    """The untracked tensors ``fn`` reaches (`Bindings.untracked`: running statistics,
    a statistic in a global dict), wrapped at the ``vjp``'s level, by id: batch norm
    in training mode, or a statistic's ``add_`` under ``torch.no_grad()``, writes
    them in place there, where torch refuses a tensor of an outer level as
    "captured". The wrapper writes through to the tensor, as when ``torch.func.grad``
    gets buffers as arguments. Only under eager autograd: under an outer transform
    no remat is refused too."""
    level = current_level()
    if level is None:
        return {}
    return {id(t): wrap_for_grad(t, level) for t in bindings.untracked()}
