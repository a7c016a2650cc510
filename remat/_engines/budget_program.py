"""The planner's view of a region's recorded forward (NOTE [ The budget planner ] rule 1).

A memory budget's first call with a signature records its forward keeping every
output; `build_program` turns that op log, and the values autograd saved, into
the `Program` the planner solves (``_policy/planner.py``): per op its cost,
whether it can be kept, its producers and the storages its outputs own; per
saved value which storage backward reads and when.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .._compat import physical, storage_address
from .._policy import ops as _ops
from .._policy.op_cost import op_cost
from .._policy.planner import Needed, Program
from .._replay.records import OpLog, OpRecord

__all__ = ["Saved", "build_program"]

#: (op index, output position, holder clock) of a value autograd saved.
Saved = tuple[int, int, int]


def _keepable(rec: OpRecord) -> bool:
    # Every output kept and none written since (a written one has version -1).
    return not rec.always_live and rec.fully_replayable()


def build_program(
    log: OpLog, saved: Iterable[Saved] | None, baseline: Iterable[torch.Tensor]
) -> tuple[Program, tuple[int, ...]]:
    """The planner's view of a forward recorded keeping everything; and bytes per op."""
    outside = {storage_address(physical(t)) for t in baseline}
    owners: dict[int, int] = {}
    group_bytes: list[int] = []
    output_group: dict[tuple[int, int], int] = {}
    groups: list[tuple[int, ...]] = []
    for rec in log.records:
        mine: list[int] = []
        for position, t in enumerate(rec.kept or ()):
            if t is None:
                continue
            address = storage_address(t)
            if not address or address in outside:
                continue
            if address not in owners:
                if _ops.is_view(rec.op) and not rec.inputs:
                    outside.add(address)  # a view of a tensor the region did not make
                    continue
                owners[address] = len(group_bytes)
                group_bytes.append(t.untyped_storage().nbytes())
            output_group[rec.index, position] = owners[address]
            mine.append(owners[address])
        groups.append(tuple(sorted(set(mine))))
    n = len(log.records)
    if saved is None:
        needed = [
            Needed(rec.index, output_group.get((rec.index, p), -1), n)
            for rec in log.records
            for p in range(len(rec.metas))
        ]
    else:
        needed = [Needed(i, output_group.get((i, p), -1), clock) for i, p, clock in saved]
    program = Program(
        costs=tuple(
            op_cost(rec.op, rec.input_shapes, [(m[0], m[2]) for m in rec.metas])
            for rec in log.records
        ),
        keepable=tuple(_keepable(rec) for rec in log.records),
        always_live=tuple(rec.always_live for rec in log.records),
        producers=tuple(tuple(sorted(set(rec.inputs))) for rec in log.records),
        groups=tuple(groups),
        group_bytes=tuple(group_bytes),
        needed=tuple(needed),
    )
    op_bytes = tuple(sum(group_bytes[g] for g in gs) for gs in groups)
    return program, op_bytes
