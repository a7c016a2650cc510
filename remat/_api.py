"""`remat.remat` and `remat.checkpoint_name`: validate, resolve the policy, pick an engine."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, overload

import torch

from ._engines.eager import TorchFuncInsideError, run_eager, run_plain
from ._engines.lowered_names import traced_name
from ._engines.region import Region
from ._engines.select import EngineKind, engine_for, run_call
from ._offload.store import HostStore
from ._options import DeterminismCheck, Engine, make_region
from ._pytree import tensor_leaves
from ._replay.checks import inner_region, refuse_growing_cache
from ._state import local
from .policies import PolicyLike

__all__ = ["call_region", "checkpoint", "checkpoint_name", "remat"]

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])


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


def call_region(region: Region, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run one call of ``region`` on the engine it asks for (or the one the context needs).

    Traced by ``torch.compile``, the call is lowered into the compiled graph
    when it can be (``_engines/lowered.py``) and is a graph break otherwise.
    """
    run = functools.partial(_call_region, region)
    return run_call(region, lambda: region.fn, args, kwargs, run)


def _call_region(region: Region, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    for i in region.static_argnums:
        if not -len(args) <= i < len(args):
            raise ValueError(
                f"remat.remat: static_argnums contains {i}, but {region.label} was called "
                f"with {len(args)} positional arguments"
            )
    if torch.is_grad_enabled() and not region.policy.recomputes_nothing:
        refuse_growing_cache(region.label, args, kwargs)  # nothing to recompute otherwise
    # Inside another region's traced run, one entry there whatever the engine (the
    # engine may differ between forward and recompute): NOTE [ Recompute signatures ].
    with inner_region(region.label, (args, kwargs)):
        return _run_on_engine(region, args, kwargs)


def _run_on_engine(region: Region, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    engine = engine_for(region, _torch_func_key(region) in _USES_TORCH_FUNC)
    if engine is EngineKind.PLAIN:
        return run_plain(region, args, kwargs)
    if engine is EngineKind.FUNCTIONAL:
        return _run_functional(region, args, kwargs)
    if region.engine == "eager":
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
