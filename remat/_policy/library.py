"""JAX's policies: constant ones, dots, names, and the union of two policies."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterable
from typing import Any

from . import ops as _ops
from .base import Decision, Policy, _check_dst, _check_names, _names_repr

# ---------------------------------------------------------------------------
# Constant policies
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, repr=False)
class EverythingSaveable(Policy):
    """Save every output (same memory as no remat)."""

    @property
    def lowers(self) -> bool:
        return True

    def decide_op(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
        return Decision.SAVE

    def decide(self, verdict: Hashable, name: str | None) -> Decision:
        return Decision.SAVE

    def __repr__(self) -> str:
        return "everything_saveable"


@dataclasses.dataclass(frozen=True, repr=False)
class NothingSaveable(Policy):
    """Save nothing but the region's inputs (the default)."""

    @property
    def lowers(self) -> bool:
        return True

    def decide_op(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
        return Decision.RECOMPUTE

    def decide(self, verdict: Hashable, name: str | None) -> Decision:
        return Decision.RECOMPUTE

    def __repr__(self) -> str:
        return "nothing_saveable"


@dataclasses.dataclass(frozen=True, repr=False)
class SaveLast(Policy):
    """Keep every output of the most recent region; recompute the others."""

    saves_latest_region = True

    def decide_op(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
        return Decision.RECOMPUTE

    def decide(self, verdict: Hashable, name: str | None) -> Decision:
        return Decision.RECOMPUTE

    def __repr__(self) -> str:
        return "save_last"


everything_saveable: Policy = EverythingSaveable()
"""Save every output (same memory as no remat)."""
nothing_saveable: Policy = NothingSaveable()
"""Save nothing but the region's inputs (the default)."""
save_last: Policy = SaveLast()
"""Keep all outputs of the most recently executed region; every other region recomputes."""


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

    @property
    def lowers(self) -> bool:
        return self.decision is Decision.SAVE  # offload is the eager engine's host store

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


dots_saveable: Policy = Dots()
"""Save the outputs of matmuls, convolutions and attention kernels."""
dots_with_no_batch_dims_saveable: Policy = Dots(batch_dims=False)
"""Save the outputs of dots without batch dimensions (``mm``, ``addmm``; every ``Linear``)."""
checkpoint_dots: Policy = dots_saveable
"""JAX's old name of `dots_saveable`."""
checkpoint_dots_with_no_batch_dims: Policy = dots_with_no_batch_dims_saveable
"""JAX's old name of `dots_with_no_batch_dims_saveable`."""
offload_dots: Policy = Dots(decision=Decision.OFFLOAD)
"""Like `dots_saveable`, but offload the dots' outputs to pinned host memory."""


def offload_dot_with_no_batch_dims(offload_dst: str = "cpu") -> Policy:
    """Offload the outputs of dots without batch dimensions; recompute everything else.

    Args:
        offload_dst (str, optional): "cpu" or "pinned_host" (the same: pinned host
            memory). Default: "cpu".

    Returns:
        Policy: the policy.

    Raises:
        ValueError: for another ``offload_dst``.

    >>> import torch
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

    @property
    def lowers(self) -> bool:
        return True

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

    @property
    def lowers(self) -> bool:
        return True

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

    @property
    def lowers(self) -> bool:
        return True

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

    @property
    def lowers(self) -> bool:
        return not self.names_which_can_be_offloaded  # offload: the eager engine's store

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

    Examples:
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

    Examples:
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
        for flag in ("uses_ops", "uses_names", "saves_latest_region"):
            object.__setattr__(self, flag, getattr(self.a, flag) or getattr(self.b, flag))
        if self.a.offload_dst != self.b.offload_dst:
            raise ValueError(
                "remat.policies.save_from_both_policies: the parts offload to different "
                f"places ({self.a.offload_dst!r} and {self.b.offload_dst!r}); use one offload_dst."
            )
        object.__setattr__(self, "offload_dst", self.a.offload_dst)

    @property
    def lowers(self) -> bool:
        return self.a.lowers and self.b.lowers

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

    >>> import torch
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
