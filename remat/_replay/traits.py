"""What the record and replay modes need to know about an op, computed once per op.

Which ops write to their arguments, draw random numbers, let Python read their
result, or are views (NOTE [ Record and replay ] rules 4 and 5, in
``_replay/records.py``), and the small argument scans both modes share.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import torch

from .._compat import is_traceable_wrapper_subclass
from .._errors import RematError
from .._policy import ops as _ops
from .tags import TAG

__all__ = [
    "NUMBERS",
    "Traits",
    "draws_random",
    "flat_tensors",
    "fsdp_inside",
    "scan_args",
    "scalars_of",
    "traits",
    "written_by",
]

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


def written_by(
    op_traits: Traits, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[torch.Tensor]:
    """The tensors an in-place or ``out=`` op writes to."""
    written = []
    for position, name, kwarg_only in op_traits.written:
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
class Traits:
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


#: id(op) -> (op, its traits). Keyed by id: an ``OpOverload`` hashes in Python (a
#: call per lookup, on every recorded and replayed op). The entry holds the op, so
#: its id is not reused while the entry lives; the identity check says so anyway.
_TRAITS: dict[int, tuple[Any, Traits]] = {}


def traits(op: Any) -> Traits:
    found = _TRAITS.get(id(op))
    if found is not None and found[0] is op:
        return found[1]
    computed = _compute_traits(op)
    _TRAITS[id(op)] = (op, computed)
    return computed


def _compute_traits(op: Any) -> Traits:
    names = [argument.name for argument in op._schema.arguments]
    tags = getattr(op, "tags", ())
    returns_data = any(
        "Tensor" not in str(ret.type) for ret in op._schema.returns
    )  # a Python scalar or bool
    return Traits(
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


def _return_kind(op: Any) -> str:
    returns = op._schema.returns
    if len(returns) == 1 and str(returns[0].type) == "Tensor":
        return "tensor"
    if len(returns) == 1 and "[]" in str(returns[0].type):
        return "list"
    return "tuple"


def draws_random(op_traits: Traits, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether this call draws random numbers.

    Attention kernels are tagged random because of their ``dropout_p``
    argument; with ``dropout_p == 0`` they draw nothing and may be kept.
    """
    if not op_traits.random:
        return False
    if op_traits.dropout_p is None:
        return True
    position = op_traits.dropout_p
    return bool(kwargs.get("dropout_p", args[position] if position < len(args) else 0.0))


NUMBERS = (bool, int, float, complex)


def scalars_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The Python numbers among an op's arguments (NaN as a string, so it equals itself)."""
    found: list[Any] = []
    for arg in itertools.chain(args, kwargs.values()) if kwargs else args:
        if isinstance(arg, NUMBERS):
            found.append("nan" if arg != arg else arg)
    return tuple(found)


def flat_tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for t in out if isinstance(t, torch.Tensor)]
    return []


def scan_args(
    args: tuple[Any, ...], kwargs: dict[str, Any], serial: int,
    inputs: frozenset[int] = frozenset(),
) -> tuple[tuple[int, ...], tuple[Any, ...], bool]:
    """The producers of an op's tensor arguments in the log ``serial`` (by op index), its
    Python numbers (`scalars_of`), and whether it reads a tensor no op of that log made
    that is one of ``inputs`` (ids of the region's inputs) or requires grad (a
    parameter, a closed-over tensor), in one pass (a hot path)."""
    producers: list[int] = []
    scalars: list[Any] = []
    outside = False
    for arg in itertools.chain(args, kwargs.values()) if kwargs else args:
        if isinstance(arg, torch.Tensor):
            outside = (
                not _add_producer(producers, arg, serial)
                and (arg.requires_grad or id(arg) in inputs)
            ) or outside
        elif isinstance(arg, (list, tuple)):
            for item in arg:
                if isinstance(item, torch.Tensor):
                    outside = (
                        not _add_producer(producers, item, serial)
                        and (item.requires_grad or id(item) in inputs)
                    ) or outside
        elif isinstance(arg, NUMBERS):
            scalars.append("nan" if arg != arg else arg)
    return tuple(producers), tuple(scalars), outside


def _add_producer(producers: list[int], t: torch.Tensor, serial: int) -> bool:
    """Add the producer of ``t`` in the log ``serial``; False if no op of it made ``t``."""
    tag = getattr(t, TAG, None)  # an OpTag, read by index: a hot path
    if tag is None and type(t) is not torch.Tensor and is_traceable_wrapper_subclass(t):
        # A DTensor made from a local tensor (``DTensor.from_local``, which a
        # row-parallel layer runs on its input) depends on that tensor's producer.
        names, _ = t.__tensor_flatten__()
        found = True
        for name in names:
            found = _add_producer(producers, getattr(t, name), serial) and found
        return found
    if tag is not None and tag[0] == serial:
        producers.append(tag[1])
        return True
    return False


def fsdp_inside(label: str, op: Any) -> RematError:
    """The error for an FSDP2 unit inside a region that records ops (NOTE rule 7)."""
    return RematError(
        f"remat: {label} runs a fully_shard (FSDP2) module inside it ({op} is FSDP's "
        f"parameter all-gather), and its policy records ops: the recompute would "
        f"replay FSDP's gathers, which differ in backward. Make each fully_shard unit "
        f"a region of its own (remat.wrap the block, then fully_shard it, or the other "
        f"way around), or use policy='nothing-saveable' (without debug=True) for this "
        f"region."
    )

