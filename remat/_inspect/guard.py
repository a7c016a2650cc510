"""What inspection guarantees around the user's call: its own keywords checked, no state changed.

NOTE [ Inspection leaves the program as it found it ]
1. `saved_residuals` and `compare` run the user's forward (and `compare` its
   backward) for real, so whatever the forward changes must be put back:
   `preserved_state` snapshots the random generators (the CPU one, the CUDA ones
   in use, and the explicit ``torch.Generator``s the call reaches, as a region's
   RNG capture finds them) and the buffers of every module (BatchNorm running
   statistics, ``num_batches_tracked``, any buffer), then restores them.
2. Modules are found before the call (``fn`` itself, the module of a bound
   method, the module a `remat.remat` wrapper holds, modules among the arguments
   and in ``fn``'s closure) and as they run: the state guard's forward pre-hook
   (``_module_state._watching``, on this thread only) reports each module before
   its forward, where its own buffers are snapshotted. A buffer is restored only
   if it changed (an equal one is left alone: a write would bump its version and
   break a graph the user still holds that saved it); a buffer slot rebound to a
   new tensor gets its original tensor back.
3. `check_keywords`: a keyword the inspection function does not take is passed
   to ``fn``, so it must be one ``fn`` accepts; otherwise ``TypeError`` names the
   inspection function and the closest option (``polcy=`` -> ``policy``),
   before anything runs. A callable whose signature cannot be read, or that
   takes ``**kwargs``, accepts every keyword.
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import optree
import torch
from torch import nn

from .._capture.watching import watching
from .._compat import no_dispatch_modes
from .._replay.rng import RngState, generators_of
from .._state import INTERNAL

__all__ = ["check_keywords", "preserved_state"]


def check_keywords(
    api: str, fn: Callable[..., Any], kwargs: dict[str, Any], options: Sequence[str]
) -> None:
    """Raise ``TypeError`` for a keyword neither ``api`` (``options``) nor ``fn`` accepts."""
    accepted = _keywords_of(fn)
    if accepted is None:
        return
    for name in kwargs:
        if name in accepted:
            continue
        close = difflib.get_close_matches(name, [*options, *sorted(accepted)], n=1)
        hint = f" Did you mean {close[0]}=...?" if close else ""
        raise TypeError(
            f"{api}() got an unexpected keyword argument {name!r}: it is not an option of "
            f"{api} ({', '.join(options)}) and {_name(fn)} has no parameter {name!r}.{hint}"
        )


def _keywords_of(fn: Callable[..., Any]) -> frozenset[str] | None:
    """The keyword arguments ``fn`` accepts; None when it accepts any (or cannot be read)."""
    target: Any = type(fn).forward if isinstance(fn, nn.Module) else fn
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return None
    names = []
    for parameter in signature.parameters.values():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            return None
        if parameter.kind is not inspect.Parameter.POSITIONAL_ONLY:
            names.append(parameter.name)
    if isinstance(fn, nn.Module) and names and names[0] == "self":
        names = names[1:]
    return frozenset(names)


def _name(fn: Callable[..., Any]) -> str:
    if isinstance(fn, nn.Module):
        return f"{type(fn).__qualname__}.forward"
    return str(getattr(fn, "__qualname__", None) or type(fn).__qualname__)


@contextlib.contextmanager
def preserved_state(fn: Callable[..., Any], args: Any, kwargs: Any) -> Iterator[None]:
    """Run the block, then put back the generators and module buffers it changed (NOTE 1-2)."""
    leaves: list[Any] = optree.tree_leaves((args, kwargs), none_is_leaf=True)  # type: ignore[arg-type]
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    rng = RngState.capture(tensors, generators_of(fn, leaves))
    buffers = _BufferSnapshots()
    for module in _modules_of(fn, leaves):
        for sub in module.modules():
            buffers.saw(sub)
    try:
        with watching(buffers):
            yield
    finally:
        buffers.restore()
        _restore_rng(rng)


class _BufferSnapshots:
    """The buffers of each module seen, as they were before its first forward here."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.copies: list[tuple[dict[str, Any], str, torch.Tensor, torch.Tensor]] = []

    def saw(self, module: nn.Module) -> None:
        """Snapshot ``module``'s own buffers (called before its forward; once per module)."""
        if id(module) in self.seen:
            return
        self.seen.add(id(module))
        with INTERNAL, no_dispatch_modes(), torch.no_grad():  # remat's work (`watching`)
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    self.copies.append((module._buffers, name, buffer, buffer.clone()))

    def restore(self) -> None:
        with no_dispatch_modes(), torch.no_grad():
            for table, name, original, copy in self.copies:
                table[name] = original
                if not torch.equal(original, copy):
                    original.copy_(copy)


def _modules_of(fn: Any, leaves: Sequence[Any]) -> list[nn.Module]:
    """Modules the call may change before any of them runs a forward (NOTE rule 2)."""
    found: list[nn.Module] = [leaf for leaf in leaves if isinstance(leaf, nn.Module)]
    todo = [fn]
    seen: set[int] = set()
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, nn.Module):
            found.append(obj)
            continue
        region = getattr(obj, "__remat_region__", None)
        todo.extend(
            x for x in (getattr(obj, "__self__", None), getattr(region, "fn", None),
                        getattr(obj, "__wrapped__", None)) if x is not None
        )
        for cell in getattr(obj, "__closure__", None) or ():
            try:
                todo.append(cell.cell_contents)
            except ValueError:  # an empty cell
                continue
    return found


def _restore_rng(rng: RngState) -> None:
    torch.set_rng_state(rng.cpu)
    for device, state in rng.cuda:
        torch.cuda.set_rng_state(state, device)
    for generator, state in rng.generators:
        generator.set_state(state)
