"""Which modules a region's forward runs: one global forward pre-hook while any guard records.

`watching` tells a guard (and every guard recording around it on this thread)
about each module that runs (NOTE [ State the forward changes ] in
``_capture/module_state.py``).
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import torch
from torch import nn

from .._compat import dynamo_frame_hook, global_forward_pre_hooks
from .._compile import uncompiled
from .._state import local

__all__ = ["ModuleWatcher", "watching"]


class ModuleWatcher(Protocol):
    """What `watching` tells about each module that runs (a `StateGuard`); ``saw``
    marks the tensor work it does as remat's own (``with INTERNAL:``)."""

    def saw(self, module: nn.Module) -> None: ...


_hook_lock = threading.Lock()


_watchers = [0]  # guards recording, over all threads


#: Our key in torch's table of global forward pre-hooks. A fixed key, not a
#: ``RemovableHandle`` (whose ids count up from 0): torch.compile guards on the
#: table's keys, so a new handle per region call would recompile a compiled
#: module run inside a region on every call. The entry exists only while a
#: region records (a permanent global hook makes ``torch.compile(module)`` warn).
_HOOK_KEY = -7_351_117


class watching:  # (lower case: used as the function it was, ``with watching(guard):``)
    """Tell ``guard`` (and every guard recording around it) about each module that runs.

    A class, not a generator context manager: entered twice per region call.
    """

    __slots__ = ("_guard",)

    def __init__(self, guard: ModuleWatcher) -> None:
        self._guard = guard

    def __enter__(self) -> None:
        hooks = global_forward_pre_hooks()
        with _hook_lock:
            _watchers[0] += 1
            hooks[_HOOK_KEY] = _pre_hook
        local.state_guards.append(self._guard)

    def __exit__(self, *exc: object) -> None:
        local.state_guards.pop()
        with _hook_lock:
            _watchers[0] -= 1
            if not _watchers[0]:
                global_forward_pre_hooks().pop(_HOOK_KEY, None)


def _pre_hook(module: nn.Module, args: Any) -> None:
    # A compiled module run in a region: not Dynamo's to trace (`uncompiled`,
    # whose plain case is inlined here: the hook runs for every module call).
    if not torch.compiler.is_compiling() and dynamo_frame_hook() is None:
        _saw(module)
    else:
        uncompiled(_saw, module)


def _saw(module: nn.Module) -> None:
    # Each watcher marks the tensor work it does as remat's own (``with INTERNAL:``).
    for guard in local.state_guards:
        guard.saw(module)
