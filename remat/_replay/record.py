"""One op of a region's forward: what it was, what the policy decided, what it keeps.

An `OpLog` (``_replay/records.py``) holds one `OpRecord` per aten op; the rules
are NOTE [ Record and replay ] there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterator, Mapping
from typing import Any

import torch

from .. import _compat
from .._policy.base import Decision, Policy

__all__ = ["OpRecord", "detached_alias"]

#: The kept version of an output written in place after it was kept: no tensor
#: has it, so the output is never replayed again (NOTE [ Record and replay ] rule 3).
_WRITTEN = -1


def detached_alias(t: torch.Tensor) -> torch.Tensor:
    """A detached alias that shares ``t``'s version counter, usable below autograd.

    Inside ``__torch_dispatch__`` a plain ``detach`` would get a fresh version
    counter; then neither our mutation check nor autograd's would see in-place
    writes to the alias.
    """
    with _compat.keeping_version_counters():
        return t.detach()


@dataclasses.dataclass(slots=True)
class OpRecord:
    """One op of a region's forward: what it was, what the policy decided, what it keeps.

    The kept outputs change only through the methods below, each one transition:
    `keep`, `name`, `drop`, `release`, `demote`, `plan_recompute`, `mark_written`,
    `mark_offloaded`, `restore`.
    """

    op: Any
    verdict: Hashable
    decision: Decision
    #: Position in the log.
    index: int = -1
    #: Kept outputs by position (detached aliases, or offload placeholders), None
    #: where not kept; None for all when nothing is kept.
    _kept: list[torch.Tensor | None] | None = None
    #: The version of each kept output when it was kept: a kept output whose
    #: version moved since was written in place, and is not replayed.
    _kept_versions: list[int] | None = None
    #: Decisions that `checkpoint_name` set for single outputs: position -> (name, decision).
    _named: dict[int, tuple[str, Decision]] | None = None
    #: Indices of the records that produced this op's tensor inputs (NOTE [ Record and
    #: replay ] rule 5).
    inputs: tuple[int, ...] = ()
    #: (shape, stride, dtype) of each output, to stand in for a dead op.
    metas: tuple[tuple[Any, ...], ...] = ()
    #: The op's Python-number arguments: the recompute must pass the same (a
    #: function reading Python state that changed since would compute else).
    scalars: tuple[Any, ...] = ()
    #: Runs in the recompute whatever reads it (NOTE [ Record and replay ] rule 5).
    always_live: bool = False
    #: Draws random numbers or writes to a tensor: never skipped by a recompute
    #: (NOTE [ Ops the recompute may skip ] in ``_replay/alignment.py``).
    effectful: bool = False
    #: Reads a tensor no op of this log made that is an input of the region or
    #: requires grad (a parameter, a closure): what keeps it from being a constant.
    reads_outside: bool = False
    #: Outputs kept only until the forward ends, in case `checkpoint_name` saves one.
    tentative: bool = False
    #: (shape, dtype) of the op's tensor arguments, for ops that may be replayed:
    #: a replayed op must get the forward's shapes (NOTE [ Record and replay ] rule 6).
    input_shapes: tuple[Any, ...] | None = None

    # -- reading --------------------------------------------------------------

    @property
    def kept(self) -> tuple[torch.Tensor | None, ...] | None:
        """The kept outputs by position (None where not kept), or None; read-only."""
        return None if self._kept is None else tuple(self._kept)

    @property
    def named(self) -> Mapping[int, tuple[str, Decision]] | None:
        """``{position: (name, decision)}`` for outputs `checkpoint_name` named; read-only."""
        return self._named

    def holds_outputs(self) -> bool:
        """Whether any output slot is kept (the list may hold only Nones after `drop`)."""
        return self._kept is not None

    def kept_at(self, position: int) -> torch.Tensor | None:
        return None if self._kept is None else self._kept[position]

    def kept_version(self, position: int) -> int:
        """The version the output at ``position`` had when kept (something is kept)."""
        assert self._kept_versions is not None, "this is a bug in remat, please report it"
        return self._kept_versions[position]

    def version_moved(self, position: int, t: torch.Tensor) -> bool:
        """Whether ``t`` (the output at ``position``) was written since it was kept."""
        versions = self._kept_versions
        return versions is not None and versions[position] != t._version

    def written_after_kept(self, position: int) -> bool:
        """Whether an in-place op of the forward wrote to this kept output (`mark_written`)."""
        return self._kept_versions is not None and self._kept_versions[position] == _WRITTEN

    def unwritten_outputs(self) -> Iterator[tuple[int, torch.Tensor]]:
        """(position, tensor) of each kept output nothing wrote to since it was kept."""
        kept, versions = self._kept, self._kept_versions
        if kept is None or versions is None:
            return
        for position, t in enumerate(kept):
            if t is not None and t._version == versions[position]:
                yield position, t

    def name_at(self, position: int) -> str | None:
        """The `checkpoint_name` given to the output at ``position``, if any."""
        named = self._named
        return named[position][0] if named is not None and position in named else None

    def decision_at(self, position: int) -> Decision:
        if self._named is not None and position in self._named:
            return self._named[position][1]
        return self.decision

    def fully_replayable(self) -> bool:
        return self.replay_state()[1]

    def replayable(self) -> list[torch.Tensor | None] | None:
        """The kept outputs if none was mutated since, else None."""
        return self.replay_state()[0]

    def replay_state(self) -> tuple[list[torch.Tensor | None] | None, bool]:
        """`replayable` and whether every output is kept, in one pass (a hot path)."""
        kept, versions = self._kept, self._kept_versions
        if kept is None or versions is None:
            return None, False
        full = True
        for tensor, version in zip(kept, versions, strict=True):
            if tensor is None:
                full = False
            elif tensor._version != version:
                return None, False
        return kept, full

    # -- transitions ----------------------------------------------------------

    def keep(self, position: int, tensor: torch.Tensor, count: int) -> None:
        """Keep ``tensor`` as the output at ``position`` (of ``count``), noting its version."""
        if self._kept is None:
            self._kept = [None] * count
            self._kept_versions = [0] * count
        assert self._kept_versions is not None, "this is a bug in remat, please report it"
        self._kept[position] = detached_alias(tensor)
        self._kept_versions[position] = tensor._version

    def name(self, position: int, name: str, decision: Decision) -> None:
        """Note that `checkpoint_name` named the output at ``position``."""
        if self._named is None:
            self._named = {}
        self._named[position] = (name, decision)
        if decision is Decision.RECOMPUTE:
            self.drop(position)
        else:
            self.tentative = False  # keep the siblings with it

    def drop(self, position: int) -> None:
        """Stop keeping the output at ``position`` (whoever needs it holds it)."""
        if self._kept is not None:
            self._kept[position] = None

    def release(self) -> None:
        """Keep nothing: the recompute runs this op again."""
        self._kept = None
        self._kept_versions = None

    def end_forward(self) -> None:
        """Release outputs kept only in case a name would save them."""
        if self.tentative:
            self.release()
            self.tentative = False

    def demote(self, base: Policy) -> None:
        """Keep only what ``base`` keeps (a `save_last` region that is no longer last)."""
        if self._kept is None:
            return
        verdict = self.verdict if base.needs_op_trace else base.decide_op(None, (), {})
        for position in range(len(self._kept)):
            if base.decide(verdict, self.name_at(position)) is Decision.RECOMPUTE:
                self._kept[position] = None
        if all(t is None for t in self._kept):
            self.release()

    def plan_recompute(self) -> None:
        """A memory budget's plan recomputes this op: decide so, and keep nothing."""
        self.verdict = self.decision = Decision.RECOMPUTE
        self.release()

    def mark_written(self, position: int) -> None:
        """An in-place op wrote to this kept output: never replay it (NOTE [ Record and
        replay ] rule 3)."""
        if self._kept_versions is not None:
            self._kept_versions[position] = _WRITTEN

    def mark_offloaded(self, position: int, placeholder: torch.Tensor) -> None:
        """The output at ``position`` was copied to the host: hold its placeholder."""
        self._hold(position, placeholder)

    def restore(self, position: int, value: torch.Tensor) -> None:
        """An offloaded output came back: hold the fetched ``value`` for the replay."""
        self._hold(position, value)

    def _hold(self, position: int, value: torch.Tensor) -> None:
        assert self._kept is not None and self._kept_versions is not None, (
            "this is a bug in remat, please report it"
        )
        self._kept[position] = value
        self._kept_versions[position] = value._version
