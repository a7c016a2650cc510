"""Errors raised by remat at run time, and the warning it gives."""

from __future__ import annotations

__all__ = [
    "NondeterministicRecomputeError",
    "RematError",
    "RematWarning",
    "SavedInputMutatedError",
]


class RematError(RuntimeError):
    """A rematerialized region failed at run time (see the message for the fix)."""


class NondeterministicRecomputeError(RematError):
    """The recompute of a region did not reproduce what its forward pass saw."""


class SavedInputMutatedError(RematError):
    """A region input was mutated in place between the forward and the recompute."""


class RematWarning(UserWarning):
    """remat did what was asked, but probably not what was meant (see the message).

    For example, a name policy (``"save:hiden"``) whose names match no
    ``checkpoint_name`` its region tagged: it keeps nothing by name.
    """
