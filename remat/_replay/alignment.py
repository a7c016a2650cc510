"""Which forward ops a recompute may skip, and which forward op each recompute op is.

NOTE [ Ops the recompute may skip ]
1. Replay hands kept outputs to the recompute's ops by the forward op each one
   is (NOTE [ Record and replay ] rule 6), so the recompute must run the
   forward's ops. Two kinds of forward ops may be missing from it without
   changing any gradient, and only these (`kinds`, found once per log):
   - *Forward-only* (``FORWARD_ONLY``): an op that draws no random numbers,
     writes no tensor, is not in an inner region, is not a sink (its outputs do
     not leave the region: `OpLog.note_outputs`), and whose outputs are read
     only by forward-only ops, ending in ops that hand Python a number
     (``.item()``, ``bool(t)``). Such an op feeds no tensor that anything after
     it computes, saves or returns: a statistic logged under
     ``if not remat.is_recomputing():``. What Python does with the number is
     checked as usual: a number passed to a later op is compared (the op's
     scalars), a branch taken on it changes the ops that follow.
   - *Constant* (``CONSTANT``): an op that draws and writes nothing, outside inner
     regions, whose inputs are all outputs of constant ops (factories such as
     ``arange``, ``torch.tensor`` data, Python numbers) or tensors no op of the
     region made that require no grad and are none of its inputs (a cached
     ``inv_freq`` it reaches through an attribute): a value the region
     builds from nothing it differentiates, such as a rotary table made on the
     first call and kept in a cache (``if "inv" not in CACHE: ...``), or grown
     when a longer sequence comes (NOTE [ Bindings the recompute reads ] rule 8
     in ``_engines/eager/bindings.py``). The recompute may
     skip it only if every op of the recompute that reads its output reads the
     forward's very tensor, unwritten since (version 0), where the forward's op
     read it: the same value, so the same gradients.
   Every other op (*needed*) must be run by the recompute, in the forward's order.
   Nothing else is tolerated: a random op skipped would shift the random stream
   for every later one; a skipped write would leave state unwritten; an op whose
   output reaches a kept record, a saved tensor or an output is needed.
2. The recompute's ops are matched to the forward's as a subsequence that leaves
   out only skippable ops (`Alignment`). Where several forward ops fit one
   recompute op (a forward-only ``h.detach() @ V`` before a needed ``h @ W`` of
   the same shapes: which one did the recompute skip?), every reading is
   followed at once, as the states of a small automaton; a reading dies when an
   op contradicts it (a needed op that is not next, an op reading a forward-only
   op's output, a skipped constant read other than from the forward's tensor).
   No reading is guessed: an op is replayed (its kept outputs handed out) or
   given a stand-in only when every live reading says it is the same forward op;
   otherwise it runs for real, which gives the right value whichever reading is
   true. When no reading is left, the recompute differs from its forward and
   raises as before, naming the first needed op it did not run, and when the
   forward ran the recompute's op later on, the lazy-init and forward-only
   patterns with the fixes that work.
3. Torch's selective checkpoint (``torch.utils.checkpoint``'s caching modes)
   matches a recompute op to a cached output by a per-op counter: the k-th
   ``mm`` of the recompute gets the k-th ``mm`` of the forward. A forward-only
   ``mm`` before the real one would hand the statistic's product to the real
   ``mm``: the wrong value with the right shape, silently. Here a forward-only
   op is never the only reading of an op that a needed forward op of the same
   kind also fits, so it is never replayed into the wrong op.
4. While no record was skipped, the replay takes the one-state fast path of
   `ReplayMode` (the forward's next op, needed, and the same op): the general
   path costs only recomputes that skip.
5. The eager engine matches saved tensors as well as ops. A forward-only op that
   autograd records (a statistic on a tensor that requires grad, not under
   ``torch.no_grad()``) saved tensors in the forward that the recompute does not
   save; they are dropped with the statistic's graph, and the recompute leaves
   them out (NOTE [ Saved tensors the recompute may skip ] in
   ``_engines/eager/skipped_saves.py``). A statistic whose tensor is kept (its
   graph alive) is not forward-only by rule 1's test either way: the recompute
   must give backward those saved tensors, which it cannot, and raises.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch

from .cast_cache import CastKey, cacheable, cast_key, cast_source
from .checks import arg_shapes
from .record import OpRecord
from .tags import TAG
from .traits import scalars_of, traits

__all__ = ["CONSTANT", "FORWARD_ONLY", "NEEDED", "Alignment", "kinds"]

NEEDED, FORWARD_ONLY, CONSTANT = 0, 1, 2

#: ``torch.tensor(data)``: the data tensor is made outside dispatch, a constant.
_FRESH = frozenset(
    getattr(torch.ops.aten, name).default
    for name in ("lift_fresh", "lift_fresh_copy")
    if hasattr(torch.ops.aten, name)
)

#: Their ids: an ``OpOverload`` hashes in Python (the ops live as long as torch.ops).
_FRESH_IDS = frozenset(map(id, _FRESH))

#: More readings than this of one recompute: raise rather than follow them all.
MAX_READINGS = 64


def kinds(
    records: Sequence[OpRecord],
    regions: Sequence[tuple[int, int, tuple[int, ...]]],
    sinks: set[int],
    casts: Collection[int] = (),
) -> list[int]:
    """``NEEDED``, ``FORWARD_ONLY`` or ``CONSTANT`` for each record (NOTE rule 1).

    ``casts``: records that are casts autocast's cache may hold, skippable as
    constants are (NOTE [ Autocast's cast cache ] in ``_replay/cast_cache.py``).
    """
    count = len(records)
    inside = [False] * count
    for start, end, _ in regions:
        inside[start:end] = [True] * (end - start)
    constant = [False] * count
    fresh = _FRESH_IDS
    for i, rec in enumerate(records):  # (loops, not all(): a hot path, once per forward)
        if rec.effectful or inside[i]:
            continue
        if id(rec.op) in fresh:
            constant[i] = True
        elif not rec.reads_outside:
            for p in rec.inputs:
                if not constant[p]:
                    break
            else:
                constant[i] = True
    found = [NEEDED] * count
    read = [False] * count
    read_by_needed = [False] * count
    for i in range(count - 1, -1, -1):
        rec = records[i]
        if not rec.effectful and not inside[i] and i not in sinks:
            if not rec.metas:
                if traits(rec.op).reads_data:  # hands Python a number
                    found[i] = FORWARD_ONLY
            elif read[i] and not read_by_needed[i]:
                found[i] = FORWARD_ONLY
        if found[i] == NEEDED and (constant[i] or i in casts):
            found[i] = CONSTANT
        for producer in rec.inputs:
            read[producer] = True
            if found[i] != FORWARD_ONLY:
                read_by_needed[producer] = True
    return found


@dataclasses.dataclass(frozen=True)
class _Reading:
    """One way the recompute's ops so far fit the forward's (NOTE rule 2)."""

    #: The next forward record to match.
    position: int
    #: Constant records skipped: their outputs may be read only as the forward's tensors.
    skipped: frozenset[int] = frozenset()
    #: ids of the recompute's tensors that forward-only ops made (see `Alignment.alive`).
    forward_only: frozenset[int] = frozenset()


class Alignment:
    """The readings of a recompute that skipped forward ops, and the record of each op.

    `ReplayMode` (``_replay/modes.py``) hands over each op its fast path does not
    take; `match` says which record it is (None: several, run it for real) or
    that none is (`Mismatch`), and `ran` updates the readings with what it made.
    """

    def __init__(
        self,
        records: Sequence[OpRecord],
        kinds_: list[int],
        serial: int,
        at: int,
        casts: Mapping[int, CastKey] | None = None,
        cached: Collection[int] = (),
    ) -> None:
        self.records = records
        #: The forward's casts to the lower precision: what each read (`OpLog.casts`).
        self.casts = casts or {}
        #: Those of them autocast's cache may hold (`OpLog.cacheable`).
        self.cached = cached
        self.kinds = kinds_
        self.serial = serial
        self.check = True
        self.why: str | None = None
        self.readings = [_Reading(at)]
        self._next: list[tuple[_Reading, int]] = []
        #: Tensors forward-only ops of the recompute made, by id (a reused id is
        #: not taken for its dead tensor's).
        self.alive: dict[int, weakref.ref[torch.Tensor]] = {}

    def match(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
        """The record ``func`` is in every reading, None if they differ; raises `Mismatch`."""
        scalars = scalars_of(args, kwargs) if self.check else None
        self.why = None
        tensors = _tensor_args(args, kwargs)
        shapes = arg_shapes(args, kwargs)
        source = cast_source(func, args, kwargs) if self.casts else None
        proposals: list[tuple[_Reading, int]] = []
        ended: list[tuple[_Reading, int]] = []
        for reading in self.readings:
            skipped = reading.skipped
            for j in range(reading.position, len(self.records)):
                rec = self.records[j]
                kind = self.kinds[j]
                if rec.op == func and (scalars is None or rec.scalars == scalars):
                    why = (
                        self._same_cast(j, source)
                        or self._fits(reading, skipped, j, tensors)
                        or self._shaped(rec, shapes)
                    )
                    if why is None:
                        proposals.append((_Reading(j + 1, skipped, reading.forward_only), j))
                    elif kind == NEEDED:
                        self.why = why
                if kind == NEEDED:
                    break
                if kind == CONSTANT:
                    skipped = skipped | {j}
            else:
                ended.append((reading, -1))
        if not proposals and ended and not self.check:
            self._next = ended  # past the forward's end, unchecked: nothing to replay
            return None
        if not proposals:
            raise Mismatch(why=self.why)
        if len(proposals) > MAX_READINGS:
            raise Mismatch(why=f"it fits more than {MAX_READINGS} ways of reading the forward")
        self._next = proposals
        targets = {j for _, j in proposals}
        return targets.pop() if len(targets) == 1 else None

    def ran(self, out: Any) -> None:
        """After the matched op ran: its outputs, forward-only in the readings that say so."""
        made: frozenset[int] | None = None
        readings: dict[_Reading, None] = {}
        for reading, j in self._next:
            if j >= 0 and self.kinds[j] == FORWARD_ONLY:
                if made is None:
                    made = self._note(out)
                reading = dataclasses.replace(reading, forward_only=reading.forward_only | made)
            readings[reading] = None
        self.readings = list(readings)

    def detached(self, source: torch.Tensor, out: torch.Tensor) -> None:
        """``out = source.detach()`` in the recompute: forward-only where ``source`` is."""
        if self._is_forward_only(source, None):
            self.readings = [
                dataclasses.replace(r, forward_only=r.forward_only | self._note(out))
                if id(source) in r.forward_only else r
                for r in self.readings
            ]

    def exact(self) -> bool:
        """Whether the readings are one, which skipped nothing (the fast path may resume)."""
        return len(self.readings) == 1 and not self.readings[0].skipped and not (
            self.readings[0].forward_only
        )

    @property
    def position(self) -> int:
        """The furthest reading's next record (for messages and the fast path)."""
        return max(r.position for r in self.readings)

    def _note(self, out: Any) -> frozenset[int]:
        made = _tensor_args((out,), {}) if not isinstance(out, torch.Tensor) else [out]
        for t in made:
            self.alive[id(t)] = weakref.ref(t)
        return frozenset(id(t) for t in made)

    def _is_forward_only(self, t: torch.Tensor, reading: _Reading | None) -> bool:
        ref = self.alive.get(id(t))
        if ref is None or ref() is not t:
            return False
        return reading is None or id(t) in reading.forward_only

    def _same_cast(self, j: int, source: torch.Tensor | None) -> str | None:
        """Why record ``j`` is not the cast of ``source`` (NOTE [ Autocast's cast cache ])."""
        # Only a parameter's cast (either side) is matched by what it reads: an
        # intermediate's cast reads recomputed memory.
        mine = source is not None and cacheable(source)
        if j not in self.cached and not mine:
            return None
        cast = self.casts.get(j)
        if cast is None or source is None or cast_key(source) != cast:
            return "it casts another tensor than the forward's op did"
        return None

    @staticmethod
    def _shaped(rec: OpRecord, shapes: tuple[Any, ...]) -> str | None:
        """Why a record that may replay cannot be an op given tensors of ``shapes``."""
        if rec.input_shapes is None or rec.input_shapes == shapes:
            return None
        return (
            f"it got tensors of shapes {[tuple(s) for s, _ in shapes]}, the forward's "
            f"{[tuple(s) for s, _ in rec.input_shapes]}"
        )

    def _fits(
        self, reading: _Reading, skipped: frozenset[int], j: int, tensors: list[torch.Tensor]
    ) -> str | None:
        """Why record ``j`` cannot be the op reading ``tensors`` in ``reading``; None if it can."""
        if (
            self.kinds[j] != FORWARD_ONLY
            and reading.forward_only
            and any(self._is_forward_only(t, reading) for t in tensors)
        ):
            return "it reads a tensor that only the forward's ops made in the forward"
        if not skipped:
            return None
        # A skipped constant is read only as the forward's own tensor, unwritten,
        # where the forward read it.
        forward_reads: set[int] = set()
        for t in tensors:
            tag = getattr(t, TAG, None)
            if tag is not None and tag[0] == self.serial and tag[1] in skipped:
                if t._version != 0:
                    return (
                        f"it reads the value op #{tag[1]} built in the forward, which the "
                        "recompute did not build again, and which was written in place since"
                    )
                forward_reads.add(tag[1])
        wanted = skipped.intersection(self.records[j].inputs)
        if forward_reads != wanted:
            return (
                "it reads another tensor where the forward read the value that ops "
                "the recompute did not run built"
            )
        return None


class Mismatch(Exception):
    """No reading fits the recompute's op: `ReplayMode` raises the user's error."""

    def __init__(self, why: str | None = None) -> None:
        super().__init__()
        #: Why the forward's next needed op, the same op, is not this one (None: another op).
        self.why = why


def _tensor_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for arg in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(arg, torch.Tensor):
            found.append(arg)
        elif isinstance(arg, (list, tuple)):
            found.extend(t for t in arg if isinstance(t, torch.Tensor))
    return found
