"""One residual: what backward holds, and how a list of them prints."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

import torch

from ..policies import Decision

__all__ = [
    "DecisionLike",
    "Item",
    "Residual",
    "decision_label",
    "human",
    "plural",
    "residual_row",
    "table",
]

DecisionLike = Decision | Literal["input"]


@dataclasses.dataclass(frozen=True)
class Residual:
    """One tensor that backward holds for a rematerialized region.

    Attributes:
        shape (tuple of int): the tensor's shape.
        dtype (torch.dtype): its dtype.
        nbytes (int): bytes of the storage it keeps alive (a view keeps its whole base).
        decision (Decision | "input"): ``Decision.SAVE`` or ``Decision.OFFLOAD`` for
            values the policy keeps; ``"input"`` for region inputs, parameters and
            tensors made outside the region, which are alive anyway.
        name (str or None): the ``checkpoint_name`` of the value, if any.
        op (OpOverload or None): the aten op that produced it (None for inputs).
        source (str): ``"file:line (function)"`` of the user code that produced it,
            or ``"argument x[0]"`` / ``"parameter fc1.weight"`` / ``"captured tensor"``.
        shared (bool): an earlier residual already holds the same storage; this
            one is not counted again in totals.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    decision: DecisionLike
    name: str | None
    op: Any
    source: str
    shared: bool = False

#: (tensor, decision, name, op, source) of one residual before merging.
Item = tuple[torch.Tensor, DecisionLike, str | None, Any, str]


def decision_label(decision: DecisionLike) -> str:
    if decision == "input":
        return "input"
    return "offloaded" if decision is Decision.OFFLOAD else "saved"


def residual_row(r: Residual) -> tuple[str, ...]:
    op = r.op.overloadpacket.__name__ if r.op is not None else "-"
    produced = f"{r.name!r} ({op})" if r.name is not None else op
    nbytes = f"{r.nbytes:,}" + (" (shared)" if r.shared else "")
    dtype = str(r.dtype).removeprefix("torch.")
    return (str(r.shape), dtype, nbytes, decision_label(r.decision), produced, r.source)


def table(rows: Sequence[Sequence[str]], numeric: set[int]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [
            c.rjust(w) if i in numeric and row is not rows[0] else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def human(nbytes: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{nbytes} B"


def plural(n: int) -> str:
    return f"{n} tensor" if n == 1 else f"{n} tensors"
