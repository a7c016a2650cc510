"""The tag on every tensor a recorded op returns: which log, which op, which output.

The eager engine's pack hook reads it to find the decision for a tensor autograd
saves; `checkpoint_name` reads it to find the op whose output is being named
(NOTE [ Record and replay ] rule 2, in ``_replay/records.py``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .._compat import is_traceable_wrapper_subclass

__all__ = ["TAG", "OpTag", "inherit_tag", "set_tag", "tag_inner", "tag_of"]

#: The attribute that holds a tensor's `OpTag`.
TAG = "_remat_src"


class OpTag(NamedTuple):
    """Where a tensor was made: the op log's serial, the op's index, the output's position."""

    log_serial: int
    op_index: int
    position: int


def tag_of(t: Any) -> OpTag | None:
    """The `OpTag` of ``t``, or None for a tensor no recorded op returned (or a non-tensor).

    Examples:
        >>> tag_of(torch.ones(1)) is None
        True
    """
    tag: OpTag | None = getattr(t, TAG, None)
    return tag


def set_tag(t: torch.Tensor, tag: OpTag) -> None:
    setattr(t, TAG, tag)


def inherit_tag(source: Any, out: Any) -> None:
    """Give ``out`` (a ``detach`` of ``source``) the tag of ``source``.

    The engines detach tensors inside saved-tensor hooks, at points that differ
    between forward and recompute: the policy still applies to the detached one.
    """
    tag = getattr(source, TAG, None)
    if tag is not None and isinstance(out, torch.Tensor):
        setattr(out, TAG, tag)


def tag_inner(tensor: torch.Tensor, tag: OpTag) -> None:
    """Give a wrapper subclass's inner tensors its tag (a DTensor's local shard).

    The modes see a DTensor's ops at the DTensor level, but autograd saves what
    the code after them computes on: tensor-parallel layers hand out the local
    shard (``to_local``), which no recorded op returned. Tagged, a saved shard
    is the output of the DTensor op that made it, and the policy's decision for
    that op applies to it. A tag this log gave before stays (an aliasing op may
    hand out an input's shard).
    """
    if type(tensor) is torch.Tensor or not is_traceable_wrapper_subclass(tensor):
        return
    names, _ = tensor.__tensor_flatten__()
    for name in names:
        inner = getattr(tensor, name, None)
        if not isinstance(inner, torch.Tensor):
            continue
        existing = getattr(inner, TAG, None)
        if existing is None or existing[0] != tag[0]:
            setattr(inner, TAG, tag)
