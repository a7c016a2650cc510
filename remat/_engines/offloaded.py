"""The op outputs one region call moved to the host store, shared by both engines.

NOTE [ Offloaded outputs ]
1. An ``OFFLOAD`` op output goes to the store once per (record, position), as an
   `Offloaded` entry ordered (serial, op index, position), so prefetch follows op
   order across calls; the record then holds a ``meta`` placeholder (liveness
   still sees a replayable op) and the device copy can go.
2. A value written since its op made it is not put (the replay would write it
   again on top of a copy of the written value); one written since its copy was
   made keeps that save on the device.
3. Before a replaying recompute, the entries go back into their records newest
   first (the order prefetch expects); a record the forward wrote to after the
   copy gets a copy of its own, so the entry's value stays what holders saved.
   After the recompute the fetched values go: a later recompute reruns those ops.
4. The copies are remat's own work, below every mode (and, for the torch.func
   engine, below every functorch level): each engine passes its ``below``.
The engines decide *which* outputs are put (eager: NOTE [ The eager engine ] rule 6;
torch.func: NOTE [ The functional engine ] rule 8).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch

from .._offload.store import HostStore, Offloaded, next_serial, offload, placeholder_for
from .._replay.records import OpRecord

__all__ = ["OffloadedOutputs"]


@dataclasses.dataclass(slots=True)
class _Put:
    record: OpRecord
    index: int
    position: int
    entry: Offloaded
    #: The value's version when its copy was made.
    version: int


class OffloadedOutputs:
    """One region call's offloaded op outputs, by (record, position).

    ``store`` is resolved at the first put (or when read); ``serial`` orders this
    call's entries after earlier calls' (taken at the first put when not given).
    """

    def __init__(
        self,
        store: Callable[[], HostStore],
        below: Callable[[], AbstractContextManager[object]],
        serial: int | None = None,
    ) -> None:
        self._resolve = store
        self._store: HostStore | None = None
        self._below = below
        self.serial = serial
        self._puts: dict[tuple[int, int], _Put] = {}

    @property
    def store(self) -> HostStore:
        if self._store is None:
            self._store = self._resolve()
        return self._store

    def __contains__(self, key: tuple[OpRecord, int]) -> bool:
        return (id(key[0]), key[1]) in self._puts

    def entry(self, record: OpRecord, position: int) -> Offloaded | None:
        put = self._puts.get((id(record), position))
        return put.entry if put is not None else None

    def put(self, record: OpRecord, index: int, position: int, t: torch.Tensor) -> Offloaded | None:
        """Put output ``position`` of op ``index`` (``t``) once; None where it stays (rule 2)."""
        key = (id(record), position)
        done = self._puts.get(key)
        if done is not None:
            return done.entry if done.version == t._version else None
        if record.version_moved(position, t):
            return None
        if self.serial is None:
            self.serial = next_serial()
        with self._below():
            entry = offload(t.detach(), self.store, (self.serial, index, position))
            placeholder = placeholder_for(t) if entry is not None else None
        if entry is None or placeholder is None:
            return None
        self._puts[key] = _Put(record, index, position, entry, t._version)
        if record.holds_outputs():
            record.mark_offloaded(position, placeholder)
        return entry

    def restore(self, before: int | None = None) -> list[tuple[OpRecord, int]]:
        """Fetch entries (of ops before ``before``, if given) back into their records (rule 3)."""
        restored = []
        for put in sorted(self._puts.values(), key=lambda p: p.entry.seq, reverse=True):
            record, position = put.record, put.position
            if before is not None and put.index >= before:
                continue
            if not record.holds_outputs():
                continue
            written = record.written_after_kept(position)
            with self._below():
                value = put.entry.get().clone() if written else put.entry.get()
            record.restore(position, value)
            restored.append((record, position))
        return restored

    def drop(self, restored: list[tuple[OpRecord, int]]) -> None:
        """After a recompute: the fetched values go, and every entry is forgotten (rule 3)."""
        for record, position in restored:
            record.drop(position)  # what backward read, its holders keep
        self._puts.clear()

    def prune(self) -> None:
        """Forget entries of released records (the holders keep theirs alive)."""
        for key, put in list(self._puts.items()):
            if not put.record.holds_outputs():
                del self._puts[key]

    def adopt(self, other: OffloadedOutputs) -> None:
        """Take ``other``'s entries (a vmap twin's, NOTE [ The functional engine ] rule 10)."""
        self._puts = other._puts
