"""Noting what a region's forward may let out (NOTE [ Escaped tensors ] rule 2 in
``_engines/escapes.py``)."""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from .._state import INTERNAL, local

__all__ = ["EscapeNotes"]

#: Calls whose output carries no gradient whatever their input (``.data`` is a property).
_DETACHING = frozenset({"detach", "detach_", "data"})


@dataclasses.dataclass(eq=False)
class _Escape:
    """One tensor that left the forward other than through its outputs."""

    call: int
    position: int
    op: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    #: The user's Python object until `EscapeWatch.adopt` swaps it (then None).
    target: torch.Tensor | None = None

    def describe(self) -> str:
        return f"shape {self.shape}, dtype {self.dtype}, made by {self.op}"


class EscapeNotes(TorchFunctionMode):
    """The forward half of `EscapeWatch`: number ``fn``'s torch calls, note tainted outputs.

    NOTE [ Escaped tensors ] rule 2 (in ``_engines/escapes.py``).
    """

    def __init__(self, label: str) -> None:
        super().__init__()
        self.label = label
        #: Whether ``fn`` itself is running (only its calls are numbered).
        self.active = False
        self.count = 0
        #: Forward: (call, position, weak reference, op name) of each tainted output.
        self.noted: list[tuple[int, int, Any, str]] = []
        self.tainted: set[int] = set()
        #: Forward: whether grad mode inside ``fn`` tells what carries a gradient.
        self.grad_mode_counts = True
        self.noting = False
        self.found: list[_Escape] = []
        #: Recompute: call number -> [(position, slot in ``captured``)].
        self.wanted: dict[int, list[tuple[int, int]]] | None = None
        self.captured: list[torch.Tensor | None] = []
        #: False for a vmap twin: the call it is for watches inside the vmap (rule 6).
        self.enabled = True

    # -- numbering -------------------------------------------------------------

    def counted(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn``, numbering the torch calls it makes (NOTE [ Escaped tensors ] rule 2)."""

        def run(*args: Any, **kwargs: Any) -> Any:
            previous, self.active, self.count = self.active, True, 0
            try:
                return fn(*args, **kwargs)
            finally:
                self.active = previous

        return run

    # -- forward ---------------------------------------------------------------

    @contextlib.contextmanager
    def watching(self, differentiated: Sequence[torch.Tensor]) -> Iterator[None]:
        """The forward: `note` tainted outputs of ``fn``'s calls (seeds: differentiated inputs).

        The forward's `TorchFunctionMode` (the engine's hidden-input guard, the
        only one there) calls `note` for each call: one mode less on every op.
        """
        if not self.enabled:
            yield
            return
        self.taint(differentiated)
        # The Function runs the plain forward with grad disabled: then grad mode
        # inside ``fn`` says nothing, and every tainted output may carry a gradient.
        self.grad_mode_counts = torch.is_grad_enabled()
        self.noting = True
        try:
            yield
        finally:
            self.noting = False

    @contextlib.contextmanager
    def watching_calls(self, differentiated: Sequence[torch.Tensor]) -> Iterator[None]:
        """`watching`, this watch itself noting each call (no guard runs there, rule 6)."""
        with self.watching(differentiated), self:
            yield

    def taint(self, tensors: Sequence[Any]) -> None:
        self.tainted.update(id(t) for t in tensors if isinstance(t, torch.Tensor))

    def note(
        self,
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        arg_leaves: list[Any],
        leaves: list[Any],
    ) -> None:
        """A torch call in the forward: number it, note its tainted outputs (rule 2).

        ``arg_leaves`` are the leaves of ``(args, kwargs)``, ``leaves`` those of its
        output with ``none_is_leaf=True`` (as `_capture` numbers them).
        """
        if not (self.noting and self.active) or local.internal_depth:
            return
        index = self.count
        self.count += 1
        # Our reads (``is_floating_point``) are torch calls: modes below must not number
        # them (`INTERNAL`: this runs on every call of the forward).
        with INTERNAL:
            self._note(index, func, args, kwargs, arg_leaves, leaves)

    def _note(
        self,
        index: int,
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        arg_leaves: list[Any],
        leaves: list[Any],
    ) -> None:
        name = _name(func)
        if name in _DETACHING or (self.grad_mode_counts and not torch.is_grad_enabled()):
            return
        tainted = self.tainted
        given = {id(leaf) for leaf in arg_leaves}
        if tainted.isdisjoint(given):
            return
        for position, t in enumerate(leaves):
            # An op may return an argument itself (``to`` a dtype it has, in-place
            # ops): that tensor was not made here, and may be the engine's input.
            if (
                isinstance(t, torch.Tensor)
                and id(t) not in given
                and (t.is_floating_point() or t.is_complex())
            ):
                tainted.add(id(t))
                self.noted.append((index, position, weakref.ref(t), name))
        # An in-place write (``a.add_(b)``, ``a[i] = b``, ``out=``) taints its target.
        if args and isinstance(args[0], torch.Tensor) and (
            (name.endswith("_") and not name.endswith("__")) or name == "__setitem__"
        ):
            tainted.add(id(args[0]))
        if isinstance(kwargs.get("out"), torch.Tensor):
            tainted.add(id(kwargs["out"]))


def _name(func: Any) -> str:
    """A torch call's name; a property's getter is named by the property (``data``, ``T``)."""
    name = getattr(func, "__name__", None)
    if name == "__get__":
        name = getattr(getattr(func, "__self__", None), "__name__", None)
    return name if isinstance(name, str) else str(func)
