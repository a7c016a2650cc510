"""`Region`: everything an engine needs to know about one rematerialized function."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .._policy.base import Policy

if TYPE_CHECKING:
    from .._offload.store import HostStore

__all__ = ["Region", "describe_callable"]


@dataclasses.dataclass(frozen=True, eq=False)
class Region:
    """A function with its policy and options, as `remat.remat` validated them.

    Engines take a `Region` and the call's ``args``/``kwargs`` (static arguments
    included, exactly as the user passed them) and return what ``fn`` returns.
    """

    fn: Callable[..., Any]
    policy: Policy
    preserve_rng_state: bool = True
    determinism_check: bool = True
    debug: bool = False
    #: "name (file:line)" of the user function, for error messages.
    label: str = "<function>"
    #: Positions and names of arguments passed through untouched (not searched for tensors).
    static_argnums: frozenset[int] = frozenset()
    static_argnames: frozenset[str] = frozenset()
    #: Where ``OFFLOAD`` decisions send values; None: the current store (see ``_offload``).
    offload_store: HostStore | None = None
    #: "auto" (the torch.func engine under a transform, else eager), "eager" or "functional".
    engine: str = "auto"
    #: Under ``torch.compile``: the selective checkpoint's ``context_fn`` when the
    #: policy lowers to one, else None (NOTE [ Lowering under torch.compile ]).
    selective: Callable[[], Any] | None = None


def describe_callable(fn: Callable[..., Any]) -> str:
    """Return "qualname (file:line)" for ``fn``, as error messages name a region."""
    target: Any = fn
    if isinstance(fn, torch.nn.Module):
        target = type(fn).forward
        name = type(fn).__qualname__ + ".forward"
    else:
        target = getattr(fn, "__func__", fn)
        name = getattr(target, "__qualname__", None) or type(fn).__qualname__
    target = inspect.unwrap(target)
    try:
        file = inspect.getsourcefile(target)
        line = inspect.getsourcelines(target)[1]
    except (TypeError, OSError):
        return name
    return f"{name} ({file}:{line})"
