"""Submodules the forward ran, checked again before each recompute of the torch.func engine.

The Function's inputs are the tensors the forward reached (NOTE [ The functional
engine ] rule 2); a submodule replaced between the forward and the backward
(model surgery, a swapped head or adapter) would run in the recompute with
weights that are no input: the old weights would get a silent zero gradient and
the rest the gradient of a forward that never ran. So, as in the eager engine
(NOTE [ Bindings the recompute reads ] rule 5 in ``_engines/eager/bindings.py``),
the submodules on the generator walk (``_replay/generators.py``) are noted at the
forward and read again when a recompute starts; another object there raises
`SavedInputMutatedError` with the eager engine's words and fixes. A module
switched to another mode since (``model.eval()``) recomputes in the mode its
forward ran in (`restored`, rule 6 there). A backward
that does not run ``fn`` again (a held ``save-last`` graph) is not checked: it
differentiates the forward that ran.
"""

from __future__ import annotations

import contextlib
from typing import Any

from ..._replay.generators import Walk
from ..eager.bindings import check_replaced, modes_of, modes_restored

__all__ = ["SubmodulesAtForward"]


class SubmodulesAtForward:
    """The submodules a region's function reached when its forward began."""

    __slots__ = ("fn", "modes", "modules", "walk")

    def __init__(self, fn: Any, walk: Walk) -> None:
        self.fn = fn
        self.walk = walk
        self.modules = walk.read_steps(fn, walk.module_steps)  # alive anyway
        self.modes = modes_of(self.modules)

    @classmethod
    def capture(cls, fn: Any, walk: Walk) -> SubmodulesAtForward | None:
        """Note the submodules ``walk`` (`walk_of(fn)`) reaches now; None when none."""
        return cls(fn, walk) if walk.module_steps else None

    def check(self, label: str) -> None:
        """Raise if a submodule the forward ran was replaced since."""
        check_replaced(self.walk, self.fn, self.modules, label)

    def restored(self) -> contextlib.AbstractContextManager[None]:
        """A recompute's context: each module in the mode the forward ran it in."""
        return modes_restored(self.modules, self.modes)
