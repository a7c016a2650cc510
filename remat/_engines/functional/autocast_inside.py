"""A region that enters autocast itself, differentiated by eager autograd.

NOTE [ Engine selection ] rule 4 (in ``_engines/select.py``) sends a call made
under autocast and no torch.func transform to the eager engine: autograd and
torch.func cast differently under autocast (autograd casts a parameter once
per block and runs a composite op's inner ops outside autocast; torch.func's
levels cast each use and every inner op again), so the torch.func engine's
``vjp`` would differentiate another program than the one autograd ran
(NOTE [ Autocast's cast cache ] in ``_replay/cast_cache.py``). A function that
enters ``torch.autocast`` itself is seen only once it runs: the forward watches
for an op under autocast and raises, naming the region and the engine that
works. Under a torch.func transform nothing is watched: there the function
runs under torch.func's levels without remat too.
"""

from __future__ import annotations

from typing import Any

from torch.overrides import TorchFunctionMode

from ..._errors import RematError
from ..._replay.autocast import autocast_on

__all__ = ["AutocastInside"]


class AutocastInside(TorchFunctionMode):
    """Raise at the first torch call of the forward made under autocast."""

    def __init__(self, label: str) -> None:
        super().__init__()
        self.label = label

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if autocast_on():
            raise RematError(
                f"remat: {self.label} runs torch ops under torch.autocast entered inside "
                "the region, and engine='functional' differentiates it with torch.func, "
                "which casts under autocast otherwise than loss.backward()'s autograd does "
                "(each use of a parameter, and the inner ops of attention), so its "
                "gradients would differ from the function's. Use engine='auto' (the "
                "default) or engine='eager' for this region: under loss.backward() they "
                "run it with saved-tensor hooks, where autocast casts as without remat."
            )
        return func(*args, **(kwargs or {}))
