"""`RematWarning` for a name policy whose names match no `checkpoint_name` of its region.

NOTE [ Names that match nothing ]
1. `checkpoint_name` reports every name it is given inside a recorded forward to
   the innermost op log (`OpLog.name`), which notes it in ``names_seen`` before
   anything else, so a name given to a region input (kept anyway) counts too.
2. When a region's forward ends (the eager engine: `Frame.finish_forward`; the
   torch.func engine: `_Call.forward`, after its `RecordMode`), `check_names`
   compares the names the policy refers to (`policy_names`) with those seen. When
   the policy refers to names and *none* of them was seen, the policy keeps nothing
   by name: almost always a typo (``"save:hiden"``) or a name given outside the
   region. It warns, listing the names it did see and the closest one.
3. Once per region: per (region label, policy), for the process. A wrapped module
   makes a `Region` per call, so the label ("name (file:line)"), not the object,
   is the region. A policy shared by many blocks whose names appear in some blocks
   only does not warn for a block where one of its names matched.
4. Cost: a set insert per `checkpoint_name` call, and per forward of a name policy
   one set intersection; a policy's names are found once per policy (cached).
   Policies that use no names (``uses_names`` false) are not looked at at all.
"""

from __future__ import annotations

import difflib
import functools
import threading
import warnings
from collections.abc import Iterable

from .._errors import RematWarning
from .base import Policy

__all__ = ["check_names", "policy_names"]

#: The fields of the name policies (and of their combinations) that hold names or parts.
_NAME_FIELDS = ("names", "names_which_can_be_saved", "names_which_can_be_offloaded")
_PART_FIELDS = ("a", "b", "base")

_warned: set[tuple[str, Policy]] = set()
_lock = threading.Lock()


@functools.lru_cache(maxsize=256)
def policy_names(policy: Policy) -> frozenset[str]:
    """Every ``checkpoint_name`` ``policy`` refers to, in its parts too.

    Examples:
        >>> from remat.policies import resolve
        >>> sorted(policy_names(resolve("save:a,b + dots-saveable")))
        ['a', 'b']
    """
    names: set[str] = set()
    for field in _NAME_FIELDS:
        value = getattr(policy, field, ())
        if isinstance(value, tuple):
            names.update(n for n in value if isinstance(n, str))
    for field in _PART_FIELDS:
        part = getattr(policy, field, None)
        if isinstance(part, Policy):
            names |= policy_names(part)
    return frozenset(names)


def check_names(policy: Policy, label: str, seen: Iterable[str]) -> None:
    """Warn once per region when ``policy``'s names match none of the names ``seen``."""
    if not policy.uses_names:
        return
    wanted = policy_names(policy)
    seen = frozenset(seen)
    if not wanted or wanted & seen:
        return
    shown = getattr(policy, "base", policy)  # the torch.func engine's save_last keeper
    key = (label, shown)
    with _lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(_message(shown, label, wanted, seen), RematWarning, stacklevel=2)


def _message(policy: Policy, label: str, wanted: frozenset[str], seen: frozenset[str]) -> str:
    names = ", ".join(repr(n) for n in sorted(wanted))
    head = (
        f"remat: the policy {policy!r} of {label} refers to {names}, but its forward tagged "
        "no value with any of these names, so the policy keeps nothing by name."
    )
    if not seen:
        return (
            f"{head} The region called remat.checkpoint_name on nothing; tag the values "
            "inside the region's function, e.g. h = remat.checkpoint_name(h, "
            f"{sorted(wanted)[0]!r})."
        )
    listed = ", ".join(repr(n) for n in sorted(seen))
    close = [
        (w, m) for w in sorted(wanted) for m in difflib.get_close_matches(w, sorted(seen), 1)
    ]
    fix = (
        f" Did you mean {close[0][1]!r} (for {close[0][0]!r})?"
        if close
        else " Use one of those names in the policy."
    )
    return f"{head} The names it saw: {listed}.{fix}"
