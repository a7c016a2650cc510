"""Rematerialize modules: `wrap`, `unwrap`, and module state (`apply`: ``_apply.py``;
`sequential`: ``_sequential.py``).

NOTE [ Wrapped modules ]
1. `wrap` sets an *instance* attribute ``forward`` (a `_RematForward`) on the
   module; ``nn.Module.__call__`` finds it before the class's ``forward``, so
   hooks, DDP and ``functional_call`` all go through it. Nothing else changes:
   no new submodule, no parameter moves, so ``state_dict`` keys stay the same.
2. No reference cycle: `_RematForward` holds the module through a weak
   reference. Its region is validated and built once, by `wrap`; each call
   swaps in a fresh `_Forward` (a strong reference that lives only as long as
   that call's autograd graph). A per-call `_Forward` also lets the
   ``torch.func`` engine find the module's parameters as ``functional_call``
   swapped them in (it exposes the module as an attribute, which
   ``_capture/closure.py`` walks).
3. Module state: a `_Forward` (and a `sequential` segment) runs its modules
   under a `StateGuard` (``_capture/module_state.py``), so stateful modules
   (BatchNorm) change their buffers once per real forward and recompute with
   the state the forward saw; so do buffers the forward writes, without
   registration (NOTE [ State the forward changes ] in ``_capture/module_state.py``).
   Python-level state (attributes, caches) is the user's to guard with
   `remat.is_recomputing`.
4. Idempotent: wrapping a wrapped module replaces its policy and options (the
   original ``forward`` is kept), so wrapping twice with the same arguments is a
   no-op. `unwrap` restores the instance attribute the module had before (or
   removes it) on the module and every wrapped submodule.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import types
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from torch import nn

from . import policies
from ._api import call_region
from ._capture.module_state import StateGuard
from ._capture.stateful import GuardsItsModules
from ._engines.select import run_call
from ._options import check_options, make_region
from .policies import PolicyLike

__all__ = [
    "check_module_options",
    "is_wrapped",
    "unwrap",
    "wrap",
    "wrap_with",
]

M = TypeVar("M", bound=nn.Module)


class _Forward:
    """One call's ``forward``: the module's own, with its state frozen in recompute.

    Holds the module strongly, for the lifetime of one call's graph (rule 2).
    """

    def __init__(self, module: nn.Module, original: Callable[..., Any] | None) -> None:
        self.module = module
        self.original = original
        function = type(module).forward if original is None else original
        # Error messages and signature checks name the user's forward, not this class.
        self.__qualname__ = getattr(function, "__qualname__", type(module).__qualname__)
        self.__wrapped__ = function
        self.state = StateGuard(self.__qualname__, roots=[module])

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = self.original or types.MethodType(type(self.module).forward, self.module)
        with self.state.guarded():
            return forward(*args, **kwargs)


def _unset(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("remat: a wrapped module's region ran without its forward; a bug")


#: `remat.remat`'s defaults, for options `wrap` was not given.
_OPTIONS: dict[str, Any] = {
    "static_argnums": (),
    "static_argnames": (),
    "preserve_rng_state": True,
    "determinism_check": True,
    "debug": False,
    "engine": "auto",
    "offload_store": None,
}


@GuardsItsModules.register
class _RematForward:
    """The instance attribute ``forward`` of a wrapped module (NOTE [ Wrapped modules ] rule 1)."""

    def __init__(
        self,
        module: nn.Module,
        original: Callable[..., Any] | None,
        policy: Any,
        options: dict[str, Any],
        api: str = "remat.wrap",
    ) -> None:
        self.module_ref = weakref.ref(module)
        #: The instance attribute ``forward`` the module had before `wrap`, if any.
        self.original = original
        # Validated once, here, against the real forward (its signature and source
        # line); each call only swaps in a fresh `_Forward`.
        bound = _bound_forward(module, original)
        region = make_region(bound, policy=policy, api=api, **_OPTIONS | options)
        self.region = dataclasses.replace(region, fn=_unset)
        self.__signature__ = inspect.signature(bound)

    @property
    def policy(self) -> policies.Policy:
        """The policy the module's forward is rematerialized with."""
        return self.region.policy

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return run_call(self.region, self._traced_forward, args, kwargs, self._call)

    def _traced_forward(self) -> Callable[..., Any]:
        """What a lowered call traces (NOTE [ Engine selection ] rule 1)."""
        module = self.module_ref()
        assert module is not None, "this is a bug in remat, please report it"
        # Not a `_Forward`: Dynamo traces neither its bound method nor its guard,
        # and compiled code needs no guard (NOTE [ Lowering under torch.compile ]).
        return self.original or functools.partial(type(module).forward, module)

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        module = self.module_ref()
        assert module is not None, "this is a bug in remat, please report it"
        region = dataclasses.replace(self.region, fn=_Forward(module, self.original))
        return call_region(region, args, kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> _RematForward:
        # ``copy.deepcopy(model)`` registers the new module in ``memo`` before
        # copying its ``__dict__``: the copy's forward must point at the copy.
        module = self.module_ref()
        target = memo.get(id(module), module)
        assert target is not None, "this is a bug in remat, please report it"
        new = copy.copy(self)
        new.module_ref = weakref.ref(target)
        new.original = copy.deepcopy(self.original, memo)
        return new

    def __getstate__(self) -> dict[str, Any]:
        # Pickling (``torch.save(model)``): the weak reference becomes the module
        # itself, which pickle already has in its memo.
        return {**self.__dict__, "module_ref": self.module_ref()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        module = state.pop("module_ref")
        self.__dict__.update(state)
        self.module_ref = weakref.ref(module)

    def __repr__(self) -> str:
        return f"<rematerialized forward, policy={self.region.policy!r}>"


class _Replicator:
    """``_replicate_for_data_parallel`` of a wrapped module (``nn.DataParallel``).

    A replica starts as a copy of the module's ``__dict__``, whose ``forward``
    would run the original module with the original's parameters: point the
    replica's forward at the replica.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module_ref = weakref.ref(module)

    def __call__(self) -> nn.Module:
        module = self.module_ref()
        assert module is not None, "this is a bug in remat, please report it"
        replica: nn.Module = type(module)._replicate_for_data_parallel(module)
        replica.__dict__.pop("_replicate_for_data_parallel", None)
        current = replica.__dict__.get("forward")
        if isinstance(current, _RematForward):
            own = copy.copy(current)
            own.module_ref = weakref.ref(replica)
            replica.forward = own
        return replica

    def __deepcopy__(self, memo: dict[int, Any]) -> _Replicator:
        module = self.module_ref()
        target = memo.get(id(module), module)
        assert target is not None, "this is a bug in remat, please report it"
        return _Replicator(target)

    def __getstate__(self) -> dict[str, Any]:
        return {"module": self.module_ref()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.module_ref = weakref.ref(state["module"])


def _bound_forward(module: nn.Module, original: Callable[..., Any] | None) -> Callable[..., Any]:
    return original or types.MethodType(type(module).forward, module)


def is_wrapped(module: nn.Module) -> bool:
    """Return whether ``module``'s forward was rematerialized by `wrap`.

    Examples:
        >>> import torch, remat
        >>> remat.is_wrapped(remat.wrap(torch.nn.Linear(2, 2)))
        True
    """
    return isinstance(module.__dict__.get("forward"), _RematForward)


def wrap(module: M, /, *, policy: PolicyLike = "nothing-saveable", **remat_options: Any) -> M:
    """Rematerialize ``module``'s forward, in place; return the same module.

    Calls keep working as before: positional and keyword arguments, pytrees,
    non-tensor outputs, forward hooks. The module holds no reference to itself
    (it is garbage-collected as usual), its ``state_dict`` keys do not change,
    and BatchNorm statistics (and the buffers of any stateful module, see
    `register_stateful`) update once per forward, never in recompute.
    Wrapping a wrapped module replaces its policy and options. `unwrap` undoes
    it.

    Args:
        module (nn.Module): the module to rematerialize.
        policy (optional): what to keep for backward, as for `remat.remat`.
            Default: "nothing-saveable".
        **remat_options: the other keyword options of `remat.remat`
            (``static_argnums``, ``preserve_rng_state``, ``determinism_check``,
            ``debug``, ``engine``).

    Returns:
        ``module`` itself.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``, or an option is unknown.
        ValueError: the policy or a static argument is invalid.

    Examples:
        >>> import torch, remat
        >>> block = remat.wrap(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()),
        ...              policy="dots-saveable")
        >>> block(torch.randn(2, 4)).sum().backward()
        >>> block[0].weight.grad.shape
        torch.Size([4, 4])
        >>> list(block.state_dict())
        ['0.weight', '0.bias']
    """
    return wrap_with(module, policy, remat_options, "remat.wrap")


def wrap_with(module: M, policy: PolicyLike, remat_options: dict[str, Any], api: str) -> M:
    """`wrap` as ``api`` does it (`apply` wraps each module it selects this way)."""
    check_module_options(api, remat_options)
    if not isinstance(module, nn.Module):
        raise TypeError(f"{api}: expected an nn.Module, got {type(module).__name__}")
    current = module.__dict__.get("forward")
    original = current.original if isinstance(current, _RematForward) else current
    resolved = policies.resolve(policy)
    module.forward = _RematForward(module, original, resolved, dict(remat_options), api)
    module._replicate_for_data_parallel = _Replicator(module)  # type: ignore[method-assign]
    return module


def check_module_options(api: str, remat_options: dict[str, Any]) -> None:
    """Reject unknown options and bad flags before anything is wrapped or run."""
    unknown = sorted(set(remat_options) - set(_OPTIONS))
    if unknown:
        raise TypeError(
            f"{api}: unknown option {unknown[0]!r}; the options are "
            f"{', '.join(['policy', *_OPTIONS])}"
        )
    check_options(api, **remat_options)


def unwrap(module: M, /) -> M:
    """Undo `wrap` on ``module`` and on every wrapped submodule; return ``module``.

    Examples:
        >>> import torch, remat
        >>> model = remat.apply(torch.nn.Sequential(torch.nn.Linear(2, 2)), where=torch.nn.Linear)
        >>> remat.is_wrapped(remat.unwrap(model)[0])
        False
    """
    for sub in module.modules():
        current = sub.__dict__.get("forward")
        if isinstance(current, _RematForward):
            if current.original is None:
                del sub.forward
            else:
                sub.forward = current.original
            sub.__dict__.pop("_replicate_for_data_parallel", None)
    return module
