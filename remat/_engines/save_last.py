"""The save-last chain: one per thread, shared by both engines.

NOTE [ The save-last chain ]
1. A region whose policy saves the latest region (``save-last``, ``save-last+P``)
   holds everything it produced while it is the most recent such region on its
   thread, and only what its base policy ``P`` keeps once another one starts.
2. Each engine registers, at the start of such a region's forward, a handle
   (`Demotable`): the eager engine its `Frame`, the torch.func engine the policy
   its op log records with. Registering demotes the previous handle, whichever
   engine made it: the chain is one, so ``save-last`` means the same in a model
   whose regions run under different engines.
3. The chain holds the latest handle weakly: a region whose backward has run (or
   whose graph was dropped) leaves nothing alive behind it.
"""

from __future__ import annotations

import weakref
from typing import Protocol

from .._state import local

__all__ = ["Demotable", "become_latest"]


class Demotable(Protocol):
    """What a save-last region registers: it can stop holding what only being latest kept."""

    def demote(self) -> None: ...


def become_latest(handle: Demotable) -> None:
    """Make ``handle`` the latest save-last region of this thread, demoting the previous one."""
    previous = local.last_region() if local.last_region is not None else None
    if previous is not None and previous is not handle:
        previous.demote()
    local.last_region = weakref.ref(handle)
