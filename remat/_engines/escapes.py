"""Tensors that leave a torch.func region other than through its return value.

NOTE [ Escaped tensors ]
1. The problem. An `autograd.Function` differentiates only what its forward
   returns. A tensor ``fn`` hands out any other way (a forward hook appending a
   submodule's output to a list, as Hugging Face's ``output_router_logits`` and
   ``output_attentions`` capture does; ``self.last = h``; a global list) is, in
   the functional engine, a plain tensor made below every level: a loss term on
   it silently gets no gradient.
2. Noting. While ``fn`` runs in the forward, `EscapeWatch.note` (called by
   the forward's one `TorchFunctionMode`, the engine's hidden-input guard)
   numbers every top-level torch call and keeps a weak reference to each
   floating output that depends on a differentiated input
   (a taint set of ids, seeded with those inputs; ``detach``/``.data`` and ops
   run with grad disabled inside ``fn`` do not carry it). Only calls made while
   ``fn`` itself runs are numbered (`EscapeWatch.counted`), so the engine's own
   calls never shift the numbers.
3. Finding. When the forward ends, a noted tensor that is still alive and held
   by a Python reference that is not the engine's escaped. Torch keeps a
   tensor's Python object alive while C++ holds its impl (a view's base, a
   graph's saved value), and then the impl holds one Python reference; so the
   count is ``sys.getrefcount`` less our own references, less the engine's
   (the outputs), less one when ``_use_count() > 1``. A reference cycle not yet
   collected counts as a holder: that tensor becomes an extra output for
   nothing, which costs a little and changes no gradient.
4. Handing back. Each escaped tensor becomes an extra output of the Function
   (a detached alias of its value below the levels that died with the forward,
   so the output chain does not hold the escaped impl). After ``apply``,
   `torch.utils.swap_tensors` gives the user's Python object the Function's
   output: every reference the user holds now sees a tensor that carries its
   gradient. Where the swap is refused (a weak reference to it, a tensor
   subclass, its impl held elsewhere), remat raises `RematError` naming the
   tensor and the fix (return it, or detach it).
5. Recompute. The backward's recompute, with `EscapeWatch`
   entered as a `TorchFunctionMode` (only for calls that had escapes),
   captures the output of the same numbered call and returns it with ``fn``'s outputs, so the vjp
   gives each escaped tensor's cotangent its part of the gradient. The call's
   name, shape and dtype are checked: a recompute that makes something else
   there raises instead of differentiating the wrong tensor.
6. Under the vmap rule (NOTE [ The functional engine ] rule 10) the twin's forward
   runs ``fn`` inside its own ``vmap``, where what ``fn`` lets out is a wrapper
   of that inner level, dead once it exits. So the twin watches nothing itself
   (``enabled``); the call it is for watches each example's run inside the vmap
   (`watching_calls`: no guard runs there, so the watch, as a mode, notes each
   call), collects there, and returns the escaped tensors as extra outputs of
   the vmapped run, hence of the twin and of the vmap rule (batched, or not).
   The user's level then swaps them in as usual (rule 4). Every recompute of
   the twin captures them again inside the vmap (`run` per example, stripping
   the inner ``vjp`` level that ends there, as ``vjp`` does for outputs), and
   the original call's own backward (``vmap(grad)``) by the same call numbers.
   What cannot be handed back is loud: a tensor made inside a vmap that ended
   within ``fn`` (its batch would show as a plain dimension), and one let out
   by a region that runs, undifferentiated, inside another region under vmap.
7. Forward mode. Under ``jvp``, ``jacfwd`` and ``hessian`` (and ``vmap`` of them)
   every differentiable input is watched (`_escape_seeds`: which ones carry a
   tangent cannot be read below another level), so a tensor let out is found.
   It is then refused with `RematError`: the Function's ``jvp`` rule gets its
   tangents by running ``fn`` again at once, inside the user's forward, and
   what ``fn`` stores there (a second list entry, an overwritten attribute) is
   the recompute's tensor, which no level differentiates. The fix named works:
   return the tensor, or store it detached.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch

from .._compat import is_batched, is_functorch_wrapped, unwrap_if_dead
from .._errors import NondeterministicRecomputeError, RematError
from .._replay.checks import CURES
from .._state import local
from .escape_notes import EscapeNotes, _Escape, _name

__all__ = ["EscapeWatch"]


class EscapeWatch(EscapeNotes):
    """Find tensors ``fn`` hands out besides its outputs; capture them again in recompute."""

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.active or local.internal_depth:
            return out
        if self.wanted is not None:
            index = self.count
            self.count += 1
            self._capture(index, func, out)
        elif self.noting:  # a forward with no guard to call `note` (inside a vmap twin)
            tree: Any = (args, kwargs)
            arg_leaves: list[Any] = optree.tree_leaves(tree)
            self.note(func, args, kwargs, arg_leaves, optree.tree_leaves(out, none_is_leaf=True))
        return out

    # -- end of forward, recompute ----------------------------------------------

    def collect(
        self, out: Sequence[torch.Tensor]
    ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """End of forward: find escaped tensors (NOTE [ Escaped tensors ] rule 3).

        Returns ``out`` (an escaped output, or a view of one, replaced by a detached
        alias, so that the Function's output does not hold the escaped impl) and the
        extra outputs.
        """
        noted, self.noted, self.tainted = self.noted, [], set()
        engine = {id(t): 0 for t in out}
        for t in out:
            engine[id(t)] += 1
        seen: set[int] = set()
        for call, position, ref, op in noted:
            t = ref()
            if t is None or id(t) in seen:
                continue
            seen.add(id(t))
            # References: ``t`` here, getrefcount's argument, the engine's, C++'s hold.
            held = sys.getrefcount(t) - 2 - engine.get(id(t), 0) - (t._use_count() > 1)
            if held > 0:
                self.found.append(
                    _Escape(call, position, op, tuple(t.shape), t.dtype, target=t)
                )
            del t
        del noted
        if not self.found:
            return tuple(out), ()
        # An output that is an escaped tensor, or a view of one, holds its impl.
        escaped = {id(e.target) for e in self.found}
        out = tuple(
            t.detach() if id(t) in escaped or (t._is_view() and id(t._base) in escaped) else t
            for t in out
        )
        extras = []
        for escape in self.found:
            assert escape.target is not None, "this is a bug in remat, please report it"
            value = _below_dead_levels(escape.target)
            if value is None:
                raise self._error(
                    escape, "it was made inside a vmap that ended within the region "
                    "(another region's, or the function's own), where it cannot be handed back"
                )
            extras.append(value.detach())
        return out, tuple(extras)

    def adopt(self, outputs: list[torch.Tensor]) -> None:
        """After ``apply``: give each escaped Python object its differentiable output (rule 4).

        ``outputs`` is emptied. Newest first, and each swapped-out value let go at
        once: a dead forward graph that a later escaped tensor still holds may hold
        an earlier one's impl (a cache tensor an attention op saved), which the swap
        would refuse.
        """
        for slot in reversed(range(len(self.found))):
            escape, output = self.found[slot], outputs.pop()
            target, escape.target = escape.target, None
            assert target is not None, "this is a bug in remat, please report it"
            try:
                torch.utils.swap_tensors(target, output)
            except RuntimeError as err:
                raise self._error(escape, f"the swap was refused: {err}") from err
            del target, output  # ``output`` now holds the forward's value: let it go

    def run(self, run: Callable[[], tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
        """``run()``'s outputs followed by the escaped tensors of this recompute (rule 5)."""
        if not self.found:
            return run()
        wanted: dict[int, list[tuple[int, int]]] = {}
        for slot, escape in enumerate(self.found):
            wanted.setdefault(escape.call, []).append((escape.position, slot))
        saved = (self.wanted, self.captured)
        self.wanted, self.captured = wanted, [None] * len(self.found)
        try:
            with self:
                out = run()
            captured = self.captured
        finally:
            self.wanted, self.captured = saved
        missing = [e for e, t in zip(self.found, captured, strict=True) if t is None]
        if missing:
            raise self._error(missing[0], "the recompute did not make it again", diverged=True)
        # ``run`` may end a level it captured under (a vmap twin's recompute runs
        # ``vjp(fn)`` per example, rule 6): unwrap that level as ``vjp`` unwraps outputs.
        values = []
        for escape, t in zip(self.found, captured, strict=True):
            value = _below_dead_levels(t) if t is not None else None
            if value is None:
                raise self._error(escape, "it was made inside a vmap that ended within the region")
            values.append(value)
        return (*out, *values)

    def _capture(self, index: int, func: Any, out: Any) -> None:
        assert self.wanted is not None, "this is a bug in remat, please report it"
        places = self.wanted.get(index)
        if not places:
            return
        leaves: list[Any] = optree.tree_leaves(out, none_is_leaf=True)
        name = _name(func)
        for position, slot in places:
            escape = self.found[slot]
            t = leaves[position] if position < len(leaves) else None
            if (
                not isinstance(t, torch.Tensor)
                or name != escape.op
                or t.dtype != escape.dtype
            ):
                raise self._error(
                    escape, f"the recompute made something else in its place ({name})",
                    diverged=True,
                )
            self.captured[slot] = t

    def error_for_first(self, reason: str) -> RematError:
        """The error for the first escaped tensor found (`_error`)."""
        return self._error(self.found[0], reason)

    def _error(self, escape: _Escape, reason: str, diverged: bool = False) -> RematError:
        """The error for an escape that cannot be handed back; ``diverged``: the
        recompute differs from the forward there (its usual causes and cures follow)."""
        kind = NondeterministicRecomputeError if diverged else RematError
        cures = f" {CURES}" if diverged else ""
        return kind(
            f"remat: {self.label} let a tensor out other than through its return value "
            f"({escape.describe()}; kept by a forward hook, a list, an attribute or a "
            f"global), and under torch.func {reason}, so its gradient would be wrong. "
            "Return the tensor from the function (for a hook, return what it collects), "
            "or store `t.detach()` if no gradient should flow through it. In a Hugging "
            "Face model a KV cache filled during training is such a tensor: pass "
            "use_cache=False (as its own gradient checkpointing does). If this region "
            "runs another rematerialized region, or runs inside one, remat only one of "
            f"them.{cures}"
        )

def _below_dead_levels(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` without the wrappers of levels that exited with the forward (its inner vjp).

    None where one of them is a vmap's: below it the batch is a plain dimension,
    and the value is no longer the tensor the user holds (a vmap inside ``fn``).
    """
    while is_functorch_wrapped(t):
        inner = unwrap_if_dead(t)
        if inner is t:
            break
        if is_batched(t):
            return None
        t = inner
    return t
