"""Casts that autocast's cast cache may take, or not take, in a recompute.

NOTE [ Autocast's cast cache ]
1. Inside ``torch.autocast``, the first op that casts a floating leaf which
   requires grad (a parameter) to the lower precision runs ``aten._to_copy``
   and keeps the result in a per-thread cache; later ops until the outermost
   autocast block exits get that very tensor, and run no ``_to_copy``. So a
   region's forward and its recompute may differ in these casts alone:
   ``loss.backward()`` inside the autocast block recomputes with the forward's
   casts still cached (the recompute runs no ``_to_copy`` where the forward
   ran one), and a backward after the block recomputes in a fresh cache (it
   casts a parameter that the forward found cached, cast before the region).
2. Neither changes a value: the cache hands out the forward's very tensor, and
   a fresh cast of an unwritten parameter computes the same bits. So a
   recompute may leave out a forward's cast (`alignment.kinds` makes it
   skippable as a constant is: only if what reads it reads the forward's very
   tensor, unwritten), and may run a cast that no forward op made of the same
   parameter (`ReplayMode` runs it unmatched). A cast is matched only to a
   forward cast of the same memory (`casts_of`: the eager engine's recompute may
   read a parameter through an alias), never to another ``_to_copy``.
3. The eager engine's gradients are the forward graph's whatever the
   recompute's casts: autograd differentiates the cast the forward ran once
   (or took from the cache), as without remat.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .. import _compat

__all__ = ["CastKey", "cacheable", "cast_key", "cast_source", "casts_of"]

_TO_COPY = _compat.TO_COPY
_LOWER = (torch.bfloat16, torch.float16)


def cast_source(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The tensor ``func`` casts if it is a float32 tensor's cast to the lower precision,
    as autocast casts (``arg.to(dtype)``), else None."""
    if func is not _TO_COPY or len(args) != 1 or kwargs.keys() != {"dtype"}:
        return None
    source = args[0]
    if isinstance(source, torch.Tensor) and kwargs["dtype"] in _LOWER and (
        source.dtype == torch.float32
    ):
        return source
    return None


def cacheable(source: torch.Tensor) -> bool:
    """Whether autocast's cache may hold a cast of ``source``: a leaf that requires grad
    and is not a view. A user's ``w.to(torch.bfloat16)`` looks the same, and treating it
    so is safe (rule 2)."""
    return source.requires_grad and source.is_leaf and not source._is_view()


#: What a cast reads: its source's memory and layout (`cast_key`).
CastKey = tuple[int, int, tuple[int, ...], tuple[int, ...]]


def cast_key(source: torch.Tensor) -> CastKey:
    """The memory a cast reads (the eager engine's recompute may read a parameter through
    an alias of it, the same bits)."""
    return (
        _compat.storage_address(source), int(source.storage_offset()),
        tuple(source.shape), source.stride(),
    )


def casts_of(casts: Mapping[int, CastKey], source: torch.Tensor) -> bool:
    """Whether a forward record in ``casts`` (index -> `cast_key` of each cast) casts
    ``source`` (cached or not: the forward may have read it through a non-leaf alias)."""
    key = cast_key(source)
    return any(k == key for k in casts.values())
