"""The recompute half of a `StateGuard`: the module state the forward saw, given back.

NOTE [ State the forward changes ] in ``_capture/module_state.py`` says what is
restored; `StateGuard` (there) records it during the forward, and this base
class puts it in place around the recompute and takes it out after.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .._compat import no_dispatch_modes, storage_identity
from .._errors import SavedInputMutatedError
from .._state import engine_maps_slots, internal
from .cells import is_bound
from .slots import Pin, Watched, linked_copy, replaced, unrestorable

__all__ = ["RestoringGuard"]


class RestoringGuard:
    """What a `StateGuard` does around a recompute (its rules 1 to 3)."""

    label: str
    #: The slots pinned before the forward (None: no forward ran yet).
    pins: list[Pin] | None
    #: Stateful modules' buffers as the forward found them: (table, name, copy).
    seen: list[tuple[dict[str, Any], str, torch.Tensor]] | None
    #: Slots the forward wrote in place (NOTE rule 1).
    written: list[Watched]
    #: Closure cells of plain values, with their values when the forward started.
    cell_start: list[tuple[types.CellType, Any]]
    #: (leaf, whether its ``.grad`` was None when the forward started).
    grads_written: list[tuple[torch.Tensor, bool]]
    #: While recomputing: (id(table), name) -> the start value of every slot the
    #: recompute gets a copy in; and the copy each holds now.
    _swaps: dict[tuple[int, str], torch.Tensor] | None
    _installed: dict[tuple[int, str], torch.Tensor]
    _reswapped: list[tuple[dict[str, Any], str, torch.Tensor, torch.Tensor]]
    #: Each module the forward ran (or was given), with its ``training`` flag then.
    modes: list[tuple[nn.Module, bool]]

    def _refuse_unrestorable(self) -> None:
        for watched in self.written:
            if watched.snapshot is None:
                raise unrestorable(watched, self.label)

    @contextlib.contextmanager
    def _cells_restored(self) -> Iterator[None]:
        """Run the recompute with the cells as the forward found them (rule 2)."""
        before = [(cell, cell.cell_contents) for cell, _ in self.cell_start if is_bound(cell)]
        for cell, start in self.cell_start:
            cell.cell_contents = start
        try:
            yield
        finally:
            for cell, value in before:
                cell.cell_contents = value

    def _switch_modes(self) -> list[tuple[nn.Module, bool, bool]]:
        """Put each module in the mode its forward ran in (rule 4); returns what
        `_switch_back` undoes after the recompute."""
        switched = [(m, then, m.training) for m, then in self.modes if m.training != then]
        for module, then, _ in switched:
            module.training = then  # this module only: each submodule has its own entry
        return switched

    @staticmethod
    def _switch_back(switched: list[tuple[nn.Module, bool, bool]]) -> None:
        for module, _, now in switched:
            module.training = now

    @contextlib.contextmanager
    def _grads_kept(self) -> Iterator[None]:
        """Undo what the recompute's inner backward accumulates into ``.grad`` (rule 3)."""
        if not self.grads_written:
            yield
            return
        kept = []
        with no_dispatch_modes(), internal(), torch.no_grad():
            for t, started_empty in self.grads_written:
                grad = t.grad
                kept.append((t, grad, None if grad is None else grad.clone()))
                if started_empty:  # accumulate as the forward did: into nothing
                    t.grad = None
        try:
            yield
        finally:
            with no_dispatch_modes(), internal(), torch.no_grad():
                for t, grad, value in kept:
                    if grad is not None and value is not None:
                        grad.copy_(value)  # autograd accumulates in place when it can
                    t.grad = grad

    def _pin_back(self) -> list[tuple[Pin, torch.Tensor]]:
        """Put the forward's tensors back in the slots that hold others now, and check
        each for in-place changes (rule 1); returns what `_unpin` puts back after."""
        assert self.pins is not None, "this is a bug in remat, please report it"
        moved: list[tuple[Pin, torch.Tensor]] = []
        if engine_maps_slots():  # the torch.func engine maps the slots itself
            return moved
        try:
            for pin in self.pins:
                current = pin.table.get(pin.name)
                t = pin.tensor
                if (
                    current is not t
                    and isinstance(current, torch.Tensor)
                    and replaced(current, pin)
                ):
                    moved.append((pin, current))
                    pin.table[pin.name] = t
                # Inline, the usual case of `_check`: one call fewer per pin.
                if t._version != pin.version or (
                    pin.storage is not None and storage_identity(t) != pin.storage
                ):
                    self._check(pin)
        except BaseException:
            self._unpin(moved)
            raise
        return moved

    @staticmethod
    def _unpin(moved: list[tuple[Pin, torch.Tensor]]) -> None:
        for pin, current in reversed(moved):
            pin.table[pin.name] = current

    def _check(self, pin: Pin) -> None:
        t = pin.tensor
        same_storage = pin.storage is None or storage_identity(t) == pin.storage
        if t._version == pin.version and same_storage:
            return
        if pin.parameter:
            kind = "parameter"
            cause = "an optimizer step or a '.data' assignment before backward?"
            fix = "Call backward before modifying parameters."
        else:
            kind = "buffer"
            cause = "does the module update it in forward?"
            fix = (
                "If the module updates this buffer in forward (running statistics, a power "
                "iteration, a counter), declare it stateful: "
                "remat.register_stateful(type(module)) or module.remat_stateful = True. "
                "If your code modified it between forward and backward, modify it after "
                "backward instead."
            )
        raise SavedInputMutatedError(
            f"remat: {kind} '{pin.name}' of {pin.where} (shape {tuple(t.shape)}) was "
            f"modified in place after the forward pass of {self.label} read it (version "
            f"{t._version}, expected {pin.version}; {cause}), so its recompute would "
            f"use the new values. {fix}"
        )

    def _swapped(self) -> Iterator[None]:
        copies = [(table, name, value) for table, name, value in self.seen or []]
        copies.extend((w.table, w.name, w.snapshot) for w in self.written if w.snapshot is not None)
        if not copies:
            yield
            return
        originals = [(table, name, table[name]) for table, name, _ in copies]
        self._swaps = {(id(table), name): value for table, name, value in copies}
        try:
            for table, name, _ in copies:
                self._install(table, name)
            with self.watching_modules():
                yield
        finally:
            self._swaps = None
            for table, name, replaced, copy in reversed(self._reswapped):
                if table.get(name) is copy:  # else whoever replaced it put theirs back
                    table[name] = replaced
            self._reswapped, self._installed = [], {}
            for table, name, buffer in reversed(originals):
                table[name] = buffer

    def restored_ids(self) -> set[int]:
        """Ids of the tensors now in the slots whose start value the recompute gets a copy
        of (a stateful module's buffers; what the forward wrote in place, rule 1): a later
        forward writing them again is state changing, not a mutation the recompute sees."""
        ids = {id(table.get(name)) for table, name, _ in self.seen or ()}
        ids.update(id(w.tensor) for w in self.written if w.snapshot is not None)
        return ids

    def gives(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a copy this guard put in a slot for the running recompute."""
        return any(copy is t for copy in self._installed.values())

    def _install(self, table: dict[str, Any], name: str) -> torch.Tensor:
        """Put a fresh copy of the slot's start value in it, for the recompute to write to."""
        assert self._swaps is not None, "this is a bug in remat, please report it"
        value = self._swaps[id(table), name]
        with no_dispatch_modes(), torch.no_grad():
            # What is differentiated keeps its gradient (a parameter; a buffer
            # passed to functional_call).
            copy = linked_copy(table[name], value)
        table[name] = self._installed[id(table), name] = copy
        return copy

    def watching_modules(self) -> contextlib.AbstractContextManager[None]:
        """Watch the modules the block runs (`StateGuard` does, when it watches)."""
        return contextlib.nullcontext()

    def _reswap(self, module: nn.Module) -> None:
        """Recompute: slots given other tensors since it started get copies again."""
        assert self._swaps is not None, "this is a bug in remat, please report it"
        for table in (module._buffers, module._parameters):
            for name, current in list(table.items()):
                key = (id(table), name)
                if key in self._swaps and current is not self._installed.get(key):
                    assert isinstance(current, torch.Tensor), "this is a bug in remat"
                    self._reswapped.append((table, name, current, self._install(table, name)))
