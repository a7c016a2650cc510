"""JAX's name policies: which values named with `checkpoint_name` are saved or offloaded."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterable
from typing import Any

from .base import Decision, Policy, _check_dst, _check_names, _names_repr


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
