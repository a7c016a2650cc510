"""The determinism check that every policy gets: the recompute's ops and shapes.

NOTE [ Recompute signatures ]
1. Policies that record ops (``dots-saveable``, names, ``save-last``) compare
   the recompute op by op with the forward's log (``_replay/records.py``). Policies that
   record nothing (``nothing-saveable``) need a cheaper signature, taken where
   the engine already looks at every value:
2. Eager engine: the pack hook sees every tensor autograd saves, in order. Each
   saved tensor's signature is (shape, dtype, device, what made it): the type of
   its ``grad_fn`` (``SinBackward0``), or "input" for a region input (its
   ``grad_fn`` is outside the region, and the recompute's detached copies have
   none). The recompute's k-th saved tensor must have the forward's k-th
   signature (`saved_signature`, `check_saved` in ``_replay/saved_signatures.py``).
3. torch.func engine: the forward's hidden-input guard (a `TorchFunctionMode`
   that sees every call anyway) records each Python-level torch call of ``fn``
   with the shapes and dtypes of its tensor arguments (`OpTrace`); a `TraceMode`
   around ``fn`` in each recompute finds its calls, in order, among them (the
   forward may run more: code guarded by ``not remat.is_recomputing()``; a
   call the forward did not make from there on is a mismatch). A call is its
   function, the shapes of its tensor arguments and which call made each
   (a tensor the recompute's calls did not make may stand for any): a recompute's
   ``h @ w`` does not pass for a skipped forward-only ``h.detach() @ w`` of the
   same shapes, which would name the wrong maker for what follows. Python-level
   calls, not aten ops: the plain forward (no ``vjp`` under ``nothing-saveable``)
   and the recompute (under ``vjp``) decompose composite ops differently, but
   call the same functions on the same logical shapes.
   A region called inside the traced one is one entry (its label and input
   shapes): its machinery differs between forward and recompute, and it checks
   its own body.
4. A mismatch raises `NondeterministicRecomputeError` (`divergence`) naming the
   region, what differed, and the fixes that work for each usual cause: a cache
   the region grows and reads back (Hugging Face ``use_cache``), Python state
   changed between forward and backward, or ``policy='everything-saveable'``
   (no recompute). ``determinism_check=False`` turns these checks off; it fixes
   nothing, so no message suggests it.
5. Both engines report a signature that differs through one entry, `expect_same`
   (compare the forward's side with the recompute's, raise `differs`), or
   `differs` itself where the engine finds the difference its own way: the eager
   engine's saved tensors (`check_saved`) and how many it saved, the torch.func
   engine's calls, the makers of its outputs and its output structure. Each
   message reads "<what> (forward: ...; recompute: ...)", after the region's name
   and source line, and before the cures of rule 4.
"""

from __future__ import annotations

import contextlib
import operator
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import optree
import torch
from torch.overrides import TorchFunctionMode

from .._errors import NondeterministicRecomputeError
from .._state import INTERNAL
from .._state import local as state

__all__ = [
    "CURES",
    "OpTrace",
    "TraceMode",
    "arg_shapes",
    "differs",
    "divergence",
    "expect_same",
    "inner_region",
    "refuse_growing_cache",
]

T = TypeVar("T")

#: The fixes that work, one per usual cause of a recompute that differs (NOTE rule 4).
CURES = (
    "Usual causes and their fixes: (1) state the function appends to and reads back "
    "(a KV cache: the recompute sees the forward's entries as well as its own): for "
    "Hugging Face models pass use_cache=False in training (or set "
    "model.config.use_cache = False); otherwise pass the cache in as an argument and "
    "return the new entries instead of appending inside the region. (2) Python state "
    "it reads (a flag, a mode, a counter) changed between forward and backward: pass "
    "it as an argument (static_argnums/static_argnames for Python values), or change "
    "it only after backward. (3) Or use policy='everything-saveable' for this region "
    "(nothing is recomputed; memory as without remat)."
)


#: Hugging Face caches that grow by appending (``torch.cat``) in each forward.
_GROWING_CACHES = frozenset({"DynamicCache", "EncoderDecoderCache"})


#: Per argument type, whether it is such a cache (the check runs on every call).
_grows_by_type: dict[type, bool] = {}


def _grows(kind: type) -> bool:
    found = _grows_by_type.get(kind)
    if found is None:
        found = _grows_by_type[kind] = any(
            c.__name__ in _GROWING_CACHES and c.__module__.startswith("transformers")
            for c in kind.__mro__
        )
    return found


def refuse_growing_cache(label: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raise when a recomputed region is handed a cache its forward appends to.

    A Hugging Face ``DynamicCache`` passed to a layer (``use_cache=True`` in
    training) is appended to in the forward and again in the recompute: the cache
    ends up with every entry twice, and under the torch.func engine the recompute
    reads the forward's entries too. Found by type, at the call, in both engines.
    """
    for value in (*args, *kwargs.values()):
        if _grows(type(value)):
            raise divergence(
                label,
                f"it is given a Hugging Face {type(value).__name__} that its forward "
                "appends to, and its recompute would append again (the KV cache of "
                "use_cache=True)",
            )


def divergence(label: str, what: str, after: str = "") -> NondeterministicRecomputeError:
    """The error for a recompute of region ``label`` that differs from its forward.

    ``after`` follows the cures (the op logs side by side).
    """
    return NondeterministicRecomputeError(
        f"remat: the recompute of {label} differs from its forward: {what}. Its gradients "
        f"would be wrong. {CURES}{after}"
    )


def differs(
    label: str, what: str, forward: object, recompute: object, hint: str = "", after: str = ""
) -> NondeterministicRecomputeError:
    """The error for a recompute of ``label`` whose ``what`` is not the forward's (NOTE rule 5).

    ``forward`` and ``recompute`` are the two sides, described; ``hint`` follows them.
    """
    return divergence(
        label, f"{what} (forward: {forward}; recompute: {recompute}){hint}", after
    )


def expect_same(
    label: str,
    what: str,
    forward: T,
    recompute: T,
    *,
    same: Callable[[T, T], bool] = operator.eq,
    describe: Callable[[T], object] = str,
    hint: str = "",
) -> None:
    """Raise `differs` unless the recompute's signature ``what`` is the forward's (NOTE rule 5)."""
    if not same(forward, recompute):
        raise differs(label, what, describe(forward), describe(recompute), hint)


# ---------------------------------------------------------------------------
# torch.func engine (NOTE rule 3)
# ---------------------------------------------------------------------------

#: One Python-level call: (function, ((shape, dtype) of each tensor argument), the
#: forward call that made each tensor argument (None: no call of the function)).
Call = tuple[Any, tuple[tuple[torch.Size, torch.dtype], ...], tuple[int | None, ...]]




class OpTrace:
    """The forward's calls of one region call, and the check of each recompute against them.

    The forward is recorded through the engine's hidden-input guard, a
    `TorchFunctionMode` that sees every call anyway (`offer`): no second mode
    there. A recompute runs under a `TraceMode` of its own.
    """

    def __init__(self, label: str, enabled: bool) -> None:
        self.label = label
        self.enabled = enabled
        self.calls: list[Call] = []
        self.recorded = False
        #: While recording: which call made each tensor (by id, with a weak reference
        #: so that a reused id is not taken for its dead tensor's maker).
        self.makers = _Makers()
        #: After the forward: the call that made each output tensor (None: not a call's).
        self.output_calls: list[int | None] | None = None
        #: The recompute's `TraceMode` of the latest run.
        self.checking: TraceMode | None = None

    def watching(self) -> contextlib.AbstractContextManager[Any]:
        """Around one run of ``fn``: record it (the first run) or check it against the record."""
        if not self.enabled:
            return contextlib.nullcontext()
        if self.recorded:
            self.checking = TraceMode(self)
            return self.checking
        return self._recording()

    @contextlib.contextmanager
    def _recording(self) -> Iterator[None]:
        state.traces.append(self)
        try:
            yield
        finally:
            state.traces.pop()
        self.recorded = True

    def offer(self, func: Any, args: tuple[Any, ...], kwargs: Any) -> OpTrace | None:
        """A call the guard saw: recorded by the innermost trace recording a run of ``fn``.

        Returns the trace that recorded it (the guard reports what the call made to
        it, `made`), or None.

        That is this call's, or, under the vmap rule, the original call's: the twin
        whose guard sees the call runs the original's ``fn`` per example (NOTE [ The
        functional engine ] rule 10). Not inside inner regions, nor remat's own work.
        """
        top = state.traces[-1] if state.traces else None
        if isinstance(top, OpTrace) and not state.internal_depth:
            makers = top.makers
            top.calls.append((func, arg_shapes(args, kwargs), _arg_makers(args, kwargs, makers.of)))
            return top
        return None

    def made(self, leaves: Sequence[Any]) -> None:
        """The tensors the call just offered made (the guard calls this after it ran)."""
        self.makers.note(leaves, len(self.calls) - 1)

    def outputs(self, out: Sequence[Any]) -> None:
        """After a run of ``fn``: note (forward) or check (recompute) who made its outputs.

        The recompute's calls may skip some of the forward's (NOTE rule 3); an
        output made by a call other than the forward's (an op dropped at the end,
        a flag that skips it) is a mismatch all the same.
        """
        if not self.enabled:
            return
        if self.output_calls is None:
            self.output_calls = [self.makers.of(t) for t in out]
            self.makers = _Makers()
            return
        mode, self.checking = self.checking, None
        if mode is None:
            return
        for position, (then, now) in enumerate(
            zip(self.output_calls, (mode.makers.of(t) for t in out), strict=False)
        ):
            expect_same(
                self.label, f"the maker of its output #{position}", then,
                None if now is None else mode.matched[now],
                describe=lambda index: _describe_made(self.calls, index),
            )

    def note(self, call: Call) -> None:
        self.calls.append(call)


class TraceMode(TorchFunctionMode):
    """Check every torch call of a recompute of ``fn`` against the forward's (NOTE rule 3)."""

    def __init__(self, trace: OpTrace) -> None:
        super().__init__()
        self.trace = trace
        self.index = 0
        #: Which of the recompute's calls (by its count) made each tensor.
        self.makers = _Makers()
        #: The forward call each of the recompute's calls matched.
        self.matched: list[int] = []

    def __enter__(self) -> TraceMode:
        super().__enter__()  # type: ignore[no-untyped-call]
        state.traces.append(self)
        return self

    def __exit__(self, kind: Any, value: Any, tb: Any) -> None:
        state.traces.pop()
        super().__exit__(kind, value, tb)  # type: ignore[no-untyped-call]

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        # Not inside an inner region, nor remat's own work (the state guard's snapshots).
        if not (state.traces and state.traces[-1] is self and not state.internal_depth):
            return func(*args, **(kwargs or {}))
        # Reading shapes is a torch call (a property) that modes below must not number.
        with INTERNAL:
            call = (func, arg_shapes(args, kwargs), _arg_makers(args, kwargs, self._made_by))
        self.note(call)
        out = func(*args, **(kwargs or {}))
        self.makers.note(optree.tree_leaves(out, none_is_leaf=False), len(self.matched) - 1)
        return out

    def _made_by(self, t: Any) -> int | None:
        """The forward call matched by the recompute's call that made ``t``."""
        ordinal = self.makers.of(t)
        return None if ordinal is None else self.matched[ordinal]

    def note(self, call: Call) -> None:
        # The recompute's calls, in order, among the forward's: the forward may run
        # more (code under ``if not remat.is_recomputing()``), never others.
        calls = self.trace.calls
        for j in range(self.index, len(calls)):
            if _same_call(calls[j], call):
                self.index = j + 1
                self.matched.append(j)
                return
        raise self.mismatch(call)

    def mismatch(self, call: Call | None) -> NondeterministicRecomputeError:
        calls = self.trace.calls
        expected = calls[self.index] if self.index < len(calls) else None
        return differs(
            self.trace.label, f"call #{self.index}", _describe_call(expected), _describe_call(call)
        )


class _Makers:
    """Which traced call made each tensor: id -> (weak reference, call index)."""

    def __init__(self) -> None:
        self.by_id: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}

    def note(self, leaves: Sequence[Any], index: int) -> None:
        for t in leaves:
            if isinstance(t, torch.Tensor):
                self.by_id[id(t)] = (weakref.ref(t), index)

    def of(self, t: Any) -> int | None:
        entry = self.by_id.get(id(t)) if isinstance(t, torch.Tensor) else None
        return entry[1] if entry is not None and entry[0]() is t else None


def _describe_made(calls: Sequence[Call], index: int | None) -> str:
    if index is None:
        return "no call of the function (an input, or a tensor made by another region)"
    return f"call #{index} ({_describe_call(calls[index])})"


@contextlib.contextmanager
def inner_region(label: str, inputs: Any) -> Iterator[None]:
    """A region called inside a traced one: one entry there, and untraced by it (NOTE rule 3)."""
    top = state.traces[-1] if state.traces else None
    state.traces.append(None)  # first: reading shapes is a torch call the trace must not see
    try:
        if top is not None:
            top.note((label, _shapes(optree.tree_leaves(inputs, none_is_leaf=False)), ()))
        yield
    finally:
        state.traces.pop()


def _shapes(leaves: Sequence[Any]) -> tuple[tuple[torch.Size, torch.dtype], ...]:
    return tuple((x.shape, x.dtype) for x in leaves if isinstance(x, torch.Tensor))


def arg_shapes(args: tuple[Any, ...], kwargs: Any) -> tuple[tuple[torch.Size, torch.dtype], ...]:
    """(shape, dtype) of the tensors among a call's arguments and in their lists (a hot path)."""
    found: list[tuple[torch.Size, torch.dtype]] = []
    for arg in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(arg, torch.Tensor):
            found.append((arg.shape, arg.dtype))
        elif isinstance(arg, (list, tuple)):
            found.extend((t.shape, t.dtype) for t in arg if isinstance(t, torch.Tensor))
    return tuple(found)


def _same_call(forward: Call, recompute: Call) -> bool:
    """Whether the recompute's call may be the forward's (NOTE rule 3).

    A tensor no call of the recompute made (an input, a closed-over tensor, the
    forward's own tensor read again, such as a table built on the first call)
    may stand where the forward's call read any.
    """
    if forward[0] != recompute[0] or forward[1] != recompute[1]:
        return False
    return all(
        now is None or now == then for then, now in zip(forward[2], recompute[2], strict=True)
    )


def _arg_makers(
    args: tuple[Any, ...], kwargs: Any, made_by: Callable[[Any], int | None]
) -> tuple[int | None, ...]:
    """Which call made each tensor argument (`arg_shapes`' tensors, in its order).

    Shapes alone would let a recompute's ``h @ w`` pass for a forward-only
    ``h.detach() @ w`` of the same shapes that it skipped (NOTE rule 3).
    """
    found: list[int | None] = []
    for arg in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(arg, torch.Tensor):
            found.append(made_by(arg))
        elif isinstance(arg, (list, tuple)):
            found.extend(made_by(t) for t in arg if isinstance(t, torch.Tensor))
    return tuple(found)


def _describe_call(call: Call | None) -> str:
    if call is None:
        return "nothing (it had ended)"
    func, shapes, _ = call
    args = ", ".join(f"{tuple(shape)} {dtype}" for shape, dtype in shapes)
    return f"{_func_name(func)} on tensors of shape [{args}]"


def _func_name(func: Any) -> str:
    if isinstance(func, str):
        return f"the region {func}"
    owner = getattr(func, "__self__", None)
    if owner is not None and hasattr(owner, "__name__"):  # a property getter
        return f"Tensor.{owner.__name__}"
    name = str(getattr(func, "__qualname__", None) or getattr(func, "__name__", func))
    module = getattr(func, "__module__", None)
    name = name.replace("TensorBase.", "Tensor.").replace("_VariableFunctionsClass.", "")
    if module and module.startswith("torch") and not name.startswith("Tensor."):
        return f"{module}.{name}"
    return name
