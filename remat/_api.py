"""`remat.remat` and `remat.checkpoint_name`: validate, resolve the policy, pick an engine."""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar, overload

import torch

from . import policies
from ._compat import transform_active
from ._compile import uncompiled
from ._engines.eager import TorchFuncInsideError, run_eager
from ._engines.lowered import contexts_for, lowers, run_lowered
from ._engines.lowered_names import traced_name
from ._engines.region import Region, describe_callable
from ._errors import RematError
from ._offload.store import HostStore
from ._pytree import tensor_leaves
from ._replay.checks import inner_region, refuse_growing_cache
from ._state import local
from .policies import PolicyLike

__all__ = ["call_region", "check_options", "checkpoint", "checkpoint_name", "make_region", "remat"]

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])
Engine = Literal["auto", "eager", "functional"]
_ENGINES = ("auto", "eager", "functional")
#: torch's ``determinism_check`` strings (``torch.utils.checkpoint``): "default" checks, "none" not.
DeterminismCheck = bool | Literal["default", "none"]
_DETERMINISM_STRINGS = {"default": True, "none": False}


@overload
def remat(
    fn: F,
    /,
    *,
    policy: PolicyLike = ...,
    static_argnums: int | Sequence[int] = ...,
    static_argnames: str | Sequence[str] = ...,
    preserve_rng_state: bool = ...,
    determinism_check: DeterminismCheck = ...,
    debug: bool = ...,
    engine: Engine = ...,
    offload_store: HostStore | None = ...,
) -> F: ...


@overload
def remat(
    fn: None = None,
    /,
    *,
    policy: PolicyLike = ...,
    static_argnums: int | Sequence[int] = ...,
    static_argnames: str | Sequence[str] = ...,
    preserve_rng_state: bool = ...,
    determinism_check: DeterminismCheck = ...,
    debug: bool = ...,
    engine: Engine = ...,
    offload_store: HostStore | None = ...,
) -> Callable[[F], F]: ...


def remat(
    fn: F | None = None,
    /,
    *,
    policy: PolicyLike = "nothing-saveable",
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
    preserve_rng_state: bool = True,
    determinism_check: DeterminismCheck = True,
    debug: bool = False,
    engine: Engine = "auto",
    offload_store: HostStore | None = None,
) -> F | Callable[[F], F]:
    """Rematerialize ``fn``: keep only what ``policy`` saves, recompute the rest in backward.

    Works as a decorator with or without arguments, on functions, methods and
    ``nn.Module`` instances; inputs and outputs are any pytrees. Gradients are
    those of ``fn`` for every policy, in eager autograd and under ``torch.func``.

    Args:
        fn (callable): the function to rematerialize.
        policy (str | Policy | callable | list of ops, optional): what to keep for
            backward; see `remat.policies.resolve`. Default: "nothing-saveable".
        static_argnums (int | sequence of int, optional): positional arguments
            passed through untouched (Python values that select code paths).
        static_argnames (str | sequence of str, optional): keyword arguments
            passed through untouched.
        preserve_rng_state (bool, optional): replay the forward's random state in
            the recompute, so dropout masks match. Default: True.
        determinism_check (bool | "default" | "none", optional): check that the
            recompute runs the same ops on the same shapes and Python numbers as
            the forward, and raise `RematError` naming the first difference if not. With False, a
            policy that keeps op outputs still compares the ops themselves: a
            kept output handed to another op would be garbage. torch's strings
            ``"default"`` (True) and ``"none"`` (False) are accepted. Default: True.
        debug (bool, optional): record the op log of every region, so a failed
            check prints the forward and recompute logs side by side. The
            environment variable ``REMAT_DEBUG=1`` turns it on everywhere.
        engine ("auto" | "eager" | "functional", optional): "auto" uses the
            ``torch.func`` engine when a transform is active and the eager one
            otherwise; and for a function that runs a ``torch.func`` transform
            itself (``forces = -torch.func.grad(energy)(pos)`` inside the region),
            which saved-tensor hooks cannot run: its first call notices it when the
            transform starts (what ran before it runs once more, under the
            ``torch.func`` engine), later calls go there directly. Default: "auto".
        offload_store (HostStore, optional): where ``OFFLOAD`` decisions put
            values (e.g. a ``CudaHostStore(min_bytes=..., prefetch_distance=...)``
            to tune the size threshold and the prefetch distance). Default: the
            innermost `use_host_store`, else the process-wide pinned-host store.

    Returns:
        The rematerialized function (or a decorator, when ``fn`` is omitted).

    Raises:
        TypeError: ``fn`` is not callable, or an option has the wrong type (a
            flag that is not a bool, an aten op where a list of ops is expected,
            an uncalled policy factory, a policy function of the wrong arity).
        ValueError: the policy, an option's value or a static argument is unknown.

    Examples:
        >>> import torch, remat
        >>> @remat.remat(policy="dots-saveable")
        ... def mlp(x, params):
        ...     return torch.tanh(x @ params["w1"]) @ params["w2"]
        >>> params = {"w1": torch.randn(4, 8, requires_grad=True),
        ...           "w2": torch.randn(8, 2, requires_grad=True)}
        >>> mlp(torch.randn(3, 4), params).sum().backward()
        >>> params["w1"].grad.shape
        torch.Size([4, 8])
    """
    options = dict(
        policy=policy,
        static_argnums=static_argnums,
        static_argnames=static_argnames,
        preserve_rng_state=preserve_rng_state,
        determinism_check=determinism_check,
        debug=debug,
        engine=engine,
        offload_store=offload_store,
    )
    if fn is None:
        return functools.partial(remat, **options)
    if not callable(fn):
        raise TypeError(f"remat.remat: expected a callable to rematerialize, got {fn!r}")
    return _make_wrapper(fn, **options)


checkpoint = remat


def _make_wrapper(fn: F, **options: Any) -> F:
    region = make_region(fn, **options)

    def rematerialized(*args: Any, **kwargs: Any) -> Any:
        return call_region(region, args, kwargs)

    if isinstance(fn, torch.nn.Module):
        functools.update_wrapper(rematerialized, type(fn).forward, updated=())
    else:
        functools.update_wrapper(rematerialized, fn)
    rematerialized.__remat_region__ = region  # type: ignore[attr-defined]
    return rematerialized  # type: ignore[return-value]


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
        selective=contexts_for(resolved),
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


def call_region(region: Region, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run one call of ``region`` on the engine it asks for (or the one the context needs).

    Traced by ``torch.compile``, the call is lowered into the compiled graph
    when it can be (``_engines/lowered.py``) and is a graph break otherwise.
    """
    if lowers(region):
        eager = functools.partial(uncompiled, _call_region, region)
        return run_lowered(region, region.fn, args, kwargs, eager)
    return uncompiled(_call_region, region, args, kwargs)


def _call_region(region: Region, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    for i in region.static_argnums:
        if not -len(args) <= i < len(args):
            raise ValueError(
                f"remat.remat: static_argnums contains {i}, but {region.label} was called "
                f"with {len(args)} positional arguments"
            )
    if torch.is_grad_enabled() and not region.policy.keeps_everything:
        refuse_growing_cache(region.label, args, kwargs)  # nothing to recompute otherwise
    # Inside another region's traced run, one entry there whatever the engine (the
    # engine may differ between forward and recompute): NOTE [ Recompute signatures ].
    with inner_region(region.label, (args, kwargs)):
        return _run_on_engine(region, args, kwargs)


def _run_on_engine(region: Region, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    engine = region.engine
    if engine == "eager" and _transform_active():
        raise RematError(
            f"remat: {region.label} was asked for engine='eager' inside a torch.func "
            "transform, where saved-tensor hooks do not run. Use engine='auto' (the "
            "default) or engine='functional' for regions called under torch.func."
        )
    if engine == "functional" or (
        engine == "auto" and (_transform_active() or _torch_func_key(region) in _USES_TORCH_FUNC)
    ):
        return _run_functional(region, args, kwargs)
    if engine == "eager":
        return run_eager(region, args, kwargs)
    try:
        return run_eager(region, args, kwargs)
    except TorchFuncInsideError as error:
        if not error.clean:
            raise
    # ``fn`` runs a torch.func transform itself (forces from an energy, a physics
    # loss): the eager engine's saved-tensor hooks cannot run there, the
    # torch.func engine can. The transform refused at its start, before it ran
    # anything; remembered per function, so later calls go there at once.
    _USES_TORCH_FUNC.add(_torch_func_key(region))
    return _run_functional(region, args, kwargs)


#: Regions whose function runs a torch.func transform itself (`_torch_func_key`).
_USES_TORCH_FUNC: set[str | int] = set()


def _torch_func_key(region: Region) -> str | int:
    # By label, "name (file:line)": a wrapped module makes a `Region` per call. A
    # label without a source line (a ``remat.sequential`` segment) may name many
    # functions: by the function object instead.
    return region.label if region.label.endswith(")") else id(region.fn)


def _run_functional(region: Region, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    from ._engines.functional import run_functional

    return run_functional(region, args, kwargs)


def _transform_active() -> bool:
    return transform_active()


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


def checkpoint_name(x: T, name: str) -> T:
    """Tag a value (a tensor, or every tensor of a pytree) with ``name`` for name policies.

    An identity: it returns ``x`` itself. Inside a rematerialized region, the
    policy then decides what happens to that value by its name
    (``"save:attn_out"``, `remat.policies.save_only_these_names`, ...). Outside
    any region it does nothing. Under ``torch.compile`` the name reaches the
    compiled graph of a region whose policy reads names, which saves or
    recomputes the tagged value as the policy says (no copy either way).

    Args:
        x (Tensor | pytree): the value to tag.
        name (str): the name policies refer to.

    Returns:
        ``x``, unchanged.

    Examples:
        >>> import torch, remat
        >>> @remat.remat(policy="save:hidden")
        ... def f(x, w):
        ...     h = remat.checkpoint_name(torch.relu(x @ w), "hidden")
        ...     return (h @ w).sum()
        >>> w = torch.randn(3, 3, requires_grad=True)
        >>> f(torch.randn(2, 3), w).backward()
    """
    if not isinstance(name, str):
        raise TypeError(f"remat.checkpoint_name: name must be a str, got {name!r}")
    if torch.compiler.is_compiling():
        return traced_name(x, name)  # NOTE [ Names under torch.compile ]
    if local.recorders:
        recorder = local.recorders[-1]
        for leaf in tensor_leaves(x):
            recorder.log.name(leaf, name)
    return x
