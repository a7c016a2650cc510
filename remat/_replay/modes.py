"""The dispatch modes that record a region's forward and replay it in the recompute.

`RecordMode` fills an `OpLog` (``_replay/records.py``) in the forward;
`ReplayMode` runs the recompute against it, returning kept outputs instead of
running their ops. The rules are NOTE [ Record and replay ] in ``_replay/records.py``.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import _compat
from .._compile import UncompiledMode
from .._errors import NondeterministicRecomputeError
from .._state import local
from .checks import CURES, arg_shapes, divergence
from .records import OpLog, detached_alias
from .stand_ins import stand_in
from .tags import inherit_tag
from .traits import scalars_of, traits

__all__ = ["RecordMode", "ReplayMode", "detached", "side_by_side"]

# NOTE: `detach` is invisible to both modes. The engines detach tensors inside
# saved-tensor hooks, at points that differ between forward and recompute; a
# detached tensor carries its source's tag so the policy still applies to it.
_DETACH = torch.ops.aten.detach.default


class RecordMode(UncompiledMode):
    """Record every op of a region's forward into an `OpLog` (see NOTE rule 1)."""

    def __init__(self, log: OpLog) -> None:
        super().__init__()
        self.log = log

    def __enter__(self) -> RecordMode:
        local.recorders.append(self)
        try:
            super().__enter__()  # type: ignore[no-untyped-call]
        except BaseException:
            local.recorders.pop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            super().__exit__(*exc)  # type: ignore[no-untyped-call]
        finally:
            local.recorders.remove(self)

    def dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        out = func(*args, **kwargs)
        if func is _DETACH:
            inherit_tag(args[0], out)
        else:
            self.log.record(func, args, kwargs, out)
        return out


class ReplayMode(UncompiledMode):
    """Recompute a region, returning kept outputs instead of running their ops."""

    def __init__(
        self,
        log: OpLog,
        check: bool = True,
        live: list[bool] | None = None,
        held: dict[tuple[int, int], torch.Tensor] | None = None,
        release: bool = False,
    ) -> None:
        super().__init__()
        self.log = log
        self.check = check
        self.live = live
        #: Dead ops' outputs that backward holds anyway, by (op, position): handed on
        #: instead of stand-ins (NOTE [ Record and replay ] rule 5).
        self.held = held or {}
        #: Release each record's kept outputs once replayed (the eager engine's
        #: recompute after its forward: NOTE [ The eager engine ] rule 7).
        self.release = release
        self.index = 0
        # The ops the recompute ran, for error messages. While every op matches
        # the forward (``check``) they are the forward's first ``index`` ops, so
        # they are listed only once one did not (or when nothing checks them).
        self._ran: list[Any] | None = None if check else []

    @property
    def ran(self) -> list[Any]:
        """The ops the recompute ran so far (``detach`` aside)."""
        if self._ran is not None:
            return self._ran
        return [rec.op for rec in self.log.records[: self.index]]

    def dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if func is _DETACH:
            return func(*args, **kwargs)
        index = self.index
        self.index += 1
        records = self.log.records
        rec = records[index] if index < len(records) else None
        if self._ran is not None:
            self._ran.append(func)
        if rec is None or rec.op != func:
            if self.check or rec is not None:  # rule 6: a misplaced replay is garbage
                raise self.mismatch(index, func)
        elif self.check:
            scalars = scalars_of(args, kwargs)
            if rec.scalars != scalars:
                raise self.mismatch(index, func, rec.scalars, scalars)
        if rec is None:
            return func(*args, **kwargs)
        kept, full = rec.replay_state()
        if full:
            assert kept is not None, "this is a bug in remat, please report it"
            if rec.input_shapes is not None and rec.input_shapes != arg_shapes(args, kwargs):
                # Rule 6: the forward's outputs for other inputs would be garbage.
                raise divergence(
                    self.log.label,
                    f"op #{index} ({func}) got tensors of shapes "
                    f"{_shape_list(rec.input_shapes)} in the forward and "
                    f"{_shape_list(arg_shapes(args, kwargs))} in the recompute",
                )
            out = _rebuild(func, _detached_aliases(kept))
            if self.release:
                rec.release()
            return out
        if self.live is not None and not self.live[index]:
            dead = [self._dead(index, p, meta) for p, meta in enumerate(rec.metas)]
            # Views always run (free), unless backward holds what they return.
            if not traits(func).view or not any(t.is_meta for t in dead):
                return _rebuild(func, dead)
        out = func(*args, **kwargs)
        if kept is not None:
            out = _substitute(out, kept)
            if self.release:
                rec.release()
        return out

    def _dead(self, index: int, position: int, meta: tuple[Any, ...]) -> torch.Tensor:
        held = self.held.get((index, position))
        if held is not None and (held.shape, held.stride(), held.dtype) == meta:
            return held
        return stand_in(meta, self.log.serial, self.log.label, self.log.records[index].op)

    def mismatch(
        self, index: int, func: Any, forward_scalars: Any = None, recompute_scalars: Any = None
    ) -> NondeterministicRecomputeError:
        if self._ran is None:
            # The ops before ``index`` matched the forward's; from here on, list each.
            self._ran = [rec.op for rec in self.log.records[:index]] + [func]
        forward = self.log.op_names()
        expected = forward[index] if index < len(forward) else "(the forward had ended)"
        if forward_scalars is None:
            what = f"the forward ran {expected}, the recompute ran {func}"
        else:
            what = (
                f"{func} got the numbers {forward_scalars} in the forward and "
                f"{recompute_scalars} in the recompute (Python state it reads changed)"
            )
        # determinism_check=False is no cure: it skips only the numbers' comparison.
        return NondeterministicRecomputeError(
            f"remat: the recompute of {self.log.label} differs from its forward at op "
            f"#{index}: {what}. Its gradients would be wrong. {CURES}\n"
            + side_by_side(forward, [str(f) for f in self.ran])
        )


#: The modes `detached` steps past.
_OURS = (RecordMode, ReplayMode)


def detached(t: torch.Tensor) -> torch.Tensor:
    """``t.detach()``, as remat's modes would make it, without a Python call of each.

    For the engines' saved-tensor hooks (outside ``__torch_dispatch__``, so the
    alias shares ``t``'s version counter). Where only remat's modes are active
    and ``t`` is a plain tensor, the detach runs below them, and the tag a
    `RecordMode` would pass on (see the NOTE on ``detach`` above) is passed on
    here; anywhere else (a user's mode, a tensor subclass) it is a plain ``detach``.

    Examples:
        >>> x = torch.ones(2)
        >>> y = detached(x)
        >>> y.requires_grad, y._version == x._version
        (False, True)
    """
    if not _compat.dispatch_mode_depth():  # no mode to step past, no tag to pass on
        return t.detach()
    modes = _compat.modes_if_only(_OURS)
    if modes is not None and (alias := _compat.detach_past_modes(t)) is not None:
        if any(type(mode) is RecordMode for mode in modes):
            inherit_tag(t, alias)
        return alias
    return t.detach()


def _shape_list(shapes: tuple[Any, ...]) -> str:
    return "[" + ", ".join(str(tuple(shape)) for shape, _ in shapes) + "]"


def _rebuild(func: Any, tensors: list[torch.Tensor]) -> Any:
    kind = traits(func).returns
    if kind == "tensor":
        return tensors[0]
    if kind == "list":
        return list(tensors)
    return tuple(tensors)


def _detached_aliases(kept: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """`detached_alias` of each kept output, under one guard (a hot path)."""
    with _compat.keeping_version_counters():
        return [t.detach() for t in kept if t is not None]


def _substitute(out: Any, kept: list[torch.Tensor | None]) -> Any:
    if isinstance(out, torch.Tensor):
        return detached_alias(kept[0]) if kept and kept[0] is not None else out
    items = list(out)
    position = 0
    for i, item in enumerate(items):
        if isinstance(item, torch.Tensor):
            replacement = kept[position] if position < len(kept) else None
            if replacement is not None:
                items[i] = detached_alias(replacement)
            position += 1
    return type(out)(items) if isinstance(out, tuple) else items


def side_by_side(forward: list[str], recompute: list[str], limit: int = 40) -> str:
    """Format the forward and recompute op logs in two columns, marking the first difference."""
    width = max((len(s) for s in forward[:limit]), default=10) + 2
    lines = [f"    {'forward':<{width}}recompute"]
    marked = False
    for i in range(min(max(len(forward), len(recompute)), limit)):
        left = forward[i] if i < len(forward) else "-"
        right = recompute[i] if i < len(recompute) else "-"
        mark = "  "
        if not marked and left != right:
            mark, marked = "->", True
        lines.append(f"{mark}{i:>3} {left:<{width}}{right}")
    return "\n".join(lines)
