"""JAX's policies: constant ones, dots, and the union of two policies.

The name policies are in ``_policy/names.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import Any

from . import ops as _ops
from .base import Decision, Policy, _check_dst

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
    >>> from remat.policies import save_anything_except_these_names
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
