"""Read the policy out of a ``context_fn`` built by torch's selective checkpointing.

NOTE [ context_fn from create_selective_checkpoint_contexts ]
1. ``torch.utils.checkpoint.create_selective_checkpoint_contexts(policy_fn_or_list)``
   returns two ``TorchDispatchMode``s: a ``_CachingTorchDispatchMode`` for the
   forward, holding the policy as ``.policy_fn``, and a ``_CachedTorchDispatchMode``
   for the recompute. ``context_fn`` is that call behind a ``functools.partial``
   (or any function that returns its result), so `policy_of_context_fn` calls it
   once and reads the first mode's ``policy_fn``. These classes and the attribute
   are private to torch (torch/utils/checkpoint.py, unchanged from 2.3 to 2.13);
   when torch makes a public accessor for a context's policy, use it here.
2. The op-list form wraps the list in a closure ``policy_fn`` whose free variable
   is ``policy_fn_or_list``: that list becomes `policies.save_these_ops` (the same
   ops: ``MUST_SAVE`` for listed ops, ``PREFER_RECOMPUTE`` for the rest). Any
   other policy function becomes `policies.from_selective_checkpoint`, asked once
   per op in the forward, as torch asks it.
3. torch's ``noop_context_fn`` (its default) means no policy. Any other
   ``context_fn`` (autocast, a user's mode) is refused with a fix: remat's
   recompute is not torch's, so it cannot promise to enter torch's second
   context at the point torch would.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.utils.checkpoint as torch_checkpoint

from .._compat import CachingCheckpointMode, OpOverload
from .adapters import from_selective_checkpoint, save_these_ops
from .base import Policy

__all__ = ["policy_of_context_fn"]


def policy_of_context_fn(
    context_fn: Callable[[], Any] | None, api: str, label: str
) -> Policy | None:
    """The policy ``context_fn`` asks for, or ``None`` for no ``context_fn`` (NOTE rules 1-3).

    ``label`` names the checkpointed function (and its source line) in messages.
    """
    if context_fn is None or context_fn is torch_checkpoint.noop_context_fn:
        return None
    if not callable(context_fn):
        raise TypeError(
            f"{api}: context_fn for {label} must be a callable returning two context managers, got "
            f"{context_fn!r} ({type(context_fn).__name__})"
        )
    contexts = context_fn()
    forward = contexts[0] if isinstance(contexts, tuple) and len(contexts) == 2 else None
    policy_fn = getattr(forward, "policy_fn", None)
    if not isinstance(forward, CachingCheckpointMode) or policy_fn is None:
        raise ValueError(
            f"{api}: context_fn for {label} returned {contexts!r}; only a context_fn built with "
            "torch.utils.checkpoint.create_selective_checkpoint_contexts (a policy function or "
            "a list of ops) is understood. Enter other contexts inside the checkpointed "
            "function instead; they then apply in the forward and in the recompute: "
            "def wrapped(*args): with your_context(): return function(*args) ... "
            f"{api}(wrapped, *args)."
        )
    ops = _op_list(policy_fn)
    if ops is not None:
        return save_these_ops(*ops)
    return from_selective_checkpoint(policy_fn)


def _op_list(policy_fn: Callable[..., Any]) -> list[OpOverload] | None:
    """The ops of torch's op-list form (NOTE rule 2), or ``None`` for a policy function."""
    code = getattr(policy_fn, "__code__", None)
    cells = getattr(policy_fn, "__closure__", None) or ()
    if code is None or "create_selective_checkpoint_contexts" not in policy_fn.__qualname__:
        return None
    free = dict(zip(code.co_freevars, cells, strict=False))
    cell = free.get("policy_fn_or_list")
    ops = cell.cell_contents if cell is not None else None
    if isinstance(ops, list) and all(isinstance(op, OpOverload) for op in ops):
        return ops
    return None  # a HigherOrderOperator in the list: asked through the function
