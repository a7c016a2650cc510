"""Policies: what a rematerialized region keeps for the backward pass.

A policy decides, for each operation that runs inside a region, what happens to
its output in the backward pass (:class:`Decision`). Policies are frozen
dataclasses: they print as what they are, compare by value and hash, so they can
be used as cache keys.

NOTE [ How a policy is asked ]
1. For each aten op the region runs, the engine calls ``decide_op(op, args,
   kwargs)`` once, in the forward pass, and keeps the *verdict* it returns (any
   hashable value; for simple policies a :class:`Decision`).
2. The decision for an output is ``decide(verdict, name)``, where ``name`` is the
   ``checkpoint_name`` the value was tagged with, or ``None``. Names are applied
   after the op ran, which is why the verdict is kept: a combined policy needs
   each part's verdict to decide a named value exactly.
3. Policies whose decision never depends on the op (``uses_ops`` false) and on
   names (``uses_names`` false) are asked once, with ``op=None``; the engine then
   runs the region without a per-op dispatch mode, which is what makes
   ``nothing_saveable`` as cheap as ``torch.utils.checkpoint``.

NOTE [ Names override the op's decision ]
1. ``decide(verdict, None)`` is the decision for the op's output.
2. A value tagged with a ``checkpoint_name`` may get another decision:
   ``save_only_these_names("a")`` saves values named "a" and nothing else;
   ``save_anything_except_these_names("a")`` saves every output except the
   values named "a".
3. ``save_from_both_policies(a, b)`` keeps a value if either part keeps it: its
   verdict is the pair of the parts' verdicts and its decision is the ``max`` of
   the parts' decisions for the same name.
"""

from __future__ import annotations

import abc
import dataclasses
import difflib
import enum
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, TypeAlias

import torch
import torch.utils.checkpoint

from remat import _ops

__all__ = [
    "PolicyLike",
    "Decision",
    "Policy",
    # policy objects
    "everything_saveable",
    "nothing_saveable",
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
    "checkpoint_dots",
    "checkpoint_dots_with_no_batch_dims",
    "offload_dots",
    "save_last",
    # factories
    "offload_dot_with_no_batch_dims",
    "save_only_these_names",
    "save_any_names_but_these",
    "save_anything_except_these_names",
    "save_and_offload_only_these_names",
    "save_from_both_policies",
    "save_these_ops",
    "from_callable",
    "from_selective_checkpoint",
    # strings
    "resolve",
    "register",
    "names",
    # classes
    "EverythingSaveable",
    "NothingSaveable",
    "Dots",
    "SaveLast",
    "SaveOnlyTheseNames",
    "SaveAnyNamesButThese",
    "SaveAnythingExceptTheseNames",
    "SaveAndOffloadOnlyTheseNames",
    "SaveFromBothPolicies",
    "SaveTheseOps",
    "FromCallable",
    "FromSelectiveCheckpoint",
]


class Decision(enum.IntEnum):
    """What happens to one value in the backward pass.

    Ordered so that ``max`` combines decisions: ``SAVE`` wins over ``OFFLOAD``,
    which wins over ``RECOMPUTE``.

    >>> max(Decision.RECOMPUTE, Decision.SAVE)
    <Decision.SAVE: 2>
    """

    RECOMPUTE = 0
    OFFLOAD = 1
    SAVE = 2


class Policy(abc.ABC):
    """Base class of every policy. Subclasses are frozen dataclasses."""

    #: True when ``decide_op`` looks at the op (the engine then needs a dispatch mode).
    uses_ops: bool = False
    #: True when ``decide`` can give a named value another decision than its op's.
    uses_names: bool = False
    #: True for ``save_last``: the most recent region keeps every output.
    keeps_last_region: bool = False
    #: Where ``OFFLOAD`` decisions send values ("cpu": pinned host memory).
    offload_dst: str = "cpu"

    @abc.abstractmethod
    def decide_op(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
        """Return this policy's verdict on one op (``op`` is None when ``uses_ops`` is false)."""

    @abc.abstractmethod
    def decide(self, verdict: Hashable, name: str | None) -> Decision:
        """Return the decision for an output given its op's verdict and its name."""

    def decision_without_ops(self) -> Decision:
        """The constant decision of a policy that looks at neither ops nor names."""
        return self.decide(self.decide_op(None, (), {}), None)

    @property
    def keeps_everything(self) -> bool:
        """Whether the policy keeps every output: a region then runs as plain autograd."""
        if self.needs_op_trace or self.keeps_last_region:
            return False
        return self.decision_without_ops() is not Decision.RECOMPUTE

    @property
    def needs_op_trace(self) -> bool:
        """Whether the engine must see every op (a dispatch mode) to apply this policy."""
        return self.uses_ops or self.uses_names

    def __add__(self, other: object) -> Policy:
        """``a + b`` is ``save_from_both_policies(a, b)``; ``b`` may be a policy string."""
        if isinstance(other, Policy | str):
            return save_from_both_policies(self, resolve(other))
        return NotImplemented

    def __radd__(self, other: object) -> Policy:
        if isinstance(other, Policy | str):
            return save_from_both_policies(resolve(other), self)
        return NotImplemented


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------

_OFFLOAD_DSTS = {"cpu": "cpu", "pinned_host": "cpu"}


#: Everything `resolve` accepts: a `Policy`, a name or pattern string, a callable
#: ``fn(op, *args, **kwargs) -> bool | Decision``, or a sequence of aten ops to save.
PolicyLike: TypeAlias = "Policy | str | Callable[..., bool | Decision] | Sequence[Any]"


def _check_dst(api: str, offload_dst: object) -> str:
    if not isinstance(offload_dst, str) or offload_dst not in _OFFLOAD_DSTS:
        raise ValueError(
            f"remat.policies.{api}: unknown offload_dst {offload_dst!r}; use 'cpu' "
            "(or JAX's name 'pinned_host'), which moves values to pinned host memory."
        )
    return _OFFLOAD_DSTS[offload_dst]


def _check_names(api: str, names: Iterable[object]) -> tuple[str, ...]:
    if isinstance(names, str):
        raise TypeError(
            f"remat.policies.{api}: expected a sequence of names, got the string {names!r}; "
            f"write ({names!r},) for a single name."
        )
    out = []
    for name in names:
        if not isinstance(name, str):
            raise TypeError(
                f"remat.policies.{api}: names must be strings, got {name!r} "
                f"({type(name).__name__})."
            )
        out.append(name)
    # Sorted and deduplicated, so that the order names are given in does not matter.
    return tuple(sorted(set(out)))


def _names_repr(names: tuple[str, ...]) -> str:
    return ", ".join(repr(n) for n in names)


def _fn_repr(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


# ---------------------------------------------------------------------------
# Constant policies
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, repr=False)
class EverythingSaveable(Policy):
    """Save every output (same memory as no remat)."""

    def decide_op(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
        return Decision.SAVE

    def decide(self, verdict: Hashable, name: str | None) -> Decision:
        return Decision.SAVE

    def __repr__(self) -> str:
        return "everything_saveable"


@dataclasses.dataclass(frozen=True, repr=False)
class NothingSaveable(Policy):
    """Save nothing but the region's inputs (the default)."""

    def decide_op(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
        return Decision.RECOMPUTE

    def decide(self, verdict: Hashable, name: str | None) -> Decision:
        return Decision.RECOMPUTE

    def __repr__(self) -> str:
        return "nothing_saveable"


@dataclasses.dataclass(frozen=True, repr=False)
class SaveLast(Policy):
    """Keep every output of the most recent region; recompute the others."""

    keeps_last_region = True

    def decide_op(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
        return Decision.RECOMPUTE

    def decide(self, verdict: Hashable, name: str | None) -> Decision:
        return Decision.RECOMPUTE

    def __repr__(self) -> str:
        return "save_last"


#: Save every output (same memory as no remat).
everything_saveable: Policy = EverythingSaveable()
#: Save nothing but the region's inputs (the default).
nothing_saveable: Policy = NothingSaveable()
#: Keep all outputs of the most recently executed region; every other region recomputes.
save_last: Policy = SaveLast()


# ---------------------------------------------------------------------------
# Dots
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, repr=False)
class Dots(Policy):
    """Give the outputs of matmul-like ops ``decision``; recompute everything else.

    Args:
        batch_dims (bool): also match batched dots (``bmm``, convolutions,
            attention kernels), not only ``mm``/``addmm``-like ones. Default: True.
        decision (Decision): ``SAVE`` or ``OFFLOAD``. Default: ``SAVE``.
        offload_dst (str): where ``OFFLOAD`` sends values. Default: "cpu".
    """

    batch_dims: bool = True
    decision: Decision = Decision.SAVE
    offload_dst: str = "cpu"

    uses_ops = True

    def __post_init__(self) -> None:
        if self.decision not in (Decision.SAVE, Decision.OFFLOAD):
            raise ValueError(
                f"remat.policies.Dots: decision must be Decision.SAVE or Decision.OFFLOAD, "
                f"got {self.decision!r}."
            )
        object.__setattr__(self, "decision", Decision(self.decision))
        object.__setattr__(self, "offload_dst", _check_dst("Dots", self.offload_dst))

    def decide_op(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
        hit = _ops.is_dot(op) if self.batch_dims else _ops.is_dot_without_batch_dims(op)
        return self.decision if hit else Decision.RECOMPUTE

    def decide(self, verdict: Hashable, name: str | None) -> Decision:
        assert isinstance(verdict, Decision), "this is a bug in remat, please report it"
        return verdict

    def __repr__(self) -> str:
        if self.decision is Decision.SAVE:
            return "dots_saveable" if self.batch_dims else "dots_with_no_batch_dims_saveable"
        if self.batch_dims:
            return "offload_dots"
        return f"offload_dot_with_no_batch_dims(offload_dst={self.offload_dst!r})"


#: Save the outputs of matmuls, convolutions and attention kernels.
dots_saveable: Policy = Dots()
#: Save the outputs of dots without batch dimensions (``mm``, ``addmm``; every ``Linear``).
dots_with_no_batch_dims_saveable: Policy = Dots(batch_dims=False)
#: JAX's old name of :data:`dots_saveable`.
checkpoint_dots: Policy = dots_saveable
#: JAX's old name of :data:`dots_with_no_batch_dims_saveable`.
checkpoint_dots_with_no_batch_dims: Policy = dots_with_no_batch_dims_saveable
#: Like :data:`dots_saveable`, but offload the dots' outputs to pinned host memory.
offload_dots: Policy = Dots(decision=Decision.OFFLOAD)


def offload_dot_with_no_batch_dims(offload_dst: str = "cpu") -> Policy:
    """Offload the outputs of dots without batch dimensions; recompute everything else.

    Args:
        offload_dst (str, optional): "cpu" or "pinned_host" (the same: pinned host
            memory). Default: "cpu".

    Returns:
        Policy: the policy.

    Raises:
        ValueError: for another ``offload_dst``.

    >>> p = offload_dot_with_no_batch_dims()
    >>> p.decide(p.decide_op(torch.ops.aten.mm.default, (), {}), None)
    <Decision.OFFLOAD: 1>
    """
    dst = _check_dst("offload_dot_with_no_batch_dims", offload_dst)
    return Dots(batch_dims=False, decision=Decision.OFFLOAD, offload_dst=dst)


# ---------------------------------------------------------------------------
# Names
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, repr=False)
class SaveOnlyTheseNames(Policy):
    """Save only values named with one of ``names``."""

    names: tuple[str, ...]

    uses_names = True

    def decide_op(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
        return Decision.RECOMPUTE

    def decide(self, verdict: Hashable, name: str | None) -> Decision:
        return Decision.SAVE if name in self.names else Decision.RECOMPUTE

    def __repr__(self) -> str:
        return f"save_only_these_names({_names_repr(self.names)})"


@dataclasses.dataclass(frozen=True, repr=False)
class SaveAnyNamesButThese(Policy):
    """Save every named value except those named with one of ``names``."""

    names: tuple[str, ...]

    uses_names = True

    def decide_op(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
        return Decision.RECOMPUTE

    def decide(self, verdict: Hashable, name: str | None) -> Decision:
        if name is None or name in self.names:
            return Decision.RECOMPUTE
        return Decision.SAVE

    def __repr__(self) -> str:
        return f"save_any_names_but_these({_names_repr(self.names)})"


@dataclasses.dataclass(frozen=True, repr=False)
class SaveAnythingExceptTheseNames(Policy):
    """Save every output except values named with one of ``names``."""

    names: tuple[str, ...]

    uses_names = True

    def decide_op(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
        return Decision.SAVE

    def decide(self, verdict: Hashable, name: str | None) -> Decision:
        return Decision.RECOMPUTE if name in self.names else Decision.SAVE

    def __repr__(self) -> str:
        return f"save_anything_except_these_names({_names_repr(self.names)})"


@dataclasses.dataclass(frozen=True, repr=False)
class SaveAndOffloadOnlyTheseNames(Policy):
    """Save values with a name of the first set, offload those of the second."""

    names_which_can_be_saved: tuple[str, ...] = ()
    names_which_can_be_offloaded: tuple[str, ...] = ()
    offload_dst: str = "cpu"

    uses_names = True

    def decide_op(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
        return Decision.RECOMPUTE

    def decide(self, verdict: Hashable, name: str | None) -> Decision:
        if name in self.names_which_can_be_saved:
            return Decision.SAVE
        if name in self.names_which_can_be_offloaded:
            return Decision.OFFLOAD
        return Decision.RECOMPUTE

    def __repr__(self) -> str:
        return (
            "save_and_offload_only_these_names("
            f"names_which_can_be_saved={self.names_which_can_be_saved!r}, "
            f"names_which_can_be_offloaded={self.names_which_can_be_offloaded!r}, "
            f"offload_dst={self.offload_dst!r})"
        )


def save_only_these_names(*names: str) -> Policy:
    """Save only the values tagged with ``checkpoint_name`` under one of ``names``.

    Args:
        *names (str): the names to save.

    Returns:
        Policy: the policy.

    >>> p = save_only_these_names("b", "a")
    >>> p
    save_only_these_names('a', 'b')
    >>> p.decide(p.decide_op(None, (), {}), "a"), p.decide(p.decide_op(None, (), {}), None)
    (<Decision.SAVE: 2>, <Decision.RECOMPUTE: 0>)
    """
    return SaveOnlyTheseNames(_check_names("save_only_these_names", names))


def save_any_names_but_these(*names: str) -> Policy:
    """Save every named value except those tagged with one of ``names``.

    Unnamed values are recomputed.

    Args:
        *names (str): the names not to save.

    Returns:
        Policy: the policy.

    >>> p = save_any_names_but_these("a")
    >>> [p.decide(Decision.RECOMPUTE, n).name for n in ("a", "b", None)]
    ['RECOMPUTE', 'SAVE', 'RECOMPUTE']
    """
    return SaveAnyNamesButThese(_check_names("save_any_names_but_these", names))


def save_anything_except_these_names(*names: str) -> Policy:
    """Save every output except the values tagged with one of ``names``.

    Unlike JAX 0.10.2, whose version ignores its names, the named values are
    recomputed.

    Args:
        *names (str): the names to recompute.

    Returns:
        Policy: the policy.

    >>> p = save_anything_except_these_names("a")
    >>> [p.decide(p.decide_op(None, (), {}), n).name for n in ("a", "b", None)]
    ['RECOMPUTE', 'SAVE', 'SAVE']
    """
    return SaveAnythingExceptTheseNames(_check_names("save_anything_except_these_names", names))


def save_and_offload_only_these_names(
    *,
    names_which_can_be_saved: Iterable[str] = (),
    names_which_can_be_offloaded: Iterable[str] = (),
    offload_dst: str = "cpu",
) -> Policy:
    """Save the values with one set of names, offload those with another.

    Args:
        names_which_can_be_saved (Iterable[str], optional): names to save. Default: ().
        names_which_can_be_offloaded (Iterable[str], optional): names to offload.
            Default: ().
        offload_dst (str, optional): "cpu" or "pinned_host" (the same: pinned host
            memory). Default: "cpu".

    Returns:
        Policy: the policy.

    Raises:
        ValueError: when a name is in both sets, or for another ``offload_dst``.

    >>> p = save_and_offload_only_these_names(names_which_can_be_offloaded=["x"])
    >>> p.decide(Decision.RECOMPUTE, "x")
    <Decision.OFFLOAD: 1>
    """
    api = "save_and_offload_only_these_names"
    saved = _check_names(api, names_which_can_be_saved)
    offloaded = _check_names(api, names_which_can_be_offloaded)
    both = sorted(set(saved) & set(offloaded))
    if both:
        raise ValueError(
            f"remat.policies.{api}: names {both!r} are in both names_which_can_be_saved "
            "and names_which_can_be_offloaded; give each name to one of them."
        )
    return SaveAndOffloadOnlyTheseNames(saved, offloaded, _check_dst(api, offload_dst))


# ---------------------------------------------------------------------------
# Combining
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, repr=False)
class SaveFromBothPolicies(Policy):
    """Keep a value if either part keeps it (``SAVE`` > ``OFFLOAD`` > ``RECOMPUTE``)."""

    a: Policy
    b: Policy

    def __post_init__(self) -> None:
        for flag in ("uses_ops", "uses_names", "keeps_last_region"):
            object.__setattr__(self, flag, getattr(self.a, flag) or getattr(self.b, flag))
        if self.a.offload_dst != self.b.offload_dst:
            raise ValueError(
                "remat.policies.save_from_both_policies: the parts offload to different "
                f"places ({self.a.offload_dst!r} and {self.b.offload_dst!r}); use one offload_dst."
            )
        object.__setattr__(self, "offload_dst", self.a.offload_dst)

    def decide_op(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
        return (self.a.decide_op(op, args, kwargs), self.b.decide_op(op, args, kwargs))

    def decide(self, verdict: Hashable, name: str | None) -> Decision:
        assert isinstance(verdict, tuple), "this is a bug in remat, please report it"
        va, vb = verdict
        return max(self.a.decide(va, name), self.b.decide(vb, name))

    def __repr__(self) -> str:
        return f"save_from_both_policies({self.a!r}, {self.b!r})"


def save_from_both_policies(a: Policy, b: Policy) -> Policy:
    """Keep a value if either policy keeps it.

    ``SAVE`` wins over ``OFFLOAD``, which wins over ``RECOMPUTE`` (JAX's version
    raises on offload decisions; this one combines them). ``a + b`` is the same.

    Args:
        a (Policy): the first policy.
        b (Policy): the second policy.

    Returns:
        Policy: the combined policy.

    Raises:
        TypeError: when ``a`` or ``b`` is not a :class:`Policy`.

    >>> p = save_from_both_policies(save_anything_except_these_names("a"), dots_saveable)
    >>> p.decide(p.decide_op(torch.ops.aten.mm.default, (), {}), "a")
    <Decision.SAVE: 2>
    >>> p.decide(p.decide_op(torch.ops.aten.relu.default, (), {}), "a")
    <Decision.RECOMPUTE: 0>
    """
    for part in (a, b):
        if not isinstance(part, Policy):
            raise TypeError(
                "remat.policies.save_from_both_policies: expected two Policy objects, got "
                f"{part!r} ({type(part).__name__}); use remat.policies.resolve to make one."
            )
    return SaveFromBothPolicies(a, b)


# ---------------------------------------------------------------------------
# Ops and callables
# ---------------------------------------------------------------------------

_OpLike = torch._ops.OpOverload | torch._ops.OpOverloadPacket


@dataclasses.dataclass(frozen=True, repr=False)
class SaveTheseOps(Policy):
    """Save the outputs of the given ops (an ``OpOverloadPacket`` matches every overload)."""

    ops: frozenset[Any]

    uses_ops = True

    def decide_op(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
        if op in self.ops or getattr(op, "overloadpacket", None) in self.ops:
            return Decision.SAVE
        return Decision.RECOMPUTE

    def decide(self, verdict: Hashable, name: str | None) -> Decision:
        assert isinstance(verdict, Decision), "this is a bug in remat, please report it"
        return verdict

    def __repr__(self) -> str:
        return f"save_these_ops({', '.join(sorted(str(op) for op in self.ops))})"


def save_these_ops(*ops: torch._ops.OpOverload | torch._ops.OpOverloadPacket) -> Policy:
    """Save the outputs of the given aten ops; recompute everything else.

    Args:
        *ops (OpOverload | OpOverloadPacket): the ops; a packet (``torch.ops.aten.mm``)
            matches each of its overloads.

    Returns:
        Policy: the policy.

    Raises:
        TypeError: for anything that is not an op.

    >>> p = save_these_ops(torch.ops.aten.mm, torch.ops.aten.relu.default)
    >>> p
    save_these_ops(aten.mm, aten.relu.default)
    >>> p.decide(p.decide_op(torch.ops.aten.mm.out, (), {}), None)
    <Decision.SAVE: 2>
    """
    for op in ops:
        if not isinstance(op, _OpLike):
            raise TypeError(
                "remat.policies.save_these_ops: expected aten ops such as "
                f"torch.ops.aten.mm or torch.ops.aten.mm.default, got {op!r} "
                f"({type(op).__name__})."
            )
    return SaveTheseOps(frozenset(ops))


class _ByCallable(Policy):
    """Policies that wrap a callable: equal when they wrap the same object."""

    fn: Callable[..., Any]

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.fn is getattr(other, "fn", None)

    def __hash__(self) -> int:
        return hash((type(self), id(self.fn)))


@dataclasses.dataclass(frozen=True, repr=False, eq=False)
class FromCallable(_ByCallable):
    """Ask ``fn(op, *args, **kwargs) -> bool | Decision`` for every op."""

    fn: Callable[..., Any]

    uses_ops = True

    def decide_op(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
        result = self.fn(op, *args, **kwargs)
        if isinstance(result, Decision):
            return result
        if isinstance(result, bool):
            return Decision.SAVE if result else Decision.RECOMPUTE
        raise TypeError(
            f"remat.policies.from_callable: policy function {_fn_repr(self.fn)} returned "
            f"{result!r} ({type(result).__name__}) for {op}; it must return a bool "
            "(True to save) or a remat.policies.Decision."
        )

    def decide(self, verdict: Hashable, name: str | None) -> Decision:
        assert isinstance(verdict, Decision), "this is a bug in remat, please report it"
        return verdict

    def __repr__(self) -> str:
        return f"from_callable({_fn_repr(self.fn)})"


def from_callable(fn: Callable[..., bool | Decision]) -> Policy:
    """Wrap ``fn(op, *args, **kwargs) -> bool | Decision`` as a policy.

    ``fn`` is called once per op in the forward pass, with the
    ``torch._ops.OpOverload`` and the op's inputs; ``True`` means ``SAVE``,
    ``False`` means ``RECOMPUTE``. Two such policies are equal when they wrap the
    same object.

    Args:
        fn (Callable): the policy function.

    Returns:
        Policy: the policy.

    Raises:
        TypeError: when ``fn`` is not callable. A verdict that is neither a bool
            nor a :class:`Decision` raises ``TypeError`` when the op runs.

    >>> p = from_callable(lambda op, *args, **kwargs: op is torch.ops.aten.mm.default)
    >>> p.decide(p.decide_op(torch.ops.aten.mm.default, (), {}), None)
    <Decision.SAVE: 2>
    """
    if not callable(fn) or isinstance(fn, Policy):
        raise TypeError(
            f"remat.policies.from_callable: expected a function fn(op, *args, **kwargs), "
            f"got {fn!r} ({type(fn).__name__})."
        )
    return FromCallable(fn)


def _checkpoint_policy_map() -> dict[Any, Decision]:
    cp = torch.utils.checkpoint.CheckpointPolicy
    table = {
        "MUST_SAVE": Decision.SAVE,
        "PREFER_SAVE": Decision.SAVE,
        "MUST_RECOMPUTE": Decision.RECOMPUTE,
        "PREFER_RECOMPUTE": Decision.RECOMPUTE,
        "MUST_CPU_OFFLOAD": Decision.OFFLOAD,
        "PREFER_CPU_OFFLOAD": Decision.OFFLOAD,
    }
    return {getattr(cp, k): v for k, v in table.items() if hasattr(cp, k)}


_SAC_DECISIONS = _checkpoint_policy_map()


@dataclasses.dataclass(frozen=True, repr=False, eq=False)
class FromSelectiveCheckpoint(_ByCallable):
    """Ask a ``torch.utils.checkpoint`` policy ``fn(ctx, op, *args, **kwargs)``."""

    fn: Callable[..., Any]

    uses_ops = True

    def decide_op(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
        ctx = torch.utils.checkpoint.SelectiveCheckpointContext(is_recompute=False)
        result = self.fn(ctx, op, *args, **kwargs)
        if isinstance(result, bool):
            return Decision.SAVE if result else Decision.RECOMPUTE
        decision = _SAC_DECISIONS.get(result) if isinstance(result, Hashable) else None
        if decision is None:
            raise TypeError(
                f"remat.policies.from_selective_checkpoint: policy function "
                f"{_fn_repr(self.fn)} returned {result!r} ({type(result).__name__}) for {op}; "
                "it must return a torch.utils.checkpoint.CheckpointPolicy or a bool."
            )
        return decision

    def decide(self, verdict: Hashable, name: str | None) -> Decision:
        assert isinstance(verdict, Decision), "this is a bug in remat, please report it"
        return verdict

    def __repr__(self) -> str:
        return f"from_selective_checkpoint({_fn_repr(self.fn)})"


def from_selective_checkpoint(policy_fn: Callable[..., Any]) -> Policy:
    """Adapt a ``torch.utils.checkpoint`` selective-checkpoint policy function.

    ``policy_fn(ctx, op, *args, **kwargs)`` returns a
    ``torch.utils.checkpoint.CheckpointPolicy`` (or a bool): ``MUST_SAVE`` and
    ``PREFER_SAVE`` become ``SAVE``, ``MUST_RECOMPUTE`` and ``PREFER_RECOMPUTE``
    become ``RECOMPUTE``, the ``*_CPU_OFFLOAD`` ones (where torch has them) become
    ``OFFLOAD``. It is called only in the forward pass, so ``ctx.is_recompute`` is
    always false.

    Args:
        policy_fn (Callable): the selective-checkpoint policy function.

    Returns:
        Policy: the policy.

    Raises:
        TypeError: when ``policy_fn`` is not callable. Another return value raises
            ``TypeError`` when the op runs.

    >>> from torch.utils.checkpoint import CheckpointPolicy
    >>> def policy_fn(ctx, op, *args, **kwargs):
    ...     if op == torch.ops.aten.mm.default:
    ...         return CheckpointPolicy.MUST_SAVE
    ...     return CheckpointPolicy.PREFER_RECOMPUTE
    >>> p = from_selective_checkpoint(policy_fn)
    >>> p.decide(p.decide_op(torch.ops.aten.mm.default, (), {}), None)
    <Decision.SAVE: 2>
    """
    if not callable(policy_fn) or isinstance(policy_fn, Policy):
        raise TypeError(
            "remat.policies.from_selective_checkpoint: expected a function "
            f"policy_fn(ctx, op, *args, **kwargs), got {policy_fn!r} "
            f"({type(policy_fn).__name__})."
        )
    return FromSelectiveCheckpoint(policy_fn)


# ---------------------------------------------------------------------------
# Strings
# ---------------------------------------------------------------------------

_BUILTINS: dict[str, Policy] = {
    "nothing-saveable": nothing_saveable,
    "everything-saveable": everything_saveable,
    "dots-saveable": dots_saveable,
    "dots-no-batch-saveable": dots_with_no_batch_dims_saveable,
    "dots-with-no-batch-dims-saveable": dots_with_no_batch_dims_saveable,
    "save-last": save_last,
    "offload-dots": offload_dots,
    "offload-dots-no-batch": offload_dot_with_no_batch_dims(),
}
_REGISTRY: dict[str, Policy] = dict(_BUILTINS)

_PATTERNS: dict[str, Callable[[tuple[str, ...]], Policy]] = {
    "save": lambda ns: save_only_these_names(*ns),
    "save-except": lambda ns: save_any_names_but_these(*ns),
    "everything-except": lambda ns: save_anything_except_these_names(*ns),
    "offload": lambda ns: save_and_offload_only_these_names(names_which_can_be_offloaded=ns),
}
_PATTERNS_HELP = (
    "Name patterns: save:NAMES, save-except:NAMES, everything-except:NAMES, offload:NAMES, and A+B."
)


def _normalize(keyword: str) -> str:
    return keyword.strip().replace("_", "-")


def names() -> list[str]:
    """Return the sorted policy names that :func:`resolve` accepts (besides patterns).

    Returns:
        list[str]: the names, built-in and registered.

    >>> names()[:3]
    ['dots-no-batch-saveable', 'dots-saveable', 'dots-with-no-batch-dims-saveable']
    """
    return sorted(_REGISTRY)


def register(name: str, policy: PolicyLike, *, override: bool = False) -> None:
    """Add a policy name that :func:`resolve` (and ``policy=``) accepts.

    Args:
        name (str): the name; underscores and hyphens are interchangeable.
        policy (Policy | str | Callable | list): anything :func:`resolve` accepts.
        override (bool, optional): allow replacing a built-in name. Default: False.

    Raises:
        TypeError: when ``name`` is not a string or ``policy`` cannot be resolved.
        ValueError: when ``name`` is empty, contains ':', '+' or ',', or is a
            built-in name and ``override`` is false.

    >>> register("my_policy", "dots-saveable+save:attn")
    >>> resolve("my-policy")
    save_from_both_policies(dots_saveable, save_only_these_names('attn'))
    """
    if not isinstance(name, str):
        raise TypeError(
            f"remat.policies.register: name must be a string, got {name!r} ({type(name).__name__})."
        )
    key = _normalize(name)
    if not key or any(c in key for c in ":+,"):
        raise ValueError(
            f"remat.policies.register: invalid policy name {name!r}; use a non-empty name "
            "without ':', '+' or ',' (they are part of the policy string syntax)."
        )
    if key in _BUILTINS and not override:
        raise ValueError(
            f"remat.policies.register: {key!r} is a built-in policy name; pick another "
            "name, or pass override=True to replace it."
        )
    _REGISTRY[key] = resolve(policy)


def _unknown(text: str, key: str, choices: Iterable[str]) -> ValueError:
    close = difflib.get_close_matches(key, list(choices), n=1)
    hint = f" did you mean {close[0]!r}?" if close else ""
    return ValueError(
        f"remat.policies.resolve: unknown policy {text!r};{hint} "
        f"Valid names: {', '.join(names())}. {_PATTERNS_HELP}"
    )


def _resolve_one(text: str) -> Policy:
    if ":" not in text:
        key = _normalize(text)
        if key in _REGISTRY:
            return _REGISTRY[key]
        raise _unknown(text, key, names())
    keyword, _, rest = text.partition(":")
    key = _normalize(keyword)
    if key not in _PATTERNS:
        close = difflib.get_close_matches(key, list(_PATTERNS), n=1)
        guess = [f"{close[0]}:{rest}"] if close else []
        raise _unknown(text, f"{key}:{rest}", guess)
    parts = tuple(n.strip() for n in rest.split(","))
    if not all(parts):
        raise ValueError(
            f"remat.policies.resolve: policy {text!r} has an empty name; write "
            f"'{key}:NAMES' with one or more comma-separated names, e.g. '{key}:a,b'."
        )
    return _PATTERNS[key](parts)


def resolve(policy: PolicyLike) -> Policy:
    """Turn any accepted form of a policy into a :class:`Policy`.

    Accepted forms: a :class:`Policy` (returned as is); a policy string (see the
    table in the docs; ``"A+B"`` combines with :func:`save_from_both_policies`);
    a callable ``fn(op, *args, **kwargs) -> bool | Decision``; a list, tuple or set
    of aten ops to save.

    Args:
        policy (Policy | str | Callable | list): the policy.

    Returns:
        Policy: the policy object.

    Raises:
        ValueError: for an unknown or malformed policy string.
        TypeError: for anything else.

    >>> resolve("dots_saveable")
    dots_saveable
    >>> resolve("save:a,b + dots-no-batch-saveable")
    save_from_both_policies(save_only_these_names('a', 'b'), dots_with_no_batch_dims_saveable)
    >>> resolve("dots-savable")
    Traceback (most recent call last):
    ...
    ValueError: remat.policies.resolve: unknown policy 'dots-savable'; did you mean ...
    """
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, str):
        parts = [p.strip() for p in policy.split("+")]
        if not all(parts):
            raise ValueError(
                f"remat.policies.resolve: policy {policy.strip()!r} has an empty part around "
                "'+'; write 'A+B' with a policy on each side, e.g. 'save-last+dots-saveable'."
            )
        result = _resolve_one(parts[0])
        for part in parts[1:]:
            result = save_from_both_policies(result, _resolve_one(part))
        return result
    if isinstance(policy, list | tuple | set | frozenset):
        return save_these_ops(*policy)
    if callable(policy):
        return from_callable(policy)
    raise TypeError(
        "remat.policies.resolve: expected a Policy, a policy name such as 'dots-saveable', "
        "a function fn(op, *args, **kwargs) -> bool | Decision, or a list of aten ops; "
        f"got {policy!r} ({type(policy).__name__})."
    )
