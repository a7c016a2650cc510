"""Dispatch modes that record a region's forward and replay it in the recompute.

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
   recomputes again with every op live). Ops that must run whatever reads them are always live:
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
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Hashable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from .._errors import NondeterministicRecomputeError, RematError
from .._policy import ops as _ops
from .._policy.base import Decision, Policy
from .._state import local
from .checks import CURES, arg_shapes, divergence

__all__ = [
    "TAG",
    "storage_address",
    "OpLog",
    "OpRecord",
    "RecordMode",
    "ReplayMode",
    "detached_alias",
    "physical",
]

#: Attribute set on every tensor a recorded op returns: (log serial, op index, position).
TAG = "_remat_src"

_serials = itertools.count(1)

# NOTE: `detach` is invisible to both modes. The engines detach tensors inside
# saved-tensor hooks, at points that differ between forward and recompute; a
# detached tensor carries its source's tag so the policy still applies to it.
_DETACH = torch.ops.aten.detach.default


def _inherit_tag(source: Any, out: Any) -> None:
    tag = getattr(source, TAG, None)
    if tag is not None and isinstance(out, torch.Tensor):
        setattr(out, TAG, tag)


def _tag_inner(tensor: torch.Tensor, tag: tuple[int, int, int]) -> None:
    """Give a wrapper subclass's inner tensors its tag (a DTensor's local shard).

    The modes see a DTensor's ops at the DTensor level, but autograd saves what
    the code after them computes on: tensor-parallel layers hand out the local
    shard (``to_local``), which no recorded op returned. Tagged, a saved shard
    is the output of the DTensor op that made it, and the policy's decision for
    that op applies to it. A tag this log gave before stays (an aliasing op may
    hand out an input's shard).
    """
    if type(tensor) is torch.Tensor or not is_traceable_wrapper_subclass(tensor):
        return
    names, _ = tensor.__tensor_flatten__()
    for name in names:
        inner = getattr(tensor, name, None)
        if not isinstance(inner, torch.Tensor):
            continue
        existing = getattr(inner, TAG, None)
        if existing is None or existing[0] != tag[0]:
            setattr(inner, TAG, tag)


def storage_address(t: torch.Tensor) -> int:
    """The address of ``t``'s storage; 0 when it has none (sparse, nested, a zero tensor).

    A wrapper subclass (``_make_wrapper_subclass``, ``__torch_dispatch__``) has a
    storage with no data pointer (touching it raises): a traceable one is
    identified by its first inner tensor, which its in-place ops write to; any
    other one has no address.
    """
    if t.layout is not torch.strided or t.is_nested or t._is_zerotensor():
        return 0
    if type(t) is not torch.Tensor and _is_wrapper_subclass(t):
        if is_traceable_wrapper_subclass(t):
            names, _ = t.__tensor_flatten__()
            inner = getattr(t, names[0], None) if names else None
            return storage_address(inner) if isinstance(inner, torch.Tensor) else 0
        return 0
    return int(t.untyped_storage().data_ptr())


def _is_wrapper_subclass(t: torch.Tensor) -> bool:
    # Only Python subclasses with their own ``__torch_dispatch__`` carry the Python
    # dispatch key; a plain subclass (``nn.Parameter``) has a real storage.
    return torch._C._dispatch_keys(t).has(torch._C.DispatchKey.Python)


def physical(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor under every functorch wrapper of ``t``.

    Python code under vmap/grad sees wrapper tensors; the modes tag the physical ones.
    """
    functorch = torch._C._functorch
    while functorch.is_functorch_wrapped_tensor(t):
        t = functorch.get_unwrapped(t)
    return t


def detached_alias(t: torch.Tensor) -> torch.Tensor:
    """A detached alias that shares ``t``'s version counter, usable below autograd.

    Inside ``__torch_dispatch__`` the ADInplaceOrView key is excluded, and a
    plain ``detach`` there would get a fresh version counter; then neither our
    mutation check nor autograd's would see in-place writes to the alias.
    """
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        return t.detach()


@dataclasses.dataclass(slots=True)
class OpRecord:
    """One op of a region's forward: what it was and what the policy decided."""

    op: Any
    verdict: Hashable
    decision: Decision
    #: Position in the log.
    index: int = -1
    #: Kept outputs by position (detached aliases), None where not kept.
    kept: list[torch.Tensor | None] | None = None
    #: Version of each kept output when it was kept (a mismatch means it was mutated).
    versions: list[int] | None = None
    #: Decisions that `checkpoint_name` set for single outputs, by position.
    named: dict[int, tuple[str, Decision]] | None = None
    #: Indices of the records that produced this op's tensor inputs (NOTE rule 5).
    inputs: tuple[int, ...] = ()
    #: (shape, stride, dtype) of each output, to stand in for a dead op.
    metas: tuple[tuple[Any, ...], ...] = ()
    #: The op's Python-number arguments: the recompute must pass the same (a
    #: function reading Python state that changed since would compute else).
    scalars: tuple[Any, ...] = ()
    #: Runs in the recompute whatever reads it (NOTE rule 5).
    always_live: bool = False
    #: Outputs kept only until the forward ends, in case `checkpoint_name` saves one.
    tentative: bool = False
    #: (shape, dtype) of the op's tensor arguments, for ops that may be replayed:
    #: a replayed op must get the forward's shapes (NOTE rule 6).
    input_shapes: tuple[Any, ...] | None = None

    def decision_at(self, position: int) -> Decision:
        if self.named is not None and position in self.named:
            return self.named[position][1]
        return self.decision

    def keep(self, position: int, tensor: torch.Tensor, count: int) -> None:
        if self.kept is None:
            self.kept = [None] * count
            self.versions = [0] * count
        assert self.versions is not None, "this is a bug in remat, please report it"
        self.kept[position] = detached_alias(tensor)
        self.versions[position] = tensor._version

    def release(self) -> None:
        self.kept = None
        self.versions = None

    def hold(self, position: int, value: torch.Tensor) -> None:
        """Hold ``value`` at ``position`` as is: an offload placeholder or a fetched copy."""
        assert self.kept is not None and self.versions is not None, (
            "this is a bug in remat, please report it"
        )
        self.kept[position] = value
        self.versions[position] = value._version

    def mark_mutated(self, position: int) -> None:
        """Make a kept output unreplayable: no tensor has version -1."""
        if self.versions is not None:
            self.versions[position] = -1

    def fully_replayable(self) -> bool:
        return self.replay_state()[1]

    def replayable(self) -> list[torch.Tensor | None] | None:
        """The kept outputs if none was mutated since, else None."""
        return self.replay_state()[0]

    def replay_state(self) -> tuple[list[torch.Tensor | None] | None, bool]:
        """`replayable` and whether every output is kept, in one pass (a hot path)."""
        kept, versions = self.kept, self.versions
        if kept is None or versions is None:
            return None, False
        full = True
        for tensor, version in zip(kept, versions, strict=True):
            if tensor is None:
                full = False
            elif tensor._version != version:
                return None, False
        return kept, full


class OpLog:
    """The record of one forward of one region."""

    def __init__(self, policy: Policy, label: str) -> None:
        self.policy = policy
        self.label = label
        self.serial = next(_serials)
        self.records: list[OpRecord] = []
        #: Regions that ran inside this one: (first op, end op, producers of their inputs).
        self.regions: list[tuple[int, int, tuple[int, ...]]] = []
        #: Kept outputs by storage address: an in-place write through any alias of
        #: one (even an alias with its own version counter) makes it unreplayable.
        self.kept_storages: dict[int, list[tuple[OpRecord, int]]] = {}
        #: Every ``checkpoint_name`` given in this forward (NOTE [ Names that match nothing ]).
        self.names_seen: set[str] = set()

    def record(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        index = len(self.records)
        outputs = _flat_tensors(out)
        traits = _traits(op)
        if traits.fsdp:
            raise _fsdp_inside(self.label, op)
        if traits.writes:
            self._invalidate_written(traits, args, kwargs)
        # An op run under ``torch.inference_mode()`` inside the region makes
        # inference tensors: constants with no version counter, which autograd
        # never saves. They are not kept (NOTE rule 4): the recompute makes them again.
        effectful = (
            traits.writes
            or _draws_random(traits, args, kwargs)
            or any(t.is_inference() for t in outputs)
        )
        if effectful:
            verdict: Hashable = None
            decision = Decision.RECOMPUTE
        else:
            verdict = self.policy.decide_record(index, op, args, kwargs)
            decision = self.policy.decide(verdict, None)
        rec = OpRecord(op, verdict, decision, index)
        rec.inputs, rec.scalars = _scan(args, kwargs, self.serial)
        rec.metas = tuple([(t.shape, t.stride(), t.dtype) for t in outputs])
        rec.always_live = effectful or traits.reads_data
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
        for position, tensor in enumerate(outputs):
            setattr(tensor, TAG, (self.serial, index, position))
            _tag_inner(tensor, (self.serial, index, position))
            if decision is not Decision.RECOMPUTE or rec.tentative:
                self._keep(rec, position, tensor)

    def _keep(self, rec: OpRecord, position: int, tensor: torch.Tensor) -> None:
        rec.keep(position, tensor, len(rec.metas))
        address = storage_address(tensor)
        if address:
            self.kept_storages.setdefault(address, []).append((rec, position))

    def _invalidate_written(
        self, traits: _Traits, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        for tensor in _written(traits, args, kwargs):
            for rec, position in self.kept_storages.get(storage_address(tensor), ()):
                rec.mark_mutated(position)

    def _producers(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, ...]:
        return _scan(args, kwargs, self.serial)[0]

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
        tag = getattr(tensor, TAG, None)
        if tag is None or tag[0] != self.serial:
            return None
        return self.records[tag[1]], tag[2]

    def name(self, tensor: torch.Tensor, name: str) -> None:
        """Apply the policy's decision for a value tagged ``name``."""
        self.names_seen.add(name)
        tensor = physical(tensor)
        found = self.lookup(tensor)
        if found is None:
            return  # a region input or a closed-over tensor: kept anyway
        rec, position = found
        if rec.always_live and rec.decision is Decision.RECOMPUTE and rec.verdict is None:
            return  # random or in-place: never kept, see NOTE rule 4
        decision = self.policy.decide(rec.verdict, name)
        if rec.named is None:
            rec.named = {}
        rec.named[position] = (name, decision)
        if decision is not Decision.RECOMPUTE:
            rec.tentative = False  # keep the siblings with it
        if decision is Decision.RECOMPUTE:
            if rec.kept is not None:
                rec.kept[position] = None
        else:
            # Called from user code: Python-level modes (the torch.func engine's
            # hidden-tensor guard) must not see remat's own bookkeeping, nor may a
            # live functorch level (the recorded forward's inner vjp): detaching
            # under it would keep a wrapper of a level that dies with the forward.
            with torch._C.DisableTorchFunction(), torch._C._DisableFuncTorch():
                self._keep(rec, position, tensor)

    def end_forward(self) -> None:
        """Release the outputs kept only in case a name would save them."""
        for rec in self.records:
            if rec.tentative:
                rec.release()
                rec.tentative = False

    def op_names(self) -> list[str]:
        return [str(rec.op) for rec in self.records]


_DATA_READERS = frozenset(
    getattr(torch.ops.aten, name)
    for name in ("_local_scalar_dense", "item", "nonzero", "equal", "is_nonzero", "allclose")
    if hasattr(torch.ops.aten, name)
)
_DATA_TAGS = tuple(
    getattr(torch.Tag, name)
    for name in ("data_dependent_output", "dynamic_output_shape")
    if hasattr(torch.Tag, name)
)


def _written(traits: _Traits, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors an in-place or ``out=`` op writes to."""
    written = []
    for position, name, kwarg_only in traits.written:
        if name in kwargs:
            value = kwargs[name]
        elif position < len(args) and not kwarg_only:
            value = args[position]
        else:
            continue
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(item, torch.Tensor):
                written.append(item)
    return written


@dataclasses.dataclass(frozen=True, slots=True)
class _Traits:
    """What the modes need to know about an op, computed once per op (a hot path)."""

    writes: bool
    random: bool
    #: Position of a ``dropout_p`` argument: the op draws only when it is non-zero.
    dropout_p: int | None
    #: Python may read its result (``item()``, data-dependent shapes).
    reads_data: bool
    view: bool
    #: Arguments the op writes to: (position, name, keyword-only).
    written: tuple[tuple[int, str, bool], ...]
    #: How `_rebuild` packs replayed outputs: a tensor, a list or a tuple.
    returns: str
    #: An FSDP2 op (NOTE rule 7).
    fsdp: bool


_TRAITS: dict[Any, _Traits] = {}


def _traits(op: Any) -> _Traits:
    found = _TRAITS.get(op)
    if found is None:
        found = _TRAITS[op] = _compute_traits(op)
    return found


def _compute_traits(op: Any) -> _Traits:
    names = [argument.name for argument in op._schema.arguments]
    tags = getattr(op, "tags", ())
    returns_data = any(
        "Tensor" not in str(ret.type) for ret in op._schema.returns
    )  # a Python scalar or bool
    return _Traits(
        writes=_ops.is_inplace_or_out(op),
        random=_ops.is_random(op),
        dropout_p=names.index("dropout_p") if "dropout_p" in names else None,
        reads_data=returns_data
        or getattr(op, "overloadpacket", None) in _DATA_READERS
        or any(tag in tags for tag in _DATA_TAGS),
        view=_ops.is_view(op),
        written=tuple(
            (position, argument.name, bool(argument.kwarg_only))
            for position, argument in enumerate(op._schema.arguments)
            if argument.alias_info is not None and argument.alias_info.is_write
        ),
        returns=_return_kind(op),
        fsdp=getattr(op, "namespace", None) == "fsdp",
    )


def _fsdp_inside(label: str, op: Any) -> RematError:
    """The error for an FSDP2 unit inside a region that records ops (NOTE rule 7)."""
    return RematError(
        f"remat: {label} runs a fully_shard (FSDP2) module inside it ({op} is FSDP's "
        f"parameter all-gather), and its policy records ops: the recompute would "
        f"replay FSDP's gathers, which differ in backward. Make each fully_shard unit "
        f"a region of its own (remat.wrap the block, then fully_shard it, or the other "
        f"way around), or use policy='nothing-saveable' (without debug=True) for this "
        f"region."
    )


def _return_kind(op: Any) -> str:
    returns = op._schema.returns
    if len(returns) == 1 and str(returns[0].type) == "Tensor":
        return "tensor"
    if len(returns) == 1 and "[]" in str(returns[0].type):
        return "list"
    return "tuple"


def _draws_random(traits: _Traits, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether this call draws random numbers.

    Attention kernels are tagged random because of their ``dropout_p``
    argument; with ``dropout_p == 0`` they draw nothing and may be kept.
    """
    if not traits.random:
        return False
    if traits.dropout_p is None:
        return True
    position = traits.dropout_p
    return bool(kwargs.get("dropout_p", args[position] if position < len(args) else 0.0))


_NUMBERS = (bool, int, float, complex)


def _scalars(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The Python numbers among an op's arguments (NaN as a string, so it equals itself)."""
    found: list[Any] = []
    for arg in itertools.chain(args, kwargs.values()) if kwargs else args:
        if isinstance(arg, _NUMBERS):
            found.append("nan" if arg != arg else arg)
    return tuple(found)


def _scan(
    args: tuple[Any, ...], kwargs: dict[str, Any], serial: int
) -> tuple[tuple[int, ...], tuple[Any, ...]]:
    """`OpRecord.inputs` (producers in the log ``serial``) and `_scalars`, in one pass."""
    producers: list[int] = []
    scalars: list[Any] = []
    for arg in itertools.chain(args, kwargs.values()) if kwargs else args:
        if isinstance(arg, torch.Tensor):
            _add_producer(producers, arg, serial)
        elif isinstance(arg, (list, tuple)):
            for item in arg:
                if isinstance(item, torch.Tensor):
                    _add_producer(producers, item, serial)
        elif isinstance(arg, _NUMBERS):
            scalars.append("nan" if arg != arg else arg)
    return tuple(producers), tuple(scalars)


def _add_producer(producers: list[int], t: torch.Tensor, serial: int) -> None:
    tag = getattr(t, TAG, None)
    if tag is None and type(t) is not torch.Tensor and is_traceable_wrapper_subclass(t):
        # A DTensor made from a local tensor (``DTensor.from_local``, which a
        # row-parallel layer runs on its input) depends on that tensor's producer.
        names, _ = t.__tensor_flatten__()
        for name in names:
            _add_producer(producers, getattr(t, name), serial)
        return
    if tag is not None and tag[0] == serial:
        producers.append(tag[1])


def _flat_tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for t in out if isinstance(t, torch.Tensor)]
    return []


class RecordMode(TorchDispatchMode):
    """Record every op of a region's forward into an `OpLog` (see NOTE rule 1)."""

    def __init__(self, log: OpLog) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.log = log

    def __enter__(self) -> RecordMode:
        local.recorders.append(self)
        try:
            super().__enter__()  # type: ignore[no-untyped-call]
        except BaseException:
            local.recorders.pop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            super().__exit__(*exc)  # type: ignore[no-untyped-call]
        finally:
            local.recorders.remove(self)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is _DETACH:
            _inherit_tag(args[0], out)
        else:
            self.log.record(func, args, kwargs, out)
        return out


class ReplayMode(TorchDispatchMode):
    """Recompute a region, returning kept outputs instead of running their ops."""

    def __init__(self, log: OpLog, check: bool = True, live: list[bool] | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.log = log
        self.check = check
        self.live = live
        self.index = 0
        # The ops the recompute ran, for error messages. While every op matches
        # the forward (``check``) they are the forward's first ``index`` ops, so
        # they are listed only once one did not (or when nothing checks them).
        self._ran: list[Any] | None = None if check else []

    @property
    def ran(self) -> list[Any]:
        """The ops the recompute ran so far (``detach`` aside)."""
        if self._ran is not None:
            return self._ran
        return [rec.op for rec in self.log.records[: self.index]]

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is _DETACH:
            return func(*args, **kwargs)
        index = self.index
        self.index += 1
        records = self.log.records
        rec = records[index] if index < len(records) else None
        if self._ran is not None:
            self._ran.append(func)
        if rec is None or rec.op != func:
            if self.check or rec is not None:  # rule 6: a misplaced replay is garbage
                raise self.mismatch(index, func)
        elif self.check:
            scalars = _scalars(args, kwargs)
            if rec.scalars != scalars:
                raise self.mismatch(index, func, rec.scalars, scalars)
        if rec is None:
            return func(*args, **kwargs)
        kept, full = rec.replay_state()
        if full:
            assert kept is not None, "this is a bug in remat, please report it"
            if rec.input_shapes is not None and rec.input_shapes != arg_shapes(args, kwargs):
                # Rule 6: the forward's outputs for other inputs would be garbage.
                raise divergence(
                    self.log.label,
                    f"op #{index} ({func}) got tensors of shapes "
                    f"{_shape_list(rec.input_shapes)} in the forward and "
                    f"{_shape_list(arg_shapes(args, kwargs))} in the recompute",
                )
            return _rebuild(func, _detached_aliases(kept))
        if self.live is not None and not self.live[index] and not _traits(func).view:
            return _rebuild(func, [_stand_in(meta) for meta in rec.metas])
        out = func(*args, **kwargs)
        if kept is not None:
            out = _substitute(out, kept)
        return out

    def mismatch(
        self, index: int, func: Any, forward_scalars: Any = None, recompute_scalars: Any = None
    ) -> NondeterministicRecomputeError:
        if self._ran is None:
            # The ops before ``index`` matched the forward's; from here on, list each.
            self._ran = [rec.op for rec in self.log.records[:index]] + [func]
        forward = self.log.op_names()
        expected = forward[index] if index < len(forward) else "(the forward had ended)"
        if forward_scalars is None:
            what = f"the forward ran {expected}, the recompute ran {func}"
        else:
            what = (
                f"{func} got the numbers {forward_scalars} in the forward and "
                f"{recompute_scalars} in the recompute (Python state it reads changed)"
            )
        # determinism_check=False is no cure: it skips only the numbers' comparison.
        return NondeterministicRecomputeError(
            f"remat: the recompute of {self.log.label} differs from its forward at op "
            f"#{index}: {what}. Its gradients would be wrong. {CURES}\n"
            + side_by_side(forward, [str(f) for f in self.ran])
        )


def _shape_list(shapes: tuple[Any, ...]) -> str:
    return "[" + ", ".join(str(tuple(shape)) for shape, _ in shapes) + "]"


def _stand_in(meta: tuple[Any, ...]) -> torch.Tensor:
    """A meta tensor shaped like a dead op's output; nothing live reads it.

    On the meta device it costs nothing, and Python reading it without an op
    (``tolist()``, ``numpy()``) or a stand-in escaping into Python state fails
    loudly instead of passing garbage on.
    """
    shape, stride, dtype = meta
    return torch.empty_strided(shape, stride, dtype=dtype, device="meta")


def _rebuild(func: Any, tensors: list[torch.Tensor]) -> Any:
    kind = _traits(func).returns
    if kind == "tensor":
        return tensors[0]
    if kind == "list":
        return list(tensors)
    return tuple(tensors)


def _detached_aliases(kept: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """`detached_alias` of each kept output, under one guard (a hot path)."""
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        return [t.detach() for t in kept if t is not None]


def _substitute(out: Any, kept: list[torch.Tensor | None]) -> Any:
    if isinstance(out, torch.Tensor):
        return detached_alias(kept[0]) if kept and kept[0] is not None else out
    items = list(out)
    position = 0
    for i, item in enumerate(items):
        if isinstance(item, torch.Tensor):
            replacement = kept[position] if position < len(kept) else None
            if replacement is not None:
                items[i] = detached_alias(replacement)
            position += 1
    return type(out)(items) if isinstance(out, tuple) else items


def side_by_side(forward: list[str], recompute: list[str], limit: int = 40) -> str:
    """Format the forward and recompute op logs in two columns, marking the first difference."""
    width = max((len(s) for s in forward[:limit]), default=10) + 2
    lines = [f"    {'forward':<{width}}recompute"]
    marked = False
    for i in range(min(max(len(forward), len(recompute)), limit)):
        left = forward[i] if i < len(forward) else "-"
        right = recompute[i] if i < len(recompute) else "-"
        mark = "  "
        if not marked and left != right:
            mark, marked = "->", True
        lines.append(f"{mark}{i:>3} {left:<{width}}{right}")
    return "\n".join(lines)
