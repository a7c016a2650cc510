"""Thread-local state shared by the engines: who is recording, who is recomputing."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

__all__ = ["entered_internally", "internal", "is_recomputing", "recomputing", "local"]


class _Local(threading.local):
    def __init__(self) -> None:
        #: How many recomputes are running on this thread (nested regions recompute inside).
        self.recompute_depth = 0
        #: Eager frames whose forward or recompute is running, innermost last.
        self.frames: list[Any] = []
        #: Op recorders (RecordMode) that `checkpoint_name` reports to, innermost last.
        self.recorders: list[Any] = []
        #: Weak references to the latest `save_last` regions' handles, either engine's
        #: (NOTE [ The save-last chain ] in ``_engines/save_last.py``).
        self.last_regions: list[Any] = []
        #: How many of remat's own blocks of tensor work (snapshots, copies) are running
        #: inside a user function: calls made there are not the function's (`internal`).
        self.internal_depth = 0
        #: This thread's identity, for hooks that may run on another thread (a plain
        #: object, not ``threading.get_ident()``: Dynamo traces attribute reads).
        self.thread_token = object()
        #: The torch.func engine's op substitutions running on this thread, innermost
        #: last (`functional._Substitution`). While one runs, that engine maps the
        #: tensors ``fn`` reads (module slots included) itself, writing no slot.
        self.substitutions: list[Any] = []
        #: An as-is inspection running on this thread (``_inspect._AsIs``): the eager
        #: engine builds region frames through it, so it can read what they keep.
        self.inspecting: Any = None


local = _Local()


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
