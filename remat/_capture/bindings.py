"""What the closure walk found: each slot that holds tensors ``fn`` reads, and its snapshot.

NOTE [ Closed-over tensors ] rules 2, 4 and 6 (in ``_capture/closure.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence, Set
from typing import Any

import optree
import torch

from .._compat import is_functorch_wrapped, storage_identity, torch_function_disabled
from .._errors import SavedInputMutatedError

__all__ = ["Bindings", "Slot", "is_tracked"]


def is_tracked(t: torch.Tensor) -> bool:
    """Whether some transform or eager autograd could want a gradient for ``t``."""
    return is_functorch_wrapped(t) or t.requires_grad


@dataclasses.dataclass(eq=False)
class Slot:
    """A place that holds tensors ``fn`` reads: ``get()``/``set(v)`` access its value."""

    get: Callable[[], Any]
    set: Callable[[Any], None]
    where: str
    #: Positions of the tracked tensor leaves in ``leaves``.
    positions: tuple[int, ...]
    #: The slot's value as the call saw it (``optree.tree_flatten(get())`` then): a
    #: container mutated or a variable rebound after the call does not change what
    #: the recompute sees.
    leaves: list[Any]
    treedef: Any
    #: Position, version and storage after the forward of each tensor leaf an op read.
    read_versions: list[tuple[int, int, int | None]] = dataclasses.field(default_factory=list)
    #: Whether an in-place change of that tensor before the recompute raises.
    checked: bool = True
    #: A module's ``_parameters``/``_buffers`` entry: the module state guard gives the
    #: recompute what the forward read there (NOTE [ State the forward changes ]).
    module_state: bool = False
    #: A module's ``_buffers`` entry (a running statistic an op may write in place).
    buffer: bool = False
    #: The tensor the forward itself bound here without reading the one before (a
    #: cache it grew), and its version then: what the recompute reads
    #: (NOTE [ Closed-over tensors ] rule 6); None for every other slot.
    left: torch.Tensor | None = None
    left_version: int = -1


@dataclasses.dataclass
class Bindings:
    """The closed-over tracked tensors of one function and the slots that hold them."""

    tensors: list[torch.Tensor] = dataclasses.field(default_factory=list)
    #: Where each tensor was found ("closure variable 'w' of f").
    _where: list[str] = dataclasses.field(default_factory=list)
    _slots: list[tuple[Slot, list[int]]] = dataclasses.field(default_factory=list)
    _index: dict[int, int] = dataclasses.field(default_factory=dict)
    #: Ids of the found tensors the forward's ops read (`note_versions`); None before.
    _read: frozenset[int] | None = None

    @property
    def names(self) -> list[str]:
        """Human-readable location of each tensor, with its shape and dtype."""
        # Built on demand (error messages): formatting shapes costs more than the walk.
        return [f"{w} ({_describe(t)})" for w, t in zip(self._where, self.tensors, strict=True)]

    def add(self, slot: Slot, leaves: Sequence[torch.Tensor]) -> None:
        indices = []
        for position in slot.positions:
            tensor = leaves[position]
            if id(tensor) not in self._index:  # tied weights: one input, several slots
                self._index[id(tensor)] = len(self.tensors)
                self.tensors.append(tensor)
                self._where.append(slot.where)
            indices.append(self._index[id(tensor)])
        self._slots.append((slot, indices))

    def remap(
        self,
        replacements: Sequence[torch.Tensor],
        label: str = "the region",
        alive: list[torch.Tensor] | None = None,
    ) -> dict[int, torch.Tensor]:
        """What a recompute substitutes for slots rebound since the call (rule 4).

        For each slot whose value now differs from its snapshot but keeps its
        structure (a variable rebound, ``functional_call`` having put a module's
        own tensors back), the tensor now in the slot maps to what the forward
        saw there: the Function's input (``replacements[i]`` for ``tensors[i]``)
        or the snapshot tensor itself. Nothing is written to the slot.

        Ops are substituted by the identity of the tensor they read, so two slots
        that now hold one tensor but held two different ones in the forward (tied
        weights ``functional_call(..., tie_weights=False)`` gave two values, and
        has put the one tied tensor back) cannot both be given theirs: that
        raises, where a guess would be a wrong gradient. A slot the forward did
        not read gives way to one it read (a dict entry rebound with the others).

        The table is keyed by ``id``: each tensor it maps is appended to ``alive``,
        which the caller holds while the table is in use. A recompute that rebinds
        the slot again (``self.weight = v / v.norm()`` in ``forward``) frees the
        tensor there, and a tensor the recompute makes next could get its id and
        be substituted (a wrong gradient, or a shape mismatch).
        """
        table: dict[int, torch.Tensor] = {}
        found_in: dict[int, tuple[str, bool]] = {}  # the slot a mapping came from, read
        with torch_function_disabled():  # our reads are not the function's
            for slot, indices in self._slots:
                try:
                    current = slot.get()
                except (KeyError, AttributeError, ValueError):  # deleted since
                    continue
                if slot.left is not None:  # rule 6: what the forward left there
                    if current is not slot.left and isinstance(current, torch.Tensor):
                        table[id(current)] = slot.left  # rebound since the forward
                        if alive is not None:
                            alive.append(current)
                    continue
                if len(slot.leaves) == 1 and current is slot.leaves[0]:
                    continue
                leaves, treedef = optree.tree_flatten(current, none_is_leaf=True)
                if treedef != slot.treedef:
                    continue  # its structure changed: the engine's op trace maps it
                given = dict(zip(slot.positions, indices, strict=True))
                for position, (now, then) in enumerate(zip(leaves, slot.leaves, strict=True)):
                    if isinstance(now, torch.Tensor) and now is not then:
                        index = given.get(position)
                        wanted = then if index is None else replacements[index]
                        read = self._read is None or id(then) in self._read
                        if id(now) in table and table[id(now)] is not wanted:
                            first, first_read = found_in[id(now)]
                            if first_read and read:
                                raise _tied_since(label, first, slot.where)
                            if first_read:
                                continue
                        table[id(now)] = wanted
                        found_in[id(now)] = (slot.where, read)
                        if alive is not None:
                            alive.append(now)
        return table

    def reached(self) -> dict[int, str]:
        """Every tensor found (tracked or not) by ``id``, with where it was found."""
        found: dict[int, str] = {}
        for slot, _ in self._slots:
            for leaf in slot.leaves:
                if isinstance(leaf, torch.Tensor):
                    found.setdefault(id(leaf), slot.where)
        return found

    def module_state(self) -> set[int]:
        """Ids of the tensors found in modules' parameter and buffer tables: the module
        state guard gives the recompute the tensors the forward read there (a slot
        rebound since, a buffer the forward wrote: the value it started from)."""
        return {
            id(leaf)
            for slot, _ in self._slots
            if slot.module_state
            for leaf in slot.leaves
            if isinstance(leaf, torch.Tensor)
        }

    def untracked(self) -> list[torch.Tensor]:
        """The untracked tensors found outside parameter tables, which an op may write in
        place: modules' buffers (running statistics), and tensors reached through a
        closure, a global or an attribute (a statistic, ``STATS["seen"].add_(...)``)."""
        return [
            leaf
            for slot, _ in self._slots
            if slot.buffer or not slot.module_state
            for i, leaf in enumerate(slot.leaves)
            if isinstance(leaf, torch.Tensor) and i not in slot.positions
        ]

    def note_versions(self, used: set[int]) -> None:
        """After the forward: remember the version and storage of each tensor an op read.

        ``used``: ids of the tensors the forward's ops got. One that none read
        (another entry of a closed-over dict) may change freely, as in autograd.
        """
        self._read = frozenset(used)
        with torch_function_disabled():  # our reads are not the function's
            for slot, _ in self._slots:
                _note_left(slot, used)
                if slot.checked:
                    slot.read_versions = [
                        (i, t._version, storage_identity(t))
                        for i, t in enumerate(slot.leaves)
                        if isinstance(t, torch.Tensor) and id(t) in used
                    ]

    def check_versions(self, label: str, restored: Set[int] = frozenset()) -> None:
        """Before a recompute: raise if a closed-over tensor changed in place since.

        ``restored``: ids of tensors the state guard gives the recompute as the forward
        found them (`RestoringGuard.restored_ids`): a buffer the forward itself
        updates, written again by a later forward, is read from its copy."""
        for slot, _ in self._slots:
            left = slot.left
            if left is not None and slot.left_version != -1 and left._version != slot.left_version:
                raise SavedInputMutatedError(
                    f"remat: {slot.where} (shape {tuple(left.shape)}), the tensor the "
                    f"forward pass of {label} bound there, was modified in place after "
                    "that forward, so the recompute would read the new values. Modify it "
                    "after the backward, or modify a clone of it."
                )
            for i, version, storage in slot.read_versions:
                t = slot.leaves[i]
                if id(t) in restored:
                    continue
                with torch_function_disabled():
                    now = (t._version, storage_identity(t))
                if now == (version, storage):
                    continue
                where = slot.where if len(slot.leaves) == 1 else f"element #{i} of {slot.where}"
                raise SavedInputMutatedError(
                    f"remat: {where} (shape {tuple(t.shape)}) was modified in place "
                    f"or reassigned ('.data = ...') after the forward pass of {label} read "
                    "it, so the recompute would use the new values (plain autograd raises "
                    "too where it saved the tensor). Modify it after the backward, or "
                    "modify a clone of it."
                )


def _note_left(slot: Slot, used: set[int]) -> None:
    """Rule 6: note the tensor the forward bound in ``slot`` (one tensor) without
    reading the one it held before; the recompute reads it as it is. (One that
    requires grad left the forward through the slot: NOTE [ Escaped tensors ].)"""
    if len(slot.leaves) != 1 or not isinstance(slot.leaves[0], torch.Tensor):
        return
    if id(slot.leaves[0]) in used:
        return  # read, then rebound (a running average): the recompute reads the old one
    try:
        now = slot.get()
    except (KeyError, AttributeError, ValueError):  # deleted by the forward
        return
    if isinstance(now, torch.Tensor) and now is not slot.leaves[0]:
        slot.left, slot.left_version = now, -1 if now.is_inference() else now._version


def _tied_since(label: str, first: str, second: str) -> SavedInputMutatedError:
    return SavedInputMutatedError(
        f"remat: the recompute of {label} under the torch.func engine finds {first} and "
        f"{second} holding one tensor, where its forward read two different ones (tied "
        "weights given two values by torch.func.functional_call(..., tie_weights=False), "
        "then tied again). It substitutes tensors by identity, so it cannot give each op "
        "what it read, and a guess would be a wrong gradient. Fixes: use "
        "engine='eager' for this region, give both names the same tensor "
        "(tie_weights=True, the default), or untie the module's weights."
    )


def _describe(t: torch.Tensor) -> str:
    return f"tensor of shape {tuple(t.shape)}, dtype {t.dtype}"
