"""The op log of one call, and ``save_last`` in the torch.func engine.

NOTE [ The functional engine ] rule 6 (in ``__init__.py``).
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from ..._compat import physical, storage_address
from ..._policy.base import Decision, Policy
from ..._replay.records import OpLog
from ..._state import is_recomputing
from ..budget_plans import log_policy
from ..offloaded import OffloadedOutputs
from ..region import Region
from ..save_last import become_latest
from .levels import _forward_ad_active


class _SaveAllWhileLatest(Policy):
    """Save every output while the region is the latest save-last one.

    NOTE [ The functional engine ] rule 6.

    It remembers the base policy's verdicts for the demotion, and is the
    region's handle in the save-last chain (NOTE [ The save-last chain ] in
    ``_engines/save_last.py``): the op log holds it, so it lives as long as the
    log, and it holds the log weakly.
    """

    uses_ops = True

    def __init__(self, base: Policy) -> None:
        self.base = base
        self.uses_names = base.uses_names
        self.log: weakref.ref[OpLog] | None = None

    def decide_op(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
        return self.base.decide_op(op, args, kwargs) if self.base.needs_op_trace else None

    def decide(self, verdict: Hashable, name: str | None) -> Decision:
        return Decision.SAVE

    def demote(self) -> None:
        log = self.log() if self.log is not None else None
        if log is not None:
            _demote(log, self.base)

def _new_log(region: Region, tensors: Sequence[torch.Tensor]) -> OpLog:
    policy = region.policy
    if not policy.saves_latest_region:
        return OpLog(log_policy(region, tensors, "functional"), region.label, tensors)
    keeper = _SaveAllWhileLatest(policy)
    log = OpLog(keeper, region.label, tensors)
    keeper.log = weakref.ref(log)
    become_latest(keeper)
    return log

def _demote(log: OpLog, base: Policy) -> None:
    """Release what only being the last `save_last` region kept (the base policy decides)."""
    log.demote(base)


def offload_at_forward_end(
    log: OpLog, offloaded: OffloadedOutputs, region: Region, alive: Sequence[torch.Tensor]
) -> None:
    """End of a forward some level differentiates: move kept ``OFFLOAD`` outputs to the host
    store (NOTE [ The functional engine ] rule 8), except values sharing storage with
    ``alive`` (they free nothing)."""
    if (
        is_recomputing()  # needed again at once
        or _forward_ad_active()  # the backward recomputes in full (rule 3)
        or region.policy.saves_latest_region
    ):
        return
    addresses = {storage_address(physical(t)) for t in alive}
    for index, record in enumerate(log.records):
        for position, t in record.unwritten_outputs():
            if (
                record.decision_at(position) is not Decision.OFFLOAD
                or storage_address(t) in addresses
            ):
                continue
            offloaded.put(record, index, position, t)
