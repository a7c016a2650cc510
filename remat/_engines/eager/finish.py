"""The finish phase: what a frame keeps once its forward ends (NOTE [ The eager engine ]
rules 5 and 6 in ``__init__.py``)."""

from __future__ import annotations

from typing import Any

import torch

from ..._offload.store import Offloaded
from ..._policy.base import Decision
from ..._policy.name_check import check_names
from ..._pytree import tensor_leaves
from ..._replay.tags import tag_of
from ..budget_plans import settle
from .state import (
    FrameState,
    Holder,
    Phase,
)


class FinishingFrame(FrameState):
    """The end of a frame's forward, and its demotion from the save-last chain."""

    def finish_forward(self, out: Any = None) -> None:
        """Fill holders named after they were saved; release kept ops nothing reads."""
        if self.log is None:
            return
        self.log.note_outputs(out)  # never forward-only (NOTE [ Ops the recompute may skip ])
        self.settle_budget()
        self.log.end_forward()
        check_names(self.log.policy, self.region.label, self.log.names_seen)
        alive = self.alive()
        # Only outputs something will read are worth a copy to the host.
        live = None if self.holds_all_as_latest else self.liveness(alive)
        self.offload_kept(out, live)
        # Liveness depends on which holders are empty: if none changes below,
        # the release reuses it (computing it costs a walk of the whole log).
        changed = False
        for holder in alive:
            if holder.tensor is not None and self.named_to_recompute(holder):
                # Saved by its own op (``exp`` saves its result) before
                # `checkpoint_name` gave it a name the policy recomputes: the
                # name overrides the op's decision here too.
                if self.holds_all_as_latest:
                    holder.demotable = True
                else:
                    holder.tensor, changed = None, True
            elif holder.tensor is None and holder.source is not None:
                record, position = holder.source
                entry = self.offloaded.entry(record, position)
                if entry is not None:
                    holder.tensor, changed = entry, True
                elif (kept := record.kept_at(position)) is not None:
                    holder.tensor, changed = kept, True
                    holder.version = record.kept_version(position)
        if not self.holds_all_as_latest:
            self.release_unread(None if changed else live)
            self.offloaded.prune()

    def settle_budget(self) -> None:
        """A memory budget's first call plans here; drop what the plan does not keep.

        NOTE [ Budget plans ] in ``_engines/budget_plans.py``: the plan reads which op
        outputs autograd saved, and when (the holders' clocks).
        """
        assert self.log is not None, "this is a bug in remat, please report it"
        alive = self.alive()
        saved = [
            (h.source[0].index, h.source[1], h.clock) for h in alive if h.owned and h.source
        ]
        outside = [h.tensor for h in alive if not h.owned and isinstance(h.tensor, torch.Tensor)]
        dropped = settle(self.log, saved, self.inputs, outside)
        if dropped:
            for holder in alive:
                if holder.owned and holder.source and holder.source[0].index in dropped:
                    holder.tensor = None

    def named_to_recompute(self, holder: Holder) -> bool:
        """Whether a name given after ``holder`` was packed makes the policy recompute it."""
        if holder.source is None or not holder.owned or holder.demotable:
            return False
        record, position = holder.source
        named = record.named.get(position) if record.named is not None else None
        return named is not None and named[1] is Decision.RECOMPUTE

    def offload_saved(self, t: torch.Tensor, holder: Holder) -> Offloaded | torch.Tensor:
        """Pack: put ``t`` (once per op output) and drop the record's device copy."""
        assert holder.source is not None, "this is a bug in remat, please report it"
        record, position = holder.source
        entry = self.offloaded.put(record, record.index, position, t)
        return entry if entry is not None else t.detach()

    def offload_kept(self, out: Any, live: list[bool] | None) -> None:
        """End of forward: put kept ``OFFLOAD`` outputs that no holder took yet.

        With ``live`` (the recompute's liveness), outputs of dead ops are left to
        be released instead.
        """
        assert self.log is not None, "this is a bug in remat, please report it"
        outputs = {tag_of(t) for t in tensor_leaves(out)}
        for index, record in enumerate(self.log.records):
            if live is not None and not live[index]:
                continue
            for position, t in record.unwritten_outputs():
                if (
                    (record, position) not in self.offloaded
                    and record.decision_at(position) is Decision.OFFLOAD
                    and (self.log.serial, index, position) not in outputs
                    and self.can_offload(t)
                ):
                    self.offloaded.put(record, index, position, t)

    def demote(self) -> None:
        """Stop being the last `save_last` region: drop what only that status kept."""
        self.holds_all_as_latest = False
        for holder in self.alive():
            if holder.demotable:
                holder.tensor = None
                holder.demotable = False
        if self.log is not None and self.phase is Phase.DONE:
            # Demoted by a region run inside this forward (`finish_forward` releases
            # then) or inside its recompute (which replays from the records): later.
            self.release_unread()
            self.offloaded.prune()
