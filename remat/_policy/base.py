"""The policy interface: `Decision`, `Policy`, and the checks the factories share.

The rules a policy follows are the NOTEs in ``remat/policies.py``.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, TypeAlias

__all__ = ["Decision", "Policy", "PolicyLike"]


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
    #: True for ``save_last``: the most recent region keeps every output (NOTE [ The
    #: save-last chain ] in ``_engines/save_last.py``).
    saves_latest_region: bool = False
    #: Where ``OFFLOAD`` decisions send values ("cpu": pinned host memory).
    offload_dst: str = "cpu"
    #: True for a memory budget's first call: the log keeps every op's input shapes.
    plans_from_log: bool = False

    @abc.abstractmethod
    def decide_op(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
        """Return this policy's verdict on one op (``op`` is None when ``uses_ops`` is false)."""

    def decide_record(
        self, index: int, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Hashable:
        """The verdict on the op at position ``index`` of a region's forward.

        Policies that decide by op alone (all but a memory budget's plan) ignore
        the position.
        """
        return self.decide_op(op, args, kwargs)

    @abc.abstractmethod
    def decide(self, verdict: Hashable, name: str | None) -> Decision:
        """Return the decision for an output given its op's verdict and its name."""

    def decision_without_ops(self) -> Decision:
        """The constant decision of a policy that looks at neither ops nor names."""
        return self.decide(self.decide_op(None, (), {}), None)

    @property
    def recomputes_nothing(self) -> bool:
        """Whether the policy recomputes no output (it saves or offloads each): a region
        then runs as plain autograd (the engines' selection, ``_engines/select.py``)."""
        if self.needs_op_trace or self.saves_latest_region:
            return False
        return self.decision_without_ops() is not Decision.RECOMPUTE

    @property
    def lowers(self) -> bool:
        """Whether ``torch.compile`` can carry this policy inside its graph.

        A policy that says yes decides by op and name alone and never answers
        ``OFFLOAD``: a region under it becomes a selective checkpoint in the
        compiled graph. The default, False, keeps a graph break there (the region
        runs in the eager engine), so a new policy is never lowered by mistake.
        """
        return False

    @property
    def needs_op_trace(self) -> bool:
        """Whether the engine must see every op (a dispatch mode) to apply this policy."""
        return self.uses_ops or self.uses_names

    def __add__(self, other: object) -> Policy:
        """``a + b`` is ``save_from_both_policies(a, b)``; ``b`` may be a policy string."""
        if isinstance(other, Policy | str):
            return _combine(self, other)
        return NotImplemented

    def __radd__(self, other: object) -> Policy:
        if isinstance(other, Policy | str):
            return _combine(other, self)
        return NotImplemented


# ``+`` needs the string grammar and `save_from_both_policies`, both built on this
# module. ``remat._policy/__init__.py`` installs them here, once, when the package is
# imported (before any policy can exist), so this module never imports upward.
_combiner: Callable[[Policy | str, Policy | str], Policy] | None = None


def install_combiner(combine: Callable[[Policy | str, Policy | str], Policy]) -> None:
    """Set what ``a + b`` does (called once by ``remat._policy``)."""
    global _combiner
    _combiner = combine


def _combine(a: Policy | str, b: Policy | str) -> Policy:
    assert _combiner is not None, "remat._policy was not imported: this is a bug in remat"
    return _combiner(a, b)


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
