"""The options of `remat.remat`, checked and bundled as a `Region` before any call runs.

Flags are never coerced with ``bool()``; a static argument the function does not
have is refused where the signature shows it (`make_region`), else at the call.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Sequence
from typing import Any, Literal

from . import policies
from ._engines.lowered import contexts_for
from ._engines.region import Region, describe_callable
from ._offload.store import HostStore
from .policies import PolicyLike

__all__ = ["DeterminismCheck", "Engine", "check_options", "make_region"]

Engine = Literal["auto", "eager", "functional"]
_ENGINES = ("auto", "eager", "functional")
#: torch's ``determinism_check`` strings (``torch.utils.checkpoint``): "default" checks, "none" not.
DeterminismCheck = bool | Literal["default", "none"]
_DETERMINISM_STRINGS = {"default": True, "none": False}


def make_region(
    fn: Callable[..., Any],
    *,
    policy: PolicyLike,
    static_argnums: int | Sequence[int],
    static_argnames: str | Sequence[str],
    preserve_rng_state: bool,
    determinism_check: DeterminismCheck,
    debug: bool,
    engine: str,
    offload_store: HostStore | None,
    api: str = "remat.remat",
) -> Region:
    """Validate `remat.remat`'s options for ``fn`` and bundle them as a `Region`.

    ``api`` is the public function the options were given to, for messages.
    """
    flags = check_options(
        api,
        preserve_rng_state=preserve_rng_state,
        determinism_check=determinism_check,
        debug=debug,
        engine=engine,
        offload_store=offload_store,
    )
    argnums = _normalize(static_argnums, int, "static_argnums")
    argnames = _normalize(static_argnames, str, "static_argnames")
    _check_static(fn, argnums, argnames)
    resolved = policies.resolve(policy)
    return Region(
        fn=fn,
        policy=resolved,
        preserve_rng_state=flags["preserve_rng_state"],
        determinism_check=flags["determinism_check"],
        debug=flags["debug"] or os.environ.get("REMAT_DEBUG", "") not in ("", "0"),
        label=describe_callable(fn),
        static_argnums=frozenset(argnums),
        static_argnames=frozenset(argnames),
        offload_store=offload_store,
        engine=engine,
        selective=contexts_for(resolved, describe_callable(fn)),
    )


def check_options(api: str, **options: Any) -> dict[str, bool]:
    """Check the options `remat.remat` shares with ``api``; return the flags as bools.

    Flags are never coerced with ``bool()``: ``preserve_rng_state=None`` or
    ``"no"`` would silently mean False or True. Options not given are not checked.
    """
    flags: dict[str, bool] = {}
    for name in ("preserve_rng_state", "debug"):
        if name in options:
            flags[name] = _flag(api, name, options[name])
    if "determinism_check" in options:
        flags["determinism_check"] = _determinism_check(api, options["determinism_check"])
    engine = options.get("engine", "auto")
    if not isinstance(engine, str) or engine not in _ENGINES:
        raise ValueError(f"{api}: engine must be one of {_ENGINES}, got {engine!r}")
    store = options.get("offload_store")
    if store is not None and not isinstance(store, HostStore):
        raise TypeError(f"{api}: offload_store must be a HostStore or None, got {store!r}")
    return flags


def _flag(api: str, name: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    raise TypeError(
        f"{api}: {name} must be True or False, got {value!r} ({type(value).__name__}); "
        f"write {name}=True or {name}=False."
    )


def _determinism_check(api: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value in _DETERMINISM_STRINGS:
        return _DETERMINISM_STRINGS[value]
    error = ValueError if isinstance(value, str) else TypeError
    raise error(
        f"{api}: determinism_check must be True, False, 'default' (the same as True) or "
        f"'none' (the same as False), got {value!r} ({type(value).__name__}); write "
        "determinism_check=True or determinism_check=False."
    )


def _normalize(value: Any, kind: type, what: str) -> tuple[Any, ...]:
    items = (value,) if isinstance(value, kind) else value
    try:
        items = tuple(items)
    except TypeError:
        raise TypeError(
            f"remat.remat: {what} must be {kind.__name__} or a sequence of them, got {value!r}"
        ) from None
    for item in items:
        if not isinstance(item, kind) or isinstance(item, bool):
            raise TypeError(
                f"remat.remat: {what} must contain only {kind.__name__}s, got {item!r}"
            )
    return items


def _check_static(
    fn: Callable[..., Any], argnums: tuple[int, ...], argnames: tuple[str, ...]
) -> None:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins and some C callables have none: checked at call time
    params = list(signature.parameters.values())
    kinds = {p.kind for p in params}
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if inspect.Parameter.VAR_POSITIONAL not in kinds:
        for i in argnums:
            if not -len(positional) <= i < len(positional):
                raise ValueError(
                    f"remat.remat: static_argnums contains {i}, but {describe_callable(fn)} "
                    f"takes {len(positional)} positional arguments"
                )
    if inspect.Parameter.VAR_KEYWORD not in kinds:
        known = {p.name for p in params if p.kind is not p.POSITIONAL_ONLY}
        for name in argnames:
            if name not in known:
                raise ValueError(
                    f"remat.remat: static_argnames contains {name!r}, but "
                    f"{describe_callable(fn)} has no such parameter; its parameters are "
                    f"{sorted(known)}"
                )
