"""The ``torch.compile`` boundary: remat's engines always run eagerly.

Dynamo cannot trace the engines (saved-tensor hooks, dispatch modes, functorch
internals), and must not compile them either: a recompute compiled by Dynamo
saves other tensors, in another order, than the forward did. So every entry
point Dynamo can reach (a region call in compiled code, an unpack hook or a
Function's backward run by a ``loss.backward()`` inside compiled code) goes
through `uncompiled`: a graph break, then plain Python. Plain Python all the
way down: functorch enters a Function's forward from C++ with Dynamo's frame
hook live but no frame being traced (``torch.compile(torch.func.grad(f))``),
where Dynamo would compile each frame the engine enters.

Regions whose policy lowers to ``torch.utils.checkpoint`` are not engines'
business under ``torch.compile``: see ``_engines/lowered.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["uncompiled"]

R = TypeVar("R")


def uncompiled(fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
    """``fn(*args, **kwargs)``, run eagerly: a graph break when ``torch.compile``
    traces this call, and no frame below it compiled in any case.

    Examples:
        >>> uncompiled(max, 1, 2)
        2
    """
    if torch.compiler.is_compiling():
        eager: Callable[..., R] = torch.compiler.disable(fn)
        return eager(*args, **kwargs)
    result: R = _eager(fn, *args, **kwargs)
    return result


def _call(fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
    return fn(*args, **kwargs)


#: ``fn(*args, **kwargs)`` with Dynamo's frame hook off for every frame it enters.
_eager: Callable[..., Any] = torch.compiler.disable(_call)
