"""The context a recompute runs in, shared by both engines.

NOTE [ The recompute context ]
1. A recompute must see what the forward saw: the random generators as they were
   when the forward started (dropout draws the same mask), the autocast state it
   ran under, and (where the engine wants it) grad mode.
2. It is marked as a recompute (`remat.is_recomputing`, which user code and
   the engines read: a region called there recomputes, it does not offload).
3. Kept op outputs are replayed instead of recomputed when a `ReplayMode` is
   given (NOTE [ Record and replay ] in ``_replay/log.py``); entered last, so it
   sees only the function's own ops.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from .._replay.autocast import AutocastState
from .._replay.modes import ReplayMode
from .._replay.rng import RngState
from .._state import recomputing

__all__ = ["recompute_context"]


@contextlib.contextmanager
def recompute_context(
    rng: RngState | None,
    autocast: AutocastState,
    replay: ReplayMode | None,
    grad: bool | None = None,
) -> Iterator[None]:
    """Run the enclosed recompute as the forward ran (rules 1-3).

    Args:
        rng: the generators' states at the forward's start; None: not restored.
        autocast: the forward's autocast state.
        replay: the replay mode of the forward's op log, if kept outputs are replayed.
        grad: grad mode to set; None leaves it as the caller has it.
    """
    with contextlib.ExitStack() as stack:
        if grad is not None:
            stack.enter_context(torch.set_grad_enabled(grad))
        stack.enter_context(recomputing())
        if rng is not None:
            stack.enter_context(rng.restored())
        stack.enter_context(autocast.applied())
        if replay is not None:
            stack.enter_context(replay)
        yield
