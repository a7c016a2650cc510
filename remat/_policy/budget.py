"""`memory_budget`: a policy that lets remat choose what to keep under a memory budget.

The policy object only says what the budget is; the plan is made per region
and input signature by the engines (NOTE [ Budget plans ] in
``_engines/budget_plans.py``) with the planner of ``planner.py``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Hashable
from typing import Any

from .base import Decision, Policy

__all__ = ["MemoryBudget", "memory_budget", "parse_budget"]

_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(B|KiB|MiB|GiB)\s*$")
_HELP = (
    "write a fraction from 0 to 1 of what everything-saveable holds ('budget:0.3') or a "
    "size with a unit B, KiB, MiB or GiB ('budget:64MiB')"
)


@dataclasses.dataclass(frozen=True, repr=False)
class MemoryBudget(Policy):
    """Keep, per op, what fits ``fraction`` of everything-saveable's bytes, or ``nbytes``.

    Exactly one of ``fraction`` and ``nbytes`` is set. Make one with
    :func:`memory_budget` or the string ``"budget:0.3"`` / ``"budget:64MiB"``.
    """

    fraction: float | None = None
    nbytes: int | None = None

    uses_ops = True

    def __post_init__(self) -> None:
        if (self.fraction is None) == (self.nbytes is None):
            raise ValueError(
                "remat.policies.memory_budget: give a fraction or bytes=, not both and not "
                "neither; e.g. memory_budget(0.3) or memory_budget(bytes=64 * 2**20)."
            )
        if self.fraction is not None:
            value = self.fraction
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(
                    f"remat.policies.memory_budget: the fraction must be a number from 0 to 1, "
                    f"got {value!r} ({type(value).__name__})."
                )
            if not (math.isfinite(value) and 0.0 <= value <= 1.0):
                raise ValueError(
                    f"remat.policies.memory_budget: the fraction must be from 0 to 1, got "
                    f"{value!r}; for an absolute size use memory_budget(bytes=...) or "
                    f"'budget:{value}MiB'."
                )
            object.__setattr__(self, "fraction", float(value))
        else:
            size = self.nbytes
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise ValueError(
                    f"remat.policies.memory_budget: bytes must be an int >= 0, got {size!r}."
                )

    @property
    def lowers(self) -> bool:
        # Under torch.compile a region follows the eager plan made for its ops
        # (NOTE [ Lowering under torch.compile ] rule 11, ``_engines/lowered.py``).
        return True

    def decide_op(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
        # The engines ask the call's plan instead (``log_policy`` in
        # ``_engines/budget_plans.py``); asked directly, keeping nothing is the one
        # answer within every budget.
        return Decision.RECOMPUTE

    def decide(self, verdict: Hashable, name: str | None) -> Decision:
        return Decision.RECOMPUTE

    def budget_bytes(self, full: int) -> int:
        """The budget in bytes for a region that holds ``full`` bytes when it keeps everything."""
        if self.nbytes is not None:
            return self.nbytes
        assert self.fraction is not None, "this is a bug in remat, please report it"
        return math.floor(self.fraction * full)

    def __repr__(self) -> str:
        if self.nbytes is not None:
            return f"memory_budget(bytes={self.nbytes})"
        return f"memory_budget({self.fraction!r})"


def memory_budget(fraction: float | None = None, *, bytes: int | None = None) -> Policy:
    """Let remat choose per op what to keep, within a memory budget.

    The budget bounds what a region holds for backward beyond its inputs and
    parameters: a ``fraction`` of what ``everything-saveable`` would hold
    (0: what ``nothing-saveable`` holds; 1: everything), or an absolute size in
    ``bytes``. The plan, made from the region's first call with each input
    signature, keeps the outputs that save the most recompute for their bytes
    (DESIGN §1 "Automatic policies — memory budgets"; docs: "Let remat choose").

    Args:
        fraction (float, optional): from 0 to 1.
        bytes (int, optional): an absolute budget, instead of ``fraction``.

    Returns:
        Policy: the policy; ``remat.budget_plan(fn, *args, policy=policy)`` shows its plan.

    Raises:
        ValueError: for a fraction outside [0, 1], negative bytes, or both or
            neither given.

    >>> memory_budget(0.3), memory_budget(bytes=1 << 20)
    (memory_budget(0.3), memory_budget(bytes=1048576))
    """
    return MemoryBudget(fraction=fraction, nbytes=bytes)


def parse_budget(text: str, spec: str) -> Policy:
    """The policy for the string ``budget:SPEC`` (``text`` is the whole string, for messages).

    >>> parse_budget("budget:64MiB", "64MiB"), parse_budget("budget:0.25", "0.25")
    (memory_budget(bytes=67108864), memory_budget(0.25))
    """
    spec = spec.strip()
    sized = _SIZE.match(spec)
    if sized is not None:
        return MemoryBudget(nbytes=math.floor(float(sized.group(1)) * _UNITS[sized.group(2)]))
    try:
        value = float(spec)
    except ValueError:
        raise ValueError(f"remat.policies.resolve: invalid budget {text!r}; {_HELP}.") from None
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise ValueError(
            f"remat.policies.resolve: invalid budget {text!r}: a fraction must be from 0 to 1; "
            f"{_HELP}."
        )
    return MemoryBudget(fraction=value)
