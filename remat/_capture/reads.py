"""What a forward's ops read, for the bindings it rebinds itself.

NOTE [ Bindings the recompute reads ] rule 8 (in ``_engines/eager/bindings.py``):
a binding the forward rebinds without reading the tensor it held at the start
is read by the recompute as the forward left it. `ForwardReads` notes the id of
every tensor an op of the forward gets; a tensor bound at the start stays alive
through the forward, so its id in the set means an op read it. The eager engine
enters it around a forward whose walk reaches a tensor or a module holding
buffers; every `StateGuard` whose forward runs inside it uses it (`active_reads`).
"""

from __future__ import annotations

from typing import Any

from torch.overrides import TorchFunctionMode

from .._pytree import tensor_leaves
from .._state import local

__all__ = ["ForwardReads", "active_reads"]


class ForwardReads(TorchFunctionMode):
    """While a forward runs: the id of every tensor its ops get (its ``shape`` included)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[int] = set()

    def __enter__(self) -> ForwardReads:
        super().__enter__()  # type: ignore[no-untyped-call]
        local.forward_reads.append(self.seen)
        return self

    def __exit__(self, *exc: object) -> None:
        local.forward_reads.pop()
        super().__exit__(*exc)  # type: ignore[no-untyped-call]

    def __torch_function__(
        self, func: Any, types_: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if not local.internal_depth:  # not remat's own work (the state guard's copies)
            self.seen.update(map(id, tensor_leaves((args, kwargs))))
        return func(*args, **kwargs)


def active_reads() -> set[int] | None:
    """The reads of the innermost forward noting them on this thread, if any."""
    stack = local.forward_reads
    return stack[-1] if stack else None
