"""Which engine runs one call of a region: decided here, for every call site.

NOTE [ Engine selection ]
1. Traced by ``torch.compile``, a call whose policy lowers becomes a selective
   checkpoint in the compiled graph (NOTE [ Lowering under torch.compile ] in
   ``_engines/lowered.py``); any other call runs outside Dynamo (a graph break)
   and `engine_for` picks its engine there, after the call's checks. `run_call`
   is that branch, for ``remat.remat``'s regions and ``remat.wrap``'s module
   forwards alike; `traced` tells a region's body it is being lowered.
2. A policy that recomputes nothing (`Policy.recomputes_nothing`) runs as plain
   autograd (`EngineKind.PLAIN`), whatever the engine asked for: the same graph as
   without remat. Regions called inside it run plainly too (the outer policy
   wins, NOTE [ The eager engine ] rule 4).
3. ``engine="eager"`` under a torch.func transform raises (saved-tensor hooks do
   not run there). ``"functional"``, or ``"auto"`` under a transform or for a
   function known to run one itself, is `EngineKind.FUNCTIONAL`; else `EngineKind.EAGER`
   (and ``"auto"`` moves a call to the torch.func engine when the eager engine
   finds a transform inside, ``_api._run_on_engine``).
4. ``"functional"`` under autocast and no torch.func transform runs the eager
   engine: autograd there casts a parameter once per autocast block (the cast
   cache) and runs a composite op's inner ops (attention's) outside autocast,
   where torch.func's levels cast each use and every inner op again, so no
   torch.func program gives autograd's gradients bit for bit
   (NOTE [ Autocast's cast cache ] in ``_replay/cast_cache.py``). Under a transform
   the torch.func engine is right: it is what runs without remat there.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable
from typing import Any

import torch

from .._compat import transform_active
from .._compile import uncompiled
from .._errors import RematError
from .._replay.autocast import autocast_on
from .lowered import lowers, run_lowered
from .region import Region

__all__ = ["EngineKind", "engine_for", "run_call", "traced"]


class EngineKind(enum.Enum):
    """What runs one call of a region."""

    PLAIN = "plain"
    EAGER = "eager"
    FUNCTIONAL = "functional"


#: Runs a call outside Dynamo: ``run(args, kwargs)``.
Runner = Callable[[tuple[Any, ...], dict[str, Any]], Any]


def run_call(
    region: Region,
    traced_fn: Callable[[], Callable[..., Any]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    run: Runner,
) -> Any:
    """One call of ``region``: lowered when Dynamo traces it and it lowers, else ``run`` (rule 1).

    ``traced_fn()`` gives what the compiled graph traces (the region's function),
    asked for only when the call lowers; ``run`` selects an engine by `engine_for`
    and runs the call there.
    """
    if lowers(region):
        eager = functools.partial(uncompiled, run)
        return run_lowered(region, traced_fn(), args, kwargs, eager)
    return uncompiled(run, args, kwargs)


def traced() -> bool:
    """Whether Dynamo is tracing this code: a lowered region's body (rule 1)."""
    return torch.compiler.is_compiling()


def engine_for(region: Region, uses_torch_func: bool) -> EngineKind:
    """The engine for a call of ``region`` that is not lowered (rules 2-3).

    ``uses_torch_func``: the region's function is known to run a transform itself.
    """
    transform = transform_active()
    if region.engine == "eager" and transform:
        raise RematError(
            f"remat: {region.label} was asked for engine='eager' inside a torch.func "
            "transform, where saved-tensor hooks do not run. Use engine='auto' (the "
            "default) or engine='functional' for regions called under torch.func."
        )
    if region.policy.recomputes_nothing:
        return EngineKind.PLAIN
    if region.engine == "functional" and not (transform or uses_torch_func) and autocast_on():
        return EngineKind.EAGER  # rule 4
    if region.engine == "functional" or (
        region.engine == "auto" and (transform or uses_torch_func)
    ):
        return EngineKind.FUNCTIONAL
    return EngineKind.EAGER
