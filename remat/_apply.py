"""`remat.apply`: wrap the submodules of a model that ``where`` selects, each with its policy.

Each selected module is wrapped as `remat.wrap` wraps it (NOTE [ Wrapped modules ]
in ``_modules.py``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from torch import nn

from . import policies
from ._declared_layers import is_declared_layer, warn_if_checkpointed_twice
from ._modules import check_module_options, wrap_with

__all__ = ["apply"]

M = TypeVar("M", bound=nn.Module)
Where = type | tuple[type, ...] | Callable[[str, nn.Module], bool]
#: One policy, a mapping from module type or name to policy, or ``(name, module) -> policy``.
PolicyChoice = Any


def apply(
    model: M,
    /,
    *,
    policy: PolicyChoice = "nothing-saveable",
    where: Where | None = None,
    **remat_options: Any,
) -> M:
    """Wrap every submodule of ``model`` that ``where`` selects; return ``model``.

    Modules are visited in ``named_modules()`` order (the root, named ``""``,
    first). When a selected module contains another selected one, only the
    outermost is wrapped (the outer policy would decide anyway).

    Args:
        model (nn.Module): the model, changed in place.
        policy (optional): one policy for every match, a mapping from a module
            type or qualified name to a policy (names are looked up before
            types, types along the MRO; a match with no entry raises), or a
            callable ``(name, module) -> policy``. Default: "nothing-saveable".
        where (type | tuple of types | callable, optional): the modules to wrap,
            by type, or a predicate ``(qualified_name, module) -> bool``. Default:
            the layers the model declares checkpointable (Hugging Face's
            ``GradientCheckpointingLayer``s; no ``transformers`` import needed).
        **remat_options: the other options of `remat.remat`, for every match.

    Returns:
        ``model`` itself.

    Raises:
        TypeError: ``where`` is neither a type, a tuple of types nor callable.
        ValueError: ``where`` is omitted and the model declares no checkpointable layers.
        KeyError: a policy mapping has no entry for a selected module.

    Warns:
        RematWarning: a selected module contains layers that Hugging Face's own
            gradient checkpointing also checkpoints.

    Examples:
        >>> import torch
        >>> import remat
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(),
        ...                             torch.nn.Linear(4, 1))
        >>> _ = remat.apply(model, where=torch.nn.Linear,
        ...           policy={torch.nn.Linear: "dots-saveable"})
        >>> [remat.is_wrapped(m) for m in model]
        [True, False, True]
    """
    check_module_options("remat.apply", remat_options)
    if not isinstance(policy, Mapping) and not _is_policy_callback(policy):
        policies.resolve(policy)  # a bad policy raises even when nothing matches
    select = _declared(model) if where is None else _selector(where)
    chosen: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if any(_contains(outer, name) for outer, _ in chosen):
            continue
        if select(name, module):
            chosen.append((name, module))
    warn_if_checkpointed_twice("remat.apply", [module for _, module in chosen])
    for name, module in chosen:
        wrap_with(module, _policy_for(policy, name, module), remat_options, "remat.apply")
    return model


def _contains(outer: str, name: str) -> bool:
    return outer == "" or name.startswith(outer + ".")


def _declared(model: nn.Module) -> Callable[[str, nn.Module], bool]:
    if not any(is_declared_layer(m) for m in model.modules()):
        raise ValueError(
            f"remat.apply: {type(model).__name__} declares no checkpointable layers (Hugging "
            "Face GradientCheckpointingLayer), so there is nothing to wrap by default; say "
            "which modules to wrap, e.g. remat.apply(model, where=MyBlock) or "
            "where=lambda name, module: name.startswith('layers.')"
        )
    return lambda _name, module: is_declared_layer(module)


def _selector(where: Where) -> Callable[[str, nn.Module], bool]:
    if isinstance(where, type) or (
        isinstance(where, tuple) and all(isinstance(t, type) for t in where)
    ):
        types_ = where
        return lambda _name, module: isinstance(module, types_)
    if callable(where):
        return where
    raise TypeError(
        "remat.apply: where must be a module type, a tuple of types or a predicate "
        f"(name, module) -> bool, got {where!r}"
    )


def _policy_for(policy: PolicyChoice, name: str, module: nn.Module) -> Any:
    if isinstance(policy, Mapping):
        if name in policy:
            return policy[name]
        for cls in type(module).__mro__:
            if cls in policy:
                return policy[cls]
        raise KeyError(
            f"remat.apply: the policy mapping has no entry for module {name!r} of type "
            f"{type(module).__name__}; add its name or type (keys: {list(policy)})"
        )
    if _is_policy_callback(policy):
        return policy(name, module)
    return policy


def _is_policy_callback(policy: Any) -> bool:
    # A policy may itself be a callable ``fn(op, *args)``: only a function whose
    # first parameter is called ``name`` is taken as a per-module chooser.
    if isinstance(policy, (str, policies.Policy, list)) or not callable(policy):
        return False
    try:
        params = list(inspect.signature(policy).parameters)
    except (TypeError, ValueError):
        return False
    return len(params) == 2 and params[0] == "name"
