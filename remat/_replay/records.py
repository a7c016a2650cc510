"""The record of a region's forward: one `OpRecord` per aten op, in an `OpLog`.

One record is ``_replay/record.py``; the modes that fill the log and replay it
are in ``_replay/modes.py``.

NOTE [ Record and replay ]
1. In the forward pass `RecordMode` sees every aten op of the region (below
   autograd and below every functorch layer), asks the policy for a verdict and
   appends an `OpRecord` to the region's `OpLog`. Outputs the policy keeps
   (``SAVE``/``OFFLOAD``) are held as detached aliases in the record.
2. Every tensor an op returns is tagged with ``(log serial, op index, output
   position)``. The eager engine's pack hook reads the tag to find the decision
   for a tensor autograd saves; `checkpoint_name` reads it to find the op whose
   output is being named.
3. In the recompute `ReplayMode` counts ops; an op whose outputs are all kept is
   not run: its kept outputs are returned (autograd, above the mode, still
   records the op, so gradients flow through it). A kept output that was mutated
   in place after it was kept is not replayed; the op runs again instead.
4. Random ops are never kept: skipping one in the recompute would shift the
   random stream for every later op. In-place ops are never kept either: their
   output is their input. Nor are ops that make inference tensors (a
   ``torch.inference_mode()`` block inside the region): those have no version
   counter, and rerunning them is how the recompute gets the same constants.
5. Dead ops are not run. Each record knows which earlier records produced its
   inputs, and the log knows which inner regions ran inside it. Before a
   recompute, `OpLog.liveness` walks back from the records whose outputs
   backward needs: an op is live when a live op reads it, and a replayed op
   needs none of its inputs. An inner region with anything live in it is live
   whole, inputs included: it runs as a region of its own in the recompute,
   keeps what its policy saves and may recompute from its inputs later. A dead
   op returns a meta tensor of the right shape and strides instead of running
   (free, and loud if anything reads it, or if a composite op above picks
   another kernel for it, as attention does on meta: the engine then
   recomputes again with every op live), except where backward holds that
   output anyway: then the held tensor (free too; attention checks that its
   query, key and value share a device, so a kept query beside a recomputed
   value must not be a stand-in). Ops that must run whatever reads them are always live:
   random ops (the random stream), in-place and ``out=`` ops (they write through views the
   data flow does not follow) and ops whose result Python may read (``item()``,
   ``nonzero`` and every op tagged data-dependent). View ops always run: they
   cost nothing and need no live input.
6. Replay hands the forward's kept outputs to the recompute's ops by position,
   so the recompute's op at each position must be the forward's, and a
   replayed op must get tensors of the forward's shapes, checked even with
   ``determinism_check=False``: handing a kept output to another op, or to the
   same op given other shapes, would compute garbage. That flag skips only the
   comparison of Python numbers (and the signature checks of ``_replay/checks.py``).
7. FSDP2 (``fully_shard``) gathers a unit's parameters in its forward pre-hook
   with ``fsdp::`` ops, and in backward only if they were resharded since: a
   region that records those ops would replay the gather (or miss it). An
   ``fsdp::`` op recorded in a forward raises, saying to make each unit a
   region of its own. (FSDP reshards after every backward, so a unit inside a
   region gathers in every forward.) Regions that record no ops
   (``nothing-saveable``) run FSDP units inside them as plain autograd does.
8. A view shares its base's storage: keeping a view keeps every byte of the
   base. So a view op whose input is an output the policy recomputes (a name
   ``everything-except:NAME`` drops, viewed by a ``Linear`` on a 3-D input for
   its ``mm``) is recomputed too, whatever the policy says of the view op:
   otherwise the value the policy frees stays alive through its view. The
   recompute runs it from its recomputed base (view ops cost nothing). A
   memory budget is left to its plan (NOTE [ Budget plans ]).
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterable
from typing import Any

import torch

from .. import _compat
from .._policy.base import Decision, Policy
from .._pytree import tensor_leaves
from .alignment import kinds as find_kinds
from .cast_cache import CastKey, cacheable, cast_key, cast_source
from .checks import arg_shapes
from .record import OpRecord, detached_alias
from .tags import TAG, OpTag, tag_inner, tag_of
from .traits import Traits, draws_random, flat_tensors, fsdp_inside, scan_args, traits, written_by

__all__ = ["OpLog", "OpRecord", "detached_alias"]

_serials = itertools.count(1)

_new_tuple = tuple.__new__


class OpLog:
    """The record of one forward of one region."""

    def __init__(
        self, policy: Policy, label: str, inputs: Iterable[torch.Tensor] = ()
    ) -> None:
        self.policy = policy
        self.label = label
        self.serial = next(_serials)
        #: Ids of the region's inputs: never parts of a constant (NOTE [ Ops the
        #: recompute may skip ] in ``_replay/alignment.py``), grad or not.
        self.input_ids = frozenset(map(id, inputs))
        self.records: list[OpRecord] = []
        #: Regions that ran inside this one: (first op, end op, producers of their inputs).
        self.regions: list[tuple[int, int, tuple[int, ...]]] = []
        #: Kept outputs by storage address: an in-place write through any alias of
        #: one (even an alias with its own version counter) makes it unreplayable.
        self.kept_storages: dict[int, list[tuple[OpRecord, int]]] = {}
        #: Every ``checkpoint_name`` given in this forward (NOTE [ Names that match nothing ]).
        self.names_seen: set[str] = set()
        #: Records whose outputs leave the region (its outputs, escaped tensors): never
        #: forward-only (NOTE [ Ops the recompute may skip ] in ``_replay/alignment.py``).
        self.sinks: set[int] = set()
        #: Casts to the lower precision, by record: the memory each cast; and those
        #: autocast's cache may hold (NOTE [ Autocast's cast cache ] in ``_replay/cast_cache.py``).
        self.casts: dict[int, CastKey] = {}
        self.cacheable: set[int] = set()
        #: `kinds` of the records, and how many records there were when they were found.
        self._kinds: tuple[int, list[int]] | None = None

    def record(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        index = len(self.records)
        outputs = flat_tensors(out)
        op_traits = traits(op)
        if op_traits.fsdp:
            raise fsdp_inside(self.label, op)
        if op_traits.writes:
            self._invalidate_written(op_traits, args, kwargs)
        # An op run under ``torch.inference_mode()`` inside the region makes
        # inference tensors: constants with no version counter, which autograd
        # never saves. They are not kept (NOTE rule 4): the recompute makes them again.
        # (Loops and tests inline, not any() and calls: every recorded op passes here.)
        effectful = op_traits.writes or (
            op_traits.random and draws_random(op_traits, args, kwargs)
        )
        if not effectful:
            for t in outputs:
                if t.is_inference():
                    effectful = True
                    break
        if effectful:
            verdict: Hashable = None
            decision = Decision.RECOMPUTE
        else:
            verdict = self.policy.decide_record(index, op, args, kwargs)
            decision = self.policy.decide(verdict, None)
            if op_traits.view and decision is not Decision.RECOMPUTE and self._views_dropped(args):
                decision = Decision.RECOMPUTE  # NOTE rule 8
        rec = OpRecord(op, verdict, decision, index)
        rec.inputs, rec.scalars, rec.reads_outside = scan_args(
            args, kwargs, self.serial, self.input_ids
        )
        rec.effectful = effectful
        if op is _compat.TO_COPY:  # NOTE [ Autocast's cast cache ]
            source = cast_source(op, args, kwargs)
            if source is not None:
                self.casts[index] = cast_key(source)
                if cacheable(source):
                    self.cacheable.add(index)
        if len(outputs) == 1:
            only = outputs[0]
            rec.metas = ((only.shape, only.stride(), only.dtype),)
        else:
            rec.metas = tuple([(t.shape, t.stride(), t.dtype) for t in outputs])
        rec.always_live = effectful or op_traits.reads_data
        if self.policy.plans_from_log or (
            not effectful and (decision is not Decision.RECOMPUTE or self.policy.uses_names)
        ):
            # Also for a budget plan's cost estimate; an effectful op is never replayed.
            rec.input_shapes = arg_shapes(args, kwargs)
        self.records.append(rec)
        # A named output of a multi-output op (attention's output beside its
        # log-sum-exp) is replayable only if its siblings are kept as well.
        rec.tentative = (
            decision is Decision.RECOMPUTE and len(outputs) > 1
            and self.policy.uses_names and not effectful
        )
        keeps = decision is not Decision.RECOMPUTE or rec.tentative
        for position, tensor in enumerate(outputs):
            # (A hot path: ``tuple.__new__`` is the NamedTuple's own constructor without
            # its Python-level ``__new__``; `set_tag` inline; `tag_inner` only for
            # wrapper subclasses, where it does anything.)
            tag = _new_tuple(OpTag, (self.serial, index, position))
            setattr(tensor, TAG, tag)
            if type(tensor) is not torch.Tensor:
                tag_inner(tensor, tag)
            if keeps:
                self._keep(rec, position, tensor)

    def _views_dropped(self, args: tuple[Any, ...]) -> bool:
        """Whether a view op's input is an output of this log the policy recomputes.

        Not for a memory budget: its plan decides each op by position, from bytes.
        """
        policy = self.policy
        if policy.plans_from_log or type(policy).decide_record is not Policy.decide_record:
            return False
        for arg in args:
            found = self.lookup(arg) if isinstance(arg, torch.Tensor) else None
            if found is not None and found[0].decision_at(found[1]) is Decision.RECOMPUTE:
                return True
        return False

    def _keep(self, rec: OpRecord, position: int, tensor: torch.Tensor) -> None:
        rec.keep(position, tensor, len(rec.metas))
        address = _compat.storage_address(tensor)
        if address:
            self.kept_storages.setdefault(address, []).append((rec, position))

    def _invalidate_written(
        self, op_traits: Traits, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        for tensor in written_by(op_traits, args, kwargs):
            for rec, position in self.kept_storages.get(_compat.storage_address(tensor), ()):
                rec.mark_written(position)

    def _producers(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, ...]:
        return scan_args(args, kwargs, self.serial)[0]

    def liveness(self, needed: list[int]) -> list[bool]:
        """Which records a recompute must run to produce the records in ``needed``."""
        live = [rec.always_live for rec in self.records]
        for index in needed:
            live[index] = True
        regions = sorted(self.regions, reverse=True)
        for index in range(len(self.records) - 1, -1, -1):
            rec = self.records[index]
            if live[index] and not rec.replay_state()[1]:  # replayed: needs no input
                for producer in rec.inputs:
                    live[producer] = True
            while regions and regions[0][0] >= index:
                start, end, producers = regions.pop(0)
                if any(live[start:end]):
                    self._revive(live, start, end, producers)
        return live

    def _revive(self, live: list[bool], start: int, end: int, producers: tuple[int, ...]) -> None:
        # An inner region runs as a region of its own in the recompute: it keeps
        # what its policy saves from the ops it sees and may recompute from its
        # inputs later (NOTE [ The eager engine ] rule 4). No stand-in may reach
        # it: when anything in it is live, all of it and its inputs are.
        for index in range(start, end):
            live[index] = True
            rec = self.records[index]
            if not rec.replay_state()[1]:
                for producer in rec.inputs:
                    live[producer] = True
        for producer in producers:
            live[producer] = True

    def inner_region(self, inputs: list[torch.Tensor], start: int) -> None:
        """Note that a region with these inputs ran its ops from ``start`` to now."""
        producers = self._producers(tuple(inputs), {})
        self.regions.append((start, len(self.records), producers))

    def lookup(self, tensor: torch.Tensor) -> tuple[OpRecord, int] | None:
        """The record and output position that produced ``tensor`` in this log, if any."""
        tag = tag_of(tensor)
        if tag is None or tag.log_serial != self.serial:
            return None
        return self.records[tag.op_index], tag.position

    def name(self, tensor: torch.Tensor, name: str) -> None:
        """Apply the policy's decision for a value tagged ``name``."""
        self.names_seen.add(name)
        tensor = _compat.physical(tensor)
        found = self.lookup(tensor)
        if found is None:
            return  # a region input or a closed-over tensor: kept anyway
        rec, position = found
        if rec.always_live and rec.decision is Decision.RECOMPUTE and rec.verdict is None:
            return  # random or in-place: never kept, see NOTE rule 4
        decision = self.policy.decide(rec.verdict, name)
        rec.name(position, name, decision)
        if decision is not Decision.RECOMPUTE:
            # Called from user code: Python-level modes (the torch.func engine's
            # hidden-tensor guard) must not see remat's own bookkeeping, nor may a
            # live functorch level (the recorded forward's inner vjp): detaching
            # under it would keep a wrapper of a level that dies with the forward.
            with _compat.torch_function_disabled(), _compat.functorch_disabled():
                self._keep(rec, position, tensor)

    def note_outputs(self, tensors: Any) -> None:
        """The tensors (any pytree) the region's forward hands out: their records are sinks."""
        for tensor in tensor_leaves(tensors):
            found = self.lookup(_compat.physical(tensor))
            if found is not None:
                self.sinks.add(found[0].index)
        self._kinds = None

    def kinds(self) -> list[int]:
        """What a recompute may do with each record (`alignment.kinds`), found once per log."""
        cached = self._kinds
        if cached is None or cached[0] != len(self.records):
            found = find_kinds(self.records, self.regions, self.sinks, self.cacheable)
            cached = self._kinds = (len(self.records), found)
        return cached[1]

    def end_forward(self) -> None:
        """Release the outputs kept only in case a name would save them."""
        for rec in self.records:
            rec.end_forward()

    def demote(self, base: Policy) -> None:
        """Keep only what ``base`` keeps, in every record (see `OpRecord.demote`)."""
        for rec in self.records:
            rec.demote(base)

    def op_names(self) -> list[str]:
        return [str(rec.op) for rec in self.records]

