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

Outside ``torch.compile`` (no Dynamo frame hook on the thread, the usual case)
`uncompiled` calls ``fn`` directly: ``torch.compiler.disable`` would only set
the hook to None and back, at the cost of several Python calls per saved
tensor and per op.

Regions whose policy lowers to ``torch.utils.checkpoint`` are not engines'
business under ``torch.compile``: see ``_engines/lowered.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from ._compat import PlainDispatchMode, dynamo_frame_hook, never_traced, nothing_compiles

__all__ = ["UncompiledMode", "runs_plainly", "uncompiled"]

#: Whether a saved-tensor hook may call its body directly, as `uncompiled` would:
#: nothing compiles on this thread. One call where `uncompiled` makes four; only
#: for hooks torch calls from C++, never for code Dynamo may trace as bytecode
#: (a region call, a module hook), where `uncompiled` must run.
runs_plainly: Callable[[], bool] = nothing_compiles

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
    if dynamo_frame_hook() is None:  # nothing would compile the frames below
        return fn(*args, **kwargs)
    result: R = _eager(fn, *args, **kwargs)
    return result


def _call(fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
    return fn(*args, **kwargs)


#: ``fn(*args, **kwargs)`` with Dynamo's frame hook off for every frame it enters.
_eager: Callable[..., Any] = torch.compiler.disable(_call)


class UncompiledMode(PlainDispatchMode):
    """A dispatch mode whose ops are handled eagerly, as `uncompiled` runs a hook.

    Subclasses implement `dispatch`. Dynamo never traces ``__torch_dispatch__``
    itself (`never_traced`), and when its frame hook is set (a compiled
    module run inside a region), `dispatch` runs with the hook off; without
    the hook, `dispatch` is called directly.
    """

    #: Runs ``func`` on ``args`` and ``kwargs`` as the mode does: each subclass
    #: defines it (``RecordMode``, ``ReplayMode``).
    dispatch: Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        # Per mode, not once: resetting Dynamo may forget a code object's strategy.
        never_traced(UncompiledMode.__torch_dispatch__.__code__)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        if dynamo_frame_hook() is None:
            return self.dispatch(func, args, kwargs or {})
        return _eager(self.dispatch, func, args, kwargs or {})
