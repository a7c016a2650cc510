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
from .alignment import NEEDED, Alignment, Mismatch
from .cast_cache import cacheable, cast_source, casts_of
from .checks import CURES, arg_shapes, divergence
from .record import OpRecord
from .records import OpLog, detached_alias
from .stand_ins import stand_in
from .tags import TAG, inherit_tag
from .traits import scalars_of, traits

__all__ = ["RecordMode", "ReplayMode", "detached", "side_by_side"]

# NOTE: `detach` is invisible to both modes. The engines detach tensors inside
# saved-tensor hooks, at points that differ between forward and recompute; a
# detached tensor carries its source's tag so the policy still applies to it.
_DETACH = torch.ops.aten.detach.default
_TO_COPY = _compat.TO_COPY


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
        #: What the recompute may do with each record, and the readings once it
        #: skipped one (NOTE [ Ops the recompute may skip ] in ``_replay/alignment.py``).
        self.kinds = log.kinds()
        self.alignment: Alignment | None = None
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
            out = func(*args, **kwargs)
            if getattr(args[0], TAG, None) is not None:  # a forward tensor: read as it
                inherit_tag(args[0], out)
            if self.alignment is not None:
                self.alignment.detached(args[0], out)
            return out
        if func is _TO_COPY:
            source = cast_source(func, args, kwargs)
            if source is not None and cacheable(source):
                return self._cast(func, args, kwargs, source)
        if self.alignment is None:
            # The fast path: the forward's next op, which the recompute must run.
            index = self.index
            records = self.log.records
            rec = records[index] if index < len(records) else None
            if rec is None and not self.check:
                self.index += 1
                if self._ran is not None:
                    self._ran.append(func)
                return func(*args, **kwargs)  # past the forward's end: nothing to replay
            if (
                rec is not None
                and rec.op == func
                and self.kinds[index] == NEEDED
                and (not self.check or rec.scalars == scalars_of(args, kwargs))
            ):
                self.index = index + 1
                if self._ran is not None:
                    self._ran.append(func)
                return self._replay(index, rec, func, args, kwargs)
            self._start_aligning()
        return self._aligned(func, args, kwargs)

    def _cast(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], source: torch.Tensor
    ) -> Any:
        """A cast autocast's cache may hold: run unmatched where the forward found it
        cached, else matched to the forward's cast of ``source`` (NOTE [ Autocast's cast
        cache ] rule 2 in ``_replay/cast_cache.py``)."""
        if not casts_of(self.log.casts, source):
            if self._ran is not None:
                self._ran.append(func)
            return func(*args, **kwargs)
        if self.alignment is None:
            self._start_aligning()
        return self._aligned(func, args, kwargs)

    def _start_aligning(self) -> None:
        # NOTE [ Ops the recompute may skip ] in ``_replay/alignment.py``.
        self.alignment = Alignment(
            self.log.records, self.kinds, self.log.serial, self.index, self.log.casts,
            self.log.cacheable,
        )
        self.alignment.check = self.check
        if self._ran is None:
            self._ran = [rec.op for rec in self.log.records[: self.index]]

    def _aligned(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """An op off the fast path: matched among the readings of the recompute."""
        alignment = self.alignment
        assert alignment is not None and self._ran is not None, (
            "this is a bug in remat, please report it"
        )
        self._ran.append(func)
        try:
            index = alignment.match(func, args, kwargs)
        except Mismatch as failed:
            raise self.mismatch(alignment.position, func, args, kwargs, failed.why) from None
        if index is None:  # several forward ops fit: run it, right in every reading
            out = func(*args, **kwargs)
        else:
            out = self._replay(index, self.log.records[index], func, args, kwargs)
        alignment.ran(out)
        self.index = alignment.position
        if alignment.exact():
            self.alignment = None
        return out

    def _replay(
        self, index: int, rec: OpRecord, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Run the recompute's op that is forward record ``index``, or hand out what it kept."""
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
        self,
        at: int,
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        why: str | None = None,
    ) -> NondeterministicRecomputeError:
        """The error for recompute op ``func`` that no forward op from ``at`` on can be.

        ``why``: why the forward's next needed op, the same op, is not this one.
        """
        records, kinds = self.log.records, self.kinds
        # The first forward op from ``at`` on that the recompute could not leave out.
        index = next((j for j in range(at, len(records)) if kinds[j] == NEEDED), len(records))
        forward = self.log.op_names()
        expected = forward[index] if index < len(forward) else "(the forward had ended)"
        if why is not None:
            what = f"{func} cannot be the forward's: {why}{SKIPPED_HINT}"
        elif index < len(records) and records[index].op == func and self.check:
            what = (
                f"{func} got the numbers {records[index].scalars} in the forward and "
                f"{scalars_of(args, kwargs)} in the recompute (Python state it reads changed)"
            )
        else:
            what = f"the forward ran {expected}, the recompute ran {func}"
            if any(rec.op == func for rec in records[index + 1 :]):
                what += SKIPPED_HINT
        # determinism_check=False is no cure: it skips only the numbers' comparison.
        return NondeterministicRecomputeError(
            f"remat: the recompute of {self.log.label} differs from its forward at op "
            f"#{index}: {what}. Its gradients would be wrong. {CURES}\n"
            + side_by_side(forward, [str(f) for f in self.ran])
        )


#: After "the forward ran X, the recompute ran Y" when Y comes later in the forward.
SKIPPED_HINT = (
    " (the forward ran ops here that the recompute did not: a value built only on the "
    "first call, `if key not in cache:`, or code under `if not remat.is_recomputing():`? "
    "A recompute may leave out only ops whose results reach nothing but Python numbers "
    "(`.item()`), and ops that build a constant from no tensor the region reads, read "
    "back unwritten. Fix: build such a value before the region or in the module's "
    "__init__ (register_buffer) and read it from there; end a forward-only statistic in "
    "`.item()`, or compute it after the region)"
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
