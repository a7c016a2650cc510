"""Each op gets the Function's view of what ``fn`` reached.

NOTE [ The functional engine ] rule 2 (in ``__init__.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import optree
import torch
from torch.overrides import TorchFunctionMode

from ..._capture.restoring import RestoringGuard
from ..._compat import current_level, is_functorch_wrapped, unwrap_once
from ..._state import local
from .arguments import (
    _flat,
)
from .guard import GuardedCall, _HiddenInputGuard, unsubstituted_error


class SubstitutedCall(GuardedCall, Protocol):
    """One call of a region as the substitution sees it (`_Call` in ``call.py``)."""

    reads: list[tuple[Any, tuple[tuple[int, int], ...]]] | None
    guard: _HiddenInputGuard | None
    reached: dict[int, str]


class _Substitution(TorchFunctionMode):
    """Give each op the Function's view of each tensor ``fn`` reached.

    NOTE [ The functional engine ] rule 2.

    ``table`` maps the ``id`` of a tensor as ``fn`` reaches it (a leaf of an
    argument, a closed-over tensor, what a rebound slot holds now) to what the
    op must get: the Function's input (unwrapped, or the inner ``vjp``'s
    wrapper) or a snapshot. A mode is per thread, and no slot is written:
    another thread reading the same tensors sees its own. The first run of a
    call (the forward) writes ``trace``: per op, which leaves were which input.
    A later run (a recompute) also gives a leaf the table does not know the
    input the forward had there, while its ops are the forward's (a list
    appended to since the forward, read as ``store[-1]``).
    """

    def __init__(
        self, call: SubstitutedCall, table: dict[int, torch.Tensor], tensors: Sequence[torch.Tensor]
    ) -> None:
        super().__init__()
        self.table = table
        self.tensors = tensors
        self.replayed = call.reads
        self.reads: list[tuple[Any, tuple[tuple[int, int], ...]]] = []
        self.index = {id(o): i for i, o in enumerate(call.originals)} if call.reads is None else {}
        self.step = 0
        #: The forward's guard (NOTE [ The functional engine ] rule 2), checking each op after
        #: substitution.
        self.guard = call.guard
        #: Forward: ids of the tensors ``fn`` reached that some op got (version-checked).
        self.used: set[int] = set()
        self.watched = call.reached if call.reads is None else {}
        self.call = call
        self.view_ids = {id(t) for t in table.values()}
        #: The innermost level where ``fn`` starts: a deeper one, and ``fn`` runs a
        #: transform (levels are numbered by depth).
        self.depth = current_level() or 0

    def lifted(self, leaf: torch.Tensor) -> None:
        """Refuse a tensor ``fn`` reached that a transform inside ``fn`` wrapped itself.

        ``torch.func.grad(g)(x, self.w)`` wraps every argument at its level, ``self.w``
        too: no op sees ``self.w`` itself, so no op can be given the Function's view
        of it, and whether that transform differentiates it cannot be told reliably
        from inside the forward (its levels are renumbered there). Substituting the
        view would drop that transform's derivative silently; keeping the original
        would drop the region's: `unsubstituted_error` says to pass it as an argument.
        """
        t = leaf
        while is_functorch_wrapped(t):
            if id(t) in self.view_ids:
                return  # a view the engine handed over (or a wrapper of one)
            t = unwrap_once(t)
            if id(t) in self.table:
                raise unsubstituted_error(self.call)

    def __enter__(self) -> _Substitution:
        super().__enter__()  # type: ignore[no-untyped-call]
        local.substitutions.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        local.substitutions.pop()
        super().__exit__(*exc)  # type: ignore[no-untyped-call]

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        flat = _flat(args, kwargs)
        tree: Any = (args, kwargs)
        leaves, treedef = (flat, None) if flat is not None else optree.tree_flatten(tree)
        # remat's own work inside ``fn`` (the state guard's copies) is no op of the
        # forward's record: substituted by identity only, neither recorded nor stepped.
        ours = bool(local.internal_depth)
        expected = None if ours else self._expected(func)
        uses: list[tuple[int, int]] = []
        changed = False
        inner: bool | None = None  # whether a transform ``fn`` runs itself is live
        for j, leaf in enumerate(leaves):
            if not isinstance(leaf, torch.Tensor):
                continue
            if id(leaf) in self.watched and not ours:  # not the state guard's copies
                self.used.add(id(leaf))
            new = self.table.get(id(leaf))
            if new is None and is_functorch_wrapped(leaf):
                if inner is None:  # once per call, and only for a wrapped leaf not mapped
                    inner = (current_level() or 0) > self.depth
                if inner:
                    self.lifted(leaf)
            if new is None and expected:
                new = self._as_in_forward(expected.get(j), leaf)
            if new is not None:
                if self.replayed is None and id(leaf) in self.index:
                    uses.append((j, self.index[id(leaf)]))
                leaves[j] = new
                changed = True
        if self.replayed is None and not ours:
            self.reads.append((func, tuple(uses)))
        new_args: Any = args
        new_kwargs: Any = kwargs
        if changed and treedef is None:  # flat: positional arguments, then keyword values
            new_args = tuple(leaves[: len(args)])
            new_kwargs = dict(zip(kwargs, leaves[len(args) :], strict=True))
        elif changed:
            assert treedef is not None, "this is a bug in remat, please report it"
            new_args, new_kwargs = optree.tree_unflatten(treedef, leaves)
        if self.guard is not None:
            return self.guard.run(func, new_args, new_kwargs, leaves)
        return func(*new_args, **new_kwargs)

    def _as_in_forward(self, i: int | None, leaf: torch.Tensor) -> torch.Tensor | None:
        """In a recompute: the input the forward's op had where ``leaf`` is now, if another.

        A copy a state guard put in a buffer slot for the recompute (BatchNorm's
        running statistics, NOTE [ State the forward changes ]; the guard is the
        region's, or a wrapped module's own) stays: the recompute
        must read the forward's starting value and write the copy, not the input
        that the forward's op updated in place (an input of an outer level, which a
        transform refuses to mutate).
        """
        if i is None or leaf is self.tensors[i] or _guard_gives(leaf):
            return None
        return self.tensors[i]

    def _expected(self, func: Any) -> dict[int, int] | None:
        """In a recompute: which leaves of this op were which input in the forward."""
        if self.replayed is None:
            return None
        step, self.step = self.step, self.step + 1
        if step >= len(self.replayed):
            self.replayed = []
            return None
        then, uses = self.replayed[step]
        if then is not func and then != func:
            self.replayed = []  # the ops differ from here on: by identity only
            return None
        return dict(uses) if uses else None


def _guard_gives(leaf: torch.Tensor) -> bool:
    """Whether a state guard running a recompute put ``leaf`` in a slot (`RestoringGuard.gives`)."""
    return any(isinstance(g, RestoringGuard) and g.gives(leaf) for g in local.state_guards)
