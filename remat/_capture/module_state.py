"""Module state during a recompute: the forward's parameters, stateful buffers changed once.

A recompute runs ``forward`` again, reading parameters and buffers from the
modules as they are then. A `StateGuard` makes it read what the forward read:
the tensors that were in the parameter and buffer slots during the forward
(``torch.func.functional_call`` has put the module's own back by then), checked
for in-place changes since. And modules that update buffers in forward
(BatchNorm's running statistics and ``num_batches_tracked``) would update them
twice: the guard snapshots the buffers of a region's *stateful* modules when
its forward starts; while the region recomputes, each buffer is replaced by a
copy of its snapshot, and the originals are put back when the recompute ends
(also when the engine stops it early): the recompute sees the state the
forward saw, and changes nothing. The copies are made with the
recording/replay dispatch modes switched off, so the recompute runs exactly the
forward's ops. Stateful means: an instance of a registered type
(`register_stateful`; ``_NormBase``, i.e. BatchNorm/InstanceNorm/SyncBatchNorm,
is registered) or a module with the attribute ``remat_stateful = True``.

NOTE [ State the forward changes ]
No registration is needed for the common case: the guard also watches every
buffer of the other modules a region runs (and, for its recompute, the closure
cells of the region's function and the ``.grad`` of the leaves it reaches).

1. Buffers. When a module is first seen, each of its buffers up to
   `SNAPSHOT_BYTES` is copied; when the forward ends, the copies of buffers it
   did not write in place are dropped (the version counter tells), and the
   others become state, swapped in for the recompute as a stateful module's
   are (``self.seen += 1`` counts once, and the recompute reads what the
   forward read). A larger buffer written in place, or a parameter written in
   place (a decay under ``no_grad``), cannot be given back to the recompute as
   the forward found it: the recompute raises `RematError` saying so and how to
   fix it, before it computes anything. (``nn.Embedding(max_norm=...)``
   renormalizes its weight before reading it, idempotently: allowed.) A
   stateful module's parameters are snapshotted too, so ``remat_stateful =
   True`` is a fix that works.
2. Closure cells. Cells of the function holding plain Python values (a
   ``nonlocal`` counter) are read when the forward starts; while the region
   recomputes, each cell the forward (or anyone since) rebound holds its start
   value again, and gets back what it held just before the recompute after.
   Attributes, globals and containers are not restored: guard those with
   `remat.is_recomputing`.
3. Gradients. A ``.backward()`` inside the region accumulates into ``.grad``
   of leaves in the forward and would again in the recompute. The guard reads
   ``.grad`` (identity and version) of the parameters of the modules the
   region runs and of the leaf tensors its function closes over, when the
   forward starts and ends; the recompute puts back the ``.grad`` of those the
   forward changed.
4. Modes. A module's ``training`` flag may be switched between the forward and
   the backward (``model.eval()``; a forward in eval mode, then ``train()`` and
   a second forward, then one backward), and the recompute would run another
   function (dropout off, running statistics instead of batch ones). The guard
   notes the flag of every module it pins (the region's own subtree, the
   modules it is given as arguments or closes over, each module that runs, with
   its subtree) when the forward first reaches it; the recompute runs with each
   flag as noted, and puts back the one it found after. This covers modules the
   binding walk does not reach (an argument's; NOTE [ Bindings the recompute
   reads ] rule 6 covers those on the walk that do not run).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from .._compat import is_functorch_wrapped, storage_identity
from .._state import INTERNAL, engine_maps_slots
from .cells import closed_over_leaves, closure_cells, holds_plain
from .entering import InternallyEntered
from .module_tree import named_subtree
from .reads import active_reads
from .restoring import RestoringGuard
from .slots import (
    SNAPSHOT_BYTES,
    Accumulations,
    Pin,
    Watched,
    buffer_copies,
    has_grad_slot,
    pins_of,
    settle_pins,
    watch_slots,
)
from .stateful import GuardsItsModules, is_stateful
from .watching import watching

__all__ = ["SNAPSHOT_BYTES", "StateGuard", "restored_ids_of", "state_guard_of"]


class StateGuard(RestoringGuard):
    """Run the modules of one region call on the parameters and state their forward saw.

    Use one guard per region call, around the forward and around the recompute
    (`guarded`). During the forward it watches which modules run (a global
    forward pre-hook, present while some guard records) and, just before the
    first of a module's subtree runs, remembers the tensor in each parameter
    and buffer slot of that subtree (rule 1) and snapshots the buffers of its
    stateful modules (rule 2); the versions it checks are those the forward
    leaves. ``roots`` are pinned when the forward starts (a wrapped module,
    whose forward is called directly); ``owners`` only for their own
    parameters and buffers, and their stateful submodules are snapshotted (the
    module of a bound method, modules the function receives or closes over,
    whose children it may call as ``child.forward(x)``). In the recompute:

    1. A slot that holds another tensor than before the forward, with other
       memory, gets that tensor back while the recompute runs: a
       reparametrization that ended before backward
       (``torch.func.functional_call`` puts the module's own tensors back when
       it returns) or a forward that rebinds its own buffer does not change
       what the recompute computes. A new view of the same memory (FSDP's
       unsharded views) is left alone. A tensor modified in place after the
       forward (an optimizer step before backward, a second forward of a
       module that updates a buffer the forward did not write) raises
       `SavedInputMutatedError` instead of recomputing from the new values.
       Inside the torch.func engine this rule stands aside: that engine
       snapshots the slots (``_capture/closure.py``) and substitutes at each op
       what the forward saw, writing nothing to them.
    2. Every buffer of a stateful module is swapped for a copy of its snapshot,
       and the real buffers are put back afterwards, also when the engine stops
       the recompute early. So the recompute computes with the numbers the
       forward used (BatchNorm's cumulative-average factor depends on
       ``num_batches_tracked``) and changes no real state.
    3. What the forward wrote in place without registration (buffers, and
       refused: parameters and large buffers), the function's closure cells
       and ``.grad`` (NOTE [ State the forward changes ]) likewise: the
       recompute starts from what the forward found and leaves what it found.
    """

    def __init__(
        self,
        label: str = "the region",
        roots: Iterable[nn.Module] = (),
        owners: Iterable[nn.Module] = (),
        watch: bool = True,
        cells: Iterable[types.CellType] = (),
        leaves: Iterable[torch.Tensor] = (),
        grads: bool = True,
    ) -> None:
        self.label = label
        self.watch = watch
        self.roots = list(roots)
        self.owners = list(owners)
        self.seen: list[tuple[dict[str, Any], str, torch.Tensor]] | None = None
        self.pins: list[Pin] | None = None
        #: Ids of the tensors the forward's ops got, where the engine notes them
        #: (`active_reads`; NOTE [ Bindings the recompute reads ] rule 8): for the
        #: buffers the forward rebinds without reading them (`settle_pins`).
        self.reads: set[int] | None = None
        self._pinned_ids: set[int] = set()
        #: Each module pinned, with its ``training`` flag when the forward first ran
        #: it or its parent (rule 4).
        self.modes: list[tuple[nn.Module, bool]] = []
        self._snapshotted: set[int] = set()
        #: Slots of the modules the forward runs (NOTE [ State the forward changes ]
        #: rule 1), and after it those the forward wrote in place.
        self.watched: list[Watched] = []
        self.written: list[Watched] = []
        self._watch_keys: set[tuple[int, str, int]] = set()
        #: id(module) -> its slots' names and tensors' ids when last watched.
        self._slot_ids: dict[int, tuple[Any, ...]] = {}
        #: While recomputing: (id(table), name) -> the start value of every slot
        #: the recompute gets a copy in; and the copy each holds now.
        self._swaps: dict[tuple[int, str], torch.Tensor] | None = None
        self._installed: dict[tuple[int, str], torch.Tensor] = {}
        self._reswapped: list[tuple[dict[str, Any], str, torch.Tensor, torch.Tensor]] = []
        #: Closure cells of plain values, with their values when the forward started (rule 2).
        self.cells = list(cells)
        self.cell_start: list[tuple[types.CellType, Any]] = []
        #: Leaves whose ``.grad`` an inner backward may change (rule 3), with its
        #: state when watched; after the forward, those it changed.
        #: Whether to watch ``.grad`` at all (rule 3): not where no ``.backward()``
        #: can run inside the forward (torch refuses it under a torch.func transform),
        #: since reading ``.grad`` races with another thread training the same leaves.
        self.grads = grads
        self._grad_leaves = [t for t in leaves if has_grad_slot(t)] if grads else []
        self.grad_watch = Accumulations()
        #: (leaf, whether its ``.grad`` was None when the forward started).
        self.grads_written: list[tuple[torch.Tensor, bool]] = []

    def guarded_ids(self) -> set[int]:
        """Ids of the tensors in the slots this guard pins or watches: the recompute
        gets what the forward read there (NOTE [ Bindings the recompute reads ])."""
        ids = {id(pin.tensor) for pin in self.pins or ()}
        ids.update(id(w.tensor) for w in (*self.watched, *self.written))
        return ids

    def guarded(self) -> contextlib.AbstractContextManager[None]:
        """Snapshot (forward) or restore (recompute) the state around the block.

        The guard's own tensor reads (versions, ``.grad``) are remat's work, not
        calls of the region's function (`InternallyEntered`).
        """
        return InternallyEntered(self._guarded())

    def _guarded(self) -> Generator[None, None, None]:
        if self.pins is None:  # this call's forward (perhaps inside an outer recompute)
            yield from self._forward()
            return
        self._refuse_unrestorable()
        moved = self._pin_back()
        switched: list[tuple[nn.Module, bool, bool]] = []
        try:
            switched = self._switch_modes()
            if self.cell_start or self.grads_written:
                with self._cells_restored(), self._grads_kept():
                    yield from self._swapped()
            else:  # the usual case: no generator context managers per recompute
                yield from self._swapped()
        finally:
            self._switch_back(switched)
            self._unpin(moved)

    # -- forward -------------------------------------------------------------

    def _forward(self) -> Iterator[None]:
        self.seen, self.pins = [], []
        self.reads = active_reads()
        if engine_maps_slots():  # the torch.func engine maps the slots itself: no pins
            self.pins = None
        self.cell_start = [(cell, cell.cell_contents) for cell in self.cells if holds_plain(cell)]
        self.grad_watch = Accumulations()
        for t in self._grad_leaves:
            self.grad_watch.watch(t)
        for owner in self.owners:
            self._pin(type(owner).__qualname__, owner, recurse=False)
            self._snapshot_stateful(owner)  # children it may call as ``child.forward(x)``
        for root in self.roots:
            self._pin(type(root).__qualname__, root, recurse=True)
        try:
            with self.watching_modules():
                yield
        except BaseException:
            self.grad_watch.close()  # no hook left on the user's leaves
            # Stopped (an outer recompute that has what it needs): a recompute of
            # this call may still come, against the versions the forward found.
            for pin in self.pins or ():
                pin.storage = storage_identity(pin.tensor)
            raise
        if self.pins is None:
            self.pins = []
        if self.reads is not None:  # a forward that rebinds its own buffer (a grown cache)
            settle_pins(self.pins, self.reads)
        self._note_writes()
        # Versions as the forward left them: a module that writes its own parameter
        # in forward (``nn.Embedding(max_norm=...)``) writes it again in the recompute.
        for pin in self.pins:
            pin.version, pin.storage = pin.tensor._version, storage_identity(pin.tensor)

    def _note_writes(self) -> None:
        """Keep what the forward wrote in place (rules 1 and 3); drop the other copies."""
        written: dict[tuple[int, str], Watched] = {}
        for w in self.watched:  # per slot, the first tensor the forward wrote
            if w.tensor._version != w.version and not w.exempt:  # (`Watched.written` inline)
                written.setdefault((id(w.table), w.name), w)
        self.written = list(written.values())
        self.watched = []
        self._watch_keys = set()
        self._slot_ids = {}
        self.grads_written = self.grad_watch.close()
        # What the recompute gets back as the forward found it is state, like a
        # stateful module's: a second forward that writes it again is no mutation.
        restored = {(id(w.table), w.name) for w in self.written if w.snapshot is not None}
        assert self.pins is not None, "this is a bug in remat, please report it"
        self.pins = [p for p in self.pins if (id(p.table), p.name) not in restored]

    def _snapshot_stateful(self, owner: nn.Module) -> None:
        for sub in owner.modules():
            if id(sub) not in self._snapshotted and is_stateful(sub):
                self._snapshotted.add(id(sub))
                assert self.seen is not None, "this is a bug in remat, please report it"
                self.seen.extend(buffer_copies(sub))

    def saw(self, module: nn.Module) -> None:
        """The forward is about to run ``module``: pin its subtree if not pinned yet.

        A module pinned already is watched again: its slots may hold other
        tensors now (``functional_call`` inside the region). In the recompute,
        such slots get the copies again (`_reswap`).
        """
        # Each branch that does tensor work is remat's own (`INTERNAL`); the usual
        # case, a module seen already with the same slots, reads ids only.
        if self._swaps is not None:
            with INTERNAL:
                self._reswap(module)
        elif id(module) not in self._pinned_ids:
            with INTERNAL:
                self._pin(type(module).__qualname__, module, recurse=True)
        elif self._slot_ids.get(id(module)) != _slot_ids(module):  # else nothing new
            with INTERNAL:
                self._watch(type(module).__qualname__, module, is_stateful(module))

    def _pin(self, where: str, module: nn.Module, recurse: bool) -> None:
        named = named_subtree(module) if recurse else [("", module)]
        for prefix, sub in named:
            if id(sub) in self._pinned_ids:
                continue
            self._pinned_ids.add(id(sub))
            self.modes.append((sub, sub.training))
            path = f"{where}.{prefix}" if prefix else where
            stateful = is_stateful(sub)
            self._watch(path, sub, stateful)
            if stateful and self.seen is not None and id(sub) not in self._snapshotted:
                self._snapshotted.add(id(sub))
                self.seen.extend(buffer_copies(sub))
            if self.pins is not None:
                self.pins.extend(pins_of(path, sub._parameters, parameter=True))
                if not stateful:  # stateful buffers: rule 2 instead
                    self.pins.extend(pins_of(path, sub._buffers, parameter=False))

    def watching_modules(self) -> contextlib.AbstractContextManager[None]:
        return watching(self) if self.watch else contextlib.nullcontext()

    def _watch(self, path: str, module: nn.Module, stateful: bool) -> None:
        # What the slots hold now, all watched below: a module run again with the
        # same tensors in the same slots is skipped by `saw` (the watched list
        # holds them, so no id is reused before `_note_writes` clears both).
        self._slot_ids[id(module)] = _slot_ids(module)
        watched = watch_slots(path, module, stateful, self._watch_keys)
        self.watched.extend(watched)
        if self.grads:
            watch = self.grad_watch.watch
            for w in watched:
                t = w.tensor
                # (`has_grad_slot` inline: a call fewer per parameter per region call.)
                if w.parameter and t.requires_grad and t.is_leaf and not is_functorch_wrapped(t):
                    watch(t)


def _slot_ids(module: nn.Module) -> tuple[Any, ...]:
    params, buffers = module._parameters, module._buffers
    return (
        id(params), *params, *map(id, params.values()),
        id(buffers), *buffers, *map(id, buffers.values()),
    )


def state_guard_of(
    fn: Callable[..., Any],
    leaves: Iterable[Any] = (),
    label: str = "the region",
    grads: bool = True,
) -> StateGuard:
    """A `StateGuard` for a region's call.

    The modules it runs are found as they run; pinned from the start are
    ``fn`` itself when it is a module (its whole subtree), and the own
    parameters and buffers of the module of a bound method, of modules among
    the call's argument ``leaves`` and of modules ``fn`` closes over (which
    ``fn`` may read without calling them).

    Examples:
        >>> import torch, remat
        >>> bn = torch.nn.BatchNorm1d(2)
        >>> guard = state_guard_of(bn)
        >>> with guard.guarded():  # not recomputing: snapshot, then the real buffers update
        ...     _ = bn(torch.randn(4, 2))
        >>> int(bn.num_batches_tracked), int(guard.seen[-1][2])
        (1, 0)
    """
    if isinstance(fn, GuardsItsModules):
        return StateGuard(label, watch=False, grads=grads)
    roots = [fn] if isinstance(fn, nn.Module) else []
    owners: list[nn.Module] = []
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, nn.Module):
        owners.append(owner)
    owners.extend(leaf for leaf in leaves if isinstance(leaf, nn.Module))
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, nn.Module):
            owners.append(value)
    cells = closure_cells(fn)
    return StateGuard(
        label, roots, owners, cells=cells, leaves=closed_over_leaves(fn, cells), grads=grads
    )


def restored_ids_of(fn: Callable[..., Any], guard: RestoringGuard) -> set[int]:
    """Ids of the tensors a recompute of ``fn`` reads from copies of their start values
    (`RestoringGuard.restored_ids`): ``guard``'s, and those of the guard a wrapped
    module's forward keeps for its own module (``_modules._Forward.state``)."""
    ids = guard.restored_ids()
    own = getattr(fn, "state", None)
    if isinstance(own, RestoringGuard) and own is not guard:
        ids |= own.restored_ids()
    return ids
