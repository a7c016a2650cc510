"""Policies from aten op lists, from callables, and from torch's selective checkpointing."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable
from typing import Any

import torch
import torch.utils.checkpoint

from .._compat import OpOverload, OpOverloadPacket
from .base import Decision, Policy, _fn_repr

# ---------------------------------------------------------------------------
# Ops and callables
# ---------------------------------------------------------------------------

_OpLike = OpOverload | OpOverloadPacket


@dataclasses.dataclass(frozen=True, repr=False)
class SaveTheseOps(Policy):
    """Save the outputs of the given ops (an ``OpOverloadPacket`` matches every overload)."""

    ops: frozenset[Any]

    uses_ops = True

    @property
    def lowers(self) -> bool:
        return True

    def decide_op(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
        if op in self.ops or getattr(op, "overloadpacket", None) in self.ops:
            return Decision.SAVE
        return Decision.RECOMPUTE

    def decide(self, verdict: Hashable, name: str | None) -> Decision:
        assert isinstance(verdict, Decision), "this is a bug in remat, please report it"
        return verdict

    def __repr__(self) -> str:
        return f"save_these_ops({', '.join(sorted(str(op) for op in self.ops))})"


def save_these_ops(*ops: OpOverload | OpOverloadPacket) -> Policy:
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
