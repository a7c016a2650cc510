"""Which modules a region's forward runs: one global forward pre-hook while any guard records.

`watching` tells a guard (and every guard recording around it on this thread)
about each module that runs (NOTE [ State the forward changes ] in
``_capture/module_state.py``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, Protocol

from torch import nn

from .._compat import global_forward_pre_hooks
from .._compile import uncompiled
from .._state import INTERNAL, local

__all__ = ["ModuleWatcher", "watching"]


class ModuleWatcher(Protocol):
    """What `watching` tells about each module that runs (a `StateGuard`)."""

    def saw(self, module: nn.Module) -> None: ...


_hook_lock = threading.Lock()


_watchers = [0]  # guards recording, over all threads


#: Our key in torch's table of global forward pre-hooks. A fixed key, not a
#: ``RemovableHandle`` (whose ids count up from 0): torch.compile guards on the
#: table's keys, so a new handle per region call would recompile a compiled
#: module run inside a region on every call. The entry exists only while a
#: region records (a permanent global hook makes ``torch.compile(module)`` warn).
_HOOK_KEY = -7_351_117


@contextlib.contextmanager
def watching(guard: ModuleWatcher) -> Iterator[None]:
    """Tell ``guard`` (and every guard recording around it) about each module that runs."""
    hooks = global_forward_pre_hooks()
    with _hook_lock:
        _watchers[0] += 1
        hooks[_HOOK_KEY] = _pre_hook
    stack: list[ModuleWatcher] = local.state_guards
    stack.append(guard)
    try:
        yield
    finally:
        stack.pop()
        with _hook_lock:
            _watchers[0] -= 1
            if not _watchers[0]:
                hooks.pop(_HOOK_KEY, None)


def _pre_hook(module: nn.Module, args: Any) -> None:
    uncompiled(_saw, module)  # a compiled module run in a region: not Dynamo's to trace


def _saw(module: nn.Module) -> None:
    with INTERNAL:
        for guard in local.state_guards:
            guard.saw(module)
