"""Per-thread state: who is recording, who is recomputing, what runs around the caller.

NOTE [ Thread state ]
1. All of remat's per-thread state is one typed object, `local` (a `ThreadState`
   on a ``threading.local``): no module keeps a thread-local of its own, and no
   field is added on the fly.
2. Each field has one owner module, named at the field: only the owner writes
   it (through the owner's functions and context managers); other modules read
   it, or call the owner. ``internal_depth`` is written only here: `internal`,
   or, on per-call hot paths (``_engines/escape_notes.py``, ``_replay/checks.py``),
   ``with INTERNAL:``, the same count without a generator.
3. Dynamo traces reads and writes of these fields (``torch.compile`` of a lowered
   region reads ``lowering_depth``): keep them plain attributes, no properties.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

__all__ = [
    "INTERNAL",
    "ThreadState",
    "engine_maps_slots",
    "entered_internally",
    "internal",
    "is_recomputing",
    "local",
    "recomputing",
]


class ThreadState(threading.local):
    """remat's state on one thread; each field's owner module writes it (NOTE rule 2)."""

    def __init__(self) -> None:
        #: How many recomputes are running on this thread (nested regions recompute
        #: inside). Owner: this module (`recomputing`).
        self.recompute_depth = 0
        #: Eager frames whose forward or recompute is running, innermost last.
        #: Owner: ``_engines/eager/``.
        self.frames: list[Any] = []
        #: Op recorders (`RecordMode`) that `checkpoint_name` reports to, innermost
        #: last. Owner: ``_replay/modes.py``.
        self.recorders: list[Any] = []
        #: Weak references to the latest `save_last` regions' handles, either engine's
        #: (NOTE [ The save-last chain ]). Owner: ``_engines/save_last.py``.
        self.last_regions: list[Any] = []
        #: How many of remat's own blocks of tensor work (snapshots, copies) are
        #: running inside a user function: calls made there are not the function's.
        #: Owner: this module (`internal`, `INTERNAL`).
        self.internal_depth = 0
        #: This thread's identity, for hooks that may run on another thread (a plain
        #: object, not ``threading.get_ident()``: Dynamo traces attribute reads).
        #: Owner: this object; read by ``_capture/module_state.py``.
        self.thread_token = object()
        #: The torch.func engine's op substitutions running on this thread, innermost
        #: last. While one runs, that engine maps the tensors ``fn`` reads (module
        #: slots included) itself, writing no slot (`engine_maps_slots`).
        #: Owner: ``_engines/functional/``.
        self.substitutions: list[Any] = []
        #: An as-is inspection running on this thread (``_inspect._AsIs``): the eager
        #: engine builds region frames through it, so it can read what they keep.
        #: Owner: ``_inspect/``.
        self.inspecting: Any = None
        #: `StateGuard`s recording which modules run, innermost last.
        #: Owner: ``_capture/watching.py``.
        self.state_guards: list[Any] = []
        #: Runs of a region's function being traced for the determinism check
        #: (`OpTrace`/`TraceMode`), innermost last; None while a region called
        #: inside one runs. Owner: ``_replay/checks.py``.
        self.traces: list[Any] = []
        #: What the eager forwards noting their reads have read (ids of the tensors
        #: their ops got), innermost last (NOTE [ Bindings the recompute reads ]
        #: rule 8). Owner: ``_capture/reads.py``.
        self.forward_reads: list[set[int]] = []
        #: Host stores given with `use_host_store`, innermost last.
        #: Owner: ``_offload/selection.py``.
        self.host_stores: list[Any] = []
        #: Lowered regions being traced around this call (NOTE [ Lowering under torch.compile ]
        #: rule 5).
        #: Owner: ``_engines/lowered.py``.
        self.lowering_depth = 0
        #: Whether the outermost lowered region being traced on this thread has a
        #: policy that reads names (NOTE [ Names under torch.compile ] rule 1): a
        #: trace on another thread, with another policy, must not see it.
        #: Owner: ``_engines/lowered.py``.
        self.lowering_names = False


local = ThreadState()


def engine_maps_slots() -> bool:
    """Whether the torch.func engine maps the tensors the running function reads itself.

    Then it writes no module slot, so a `StateGuard` has no slot to pin
    (``_capture/module_state.py``) and steps aside.
    """
    return bool(local.substitutions)


def is_recomputing() -> bool:
    """Return True while a region's forward is being replayed for the backward pass.

    Python side effects inside a rematerialized function (appending to a list,
    counting calls, updating statistics) run again when the function is
    recomputed; guard them with this.

    Returns:
        bool: whether the calling code runs inside a recompute.

    Examples:
        >>> import torch, remat
        >>> calls = []
        >>> @remat.remat
        ... def f(x):
        ...     if not remat.is_recomputing():
        ...         calls.append("forward")
        ...     return x.sin().sin()
        >>> f(torch.ones(2, requires_grad=True)).sum().backward()
        >>> calls
        ['forward']
    """
    return local.recompute_depth > 0


@contextlib.contextmanager
def recomputing() -> Iterator[None]:
    """Mark the enclosed code as a recompute (see `is_recomputing`)."""
    local.recompute_depth += 1
    try:
        yield
    finally:
        local.recompute_depth -= 1


class _InternalWork:
    """`internal` as a plain object: entering it costs no generator (a per-call hot path)."""

    __slots__ = ()

    def __enter__(self) -> None:
        local.internal_depth += 1

    def __exit__(self, *exc: object) -> None:
        local.internal_depth -= 1


#: ``with INTERNAL:`` marks its body as remat's own work, as `internal` does.
INTERNAL = _InternalWork()


@contextlib.contextmanager
def internal() -> Iterator[None]:
    """Mark tensor work remat does inside a user function (a buffer snapshot) as its own.

    Code that numbers the function's torch calls (NOTE [ Escaped tensors ]) skips
    these, so the forward and the recompute number the same calls alike.
    """
    local.internal_depth += 1
    try:
        yield
    finally:
        local.internal_depth -= 1


@contextlib.contextmanager
def entered_internally(manager: AbstractContextManager[Any]) -> Iterator[None]:
    """Enter and exit ``manager`` as remat's own work (`internal`); its body is not."""
    with internal():
        manager.__enter__()
    try:
        yield
    except BaseException as error:
        with internal():
            if not manager.__exit__(type(error), error, error.__traceback__):
                raise
    else:
        with internal():
            manager.__exit__(None, None, None)
