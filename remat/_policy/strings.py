"""Policy strings: the built-in names, ``register``, and ``resolve``'s grammar."""

from __future__ import annotations

import difflib
import inspect
import re
from collections.abc import Callable, Iterable
from typing import Any

from .._compat import OpOverload, OpOverloadPacket
from .adapters import (
    from_callable,
    from_selective_checkpoint,
    save_these_ops,
)
from .base import Policy, PolicyLike
from .budget import memory_budget, parse_budget
from .library import (
    dots_saveable,
    dots_with_no_batch_dims_saveable,
    everything_saveable,
    nothing_saveable,
    offload_dot_with_no_batch_dims,
    offload_dots,
    save_from_both_policies,
    save_last,
)
from .names import (
    save_and_offload_only_these_names,
    save_any_names_but_these,
    save_anything_except_these_names,
    save_only_these_names,
)

# ---------------------------------------------------------------------------
# Strings
# ---------------------------------------------------------------------------

_BUILTINS: dict[str, Policy] = {
    "nothing-saveable": nothing_saveable,
    "everything-saveable": everything_saveable,
    "dots-saveable": dots_saveable,
    "dots-no-batch-saveable": dots_with_no_batch_dims_saveable,
    "dots-with-no-batch-dims-saveable": dots_with_no_batch_dims_saveable,
    "save-last": save_last,
    "offload-dots": offload_dots,
    "offload-dots-no-batch": offload_dot_with_no_batch_dims(),
}
_REGISTRY: dict[str, Policy] = dict(_BUILTINS)

_PATTERNS: dict[str, Callable[[tuple[str, ...]], Policy]] = {
    "save": lambda ns: save_only_these_names(*ns),
    "save-except": lambda ns: save_any_names_but_these(*ns),
    "everything-except": lambda ns: save_anything_except_these_names(*ns),
    "offload": lambda ns: save_and_offload_only_these_names(names_which_can_be_offloaded=ns),
}
_PATTERNS_HELP = (
    "Name patterns: save:NAMES, save-except:NAMES, everything-except:NAMES, offload:NAMES, "
    "and A+B; memory budgets: budget:0.3 (a fraction) or budget:64MiB."
)


def _normalize(keyword: str) -> str:
    return keyword.strip().replace("_", "-")


def names() -> list[str]:
    """Return the sorted policy names that :func:`resolve` accepts (besides patterns).

    Returns:
        list[str]: the names, built-in and registered.

    Examples:
        >>> names()[:3]
        ['dots-no-batch-saveable', 'dots-saveable', 'dots-with-no-batch-dims-saveable']
    """
    return sorted(_REGISTRY)


def register(name: str, policy: PolicyLike, *, override: bool = False) -> None:
    """Add a policy name that :func:`resolve` (and ``policy=``) accepts.

    Args:
        name (str): the name; underscores and hyphens are interchangeable.
        policy (Policy | str | Callable | list): anything :func:`resolve` accepts.
        override (bool, optional): allow replacing a built-in name. Default: False.

    Raises:
        TypeError: when ``name`` is not a string or ``policy`` cannot be resolved.
        ValueError: when ``name`` is empty, contains ':', '+' or ',', or is a
            built-in name and ``override`` is false.

    >>> register("my_policy", "dots-saveable+save:attn")
    >>> resolve("my-policy")
    save_from_both_policies(dots_saveable, save_only_these_names('attn'))
    """
    if not isinstance(name, str):
        raise TypeError(
            f"remat.policies.register: name must be a string, got {name!r} ({type(name).__name__})."
        )
    key = _normalize(name)
    if not key or any(c in key for c in ":+,"):
        raise ValueError(
            f"remat.policies.register: invalid policy name {name!r}; use a non-empty name "
            "without ':', '+' or ',' (they are part of the policy string syntax)."
        )
    if key in _BUILTINS and not override:
        raise ValueError(
            f"remat.policies.register: {key!r} is a built-in policy name; pick another "
            "name, or pass override=True to replace it."
        )
    _REGISTRY[key] = resolve(policy)


def _unknown(text: str, key: str, choices: Iterable[str]) -> ValueError:
    close = difflib.get_close_matches(key, list(choices), n=1)
    hint = f" did you mean {close[0]!r}?" if close else ""
    return ValueError(
        f"remat.policies.resolve: unknown policy {text!r};{hint} "
        f"Valid names: {', '.join(names())}. {_PATTERNS_HELP}"
    )


def _resolve_one(text: str) -> Policy:
    if ":" not in text:
        key = _normalize(text)
        if key in _REGISTRY:
            return _REGISTRY[key]
        raise _unknown(text, key, names())
    keyword, _, rest = text.partition(":")
    key = _normalize(keyword)
    if key == "budget":
        return parse_budget(text, rest)
    if key not in _PATTERNS:
        close = difflib.get_close_matches(key, list(_PATTERNS), n=1)
        guess = [f"{close[0]}:{rest}"] if close else []
        raise _unknown(text, f"{key}:{rest}", guess)
    parts = tuple(n.strip() for n in rest.split(","))
    spaced = [n for n in parts if re.search(r"\s", n)]
    if spaced:
        fixed = ",".join(n for part in parts for n in part.split())
        raise ValueError(
            f"remat.policies.resolve: policy {text!r} has a name with a space in it "
            f"({spaced[0]!r}); names are separated by commas: write '{key}:{fixed}'."
        )
    if not all(parts):
        raise ValueError(
            f"remat.policies.resolve: policy {text!r} has an empty name; write "
            f"'{key}:NAMES' with one or more comma-separated names, e.g. '{key}:a,b'."
        )
    return _PATTERNS[key](parts)


#: Policy factories, with a call to suggest when one is passed uncalled.
_FACTORIES: dict[Any, str] = {
    save_only_these_names: 'save_only_these_names("attn_out")',
    save_any_names_but_these: 'save_any_names_but_these("attn_out")',
    save_anything_except_these_names: 'save_anything_except_these_names("attn_out")',
    save_and_offload_only_these_names: (
        'save_and_offload_only_these_names(names_which_can_be_offloaded=["attn_out"])'
    ),
    offload_dot_with_no_batch_dims: "offload_dot_with_no_batch_dims()",
    save_from_both_policies: "save_from_both_policies(dots_saveable, save_last)",
    save_these_ops: "save_these_ops(torch.ops.aten.mm)",
    from_callable: "from_callable(my_policy_fn)",
    from_selective_checkpoint: "from_selective_checkpoint(my_policy_fn)",
    memory_budget: "memory_budget(0.3)",
}


def _check_policy_function(fn: Callable[..., Any]) -> None:
    """A callable policy: not an uncalled factory or class, and callable as fn(op, *args, **kwargs).

    Checked when the policy is given, since a wrong one fails (or decides
    nonsense) only once an op runs.
    """
    factory = next((call for f, call in _FACTORIES.items() if f is fn), None)
    if factory is not None:
        name = getattr(fn, "__name__", repr(fn))
        raise TypeError(
            f"remat.policies.resolve: got the policy factory remat.policies.{name} itself, "
            f"not a policy; call it, e.g. policy=remat.policies.{factory}."
        )
    if isinstance(fn, type):
        raise TypeError(
            f"remat.policies.resolve: got the class {fn.__qualname__}, not a policy; pass a "
            "policy object or a name such as 'dots-saveable'."
        )
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins and some C callables have none
    params = list(signature.parameters.values())
    kinds = {p.kind for p in params}
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    required_kw = [p for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
    takes_op = bool(positional) or inspect.Parameter.VAR_POSITIONAL in kinds
    if (
        len(required) <= 1
        and takes_op
        and not required_kw
        and inspect.Parameter.VAR_POSITIONAL in kinds
        and inspect.Parameter.VAR_KEYWORD in kinds
    ):
        return
    name = getattr(fn, "__qualname__", None) or repr(fn)
    bare = signature.replace(  # without annotations: the message shows the arity
        parameters=[p.replace(annotation=p.empty) for p in params],
        return_annotation=inspect.Signature.empty,
    )
    hint = ""
    if len(required) == 2 and required[0].name == "ctx":
        hint = (
            " It looks like a torch.utils.checkpoint selective-checkpoint policy "
            f"(ctx, op, ...): pass policy=remat.policies.from_selective_checkpoint({name})."
        )
    raise TypeError(
        f"remat.policies.resolve: the policy function {name}{bare} cannot be called as "
        "fn(op, *args, **kwargs): remat calls it once per op with the aten op, then the "
        "op's positional and keyword arguments. Define it as "
        "def policy(op, *args, **kwargs) -> bool | Decision." + hint
    )


def resolve(policy: PolicyLike) -> Policy:
    """Turn any accepted form of a policy into a :class:`Policy`.

    Accepted forms: a :class:`Policy` (returned as is); a policy string (see the
    table in the docs; ``"A+B"`` combines with :func:`save_from_both_policies`);
    a callable ``fn(op, *args, **kwargs) -> bool | Decision``; a list, tuple or set
    of aten ops to save.

    Args:
        policy (Policy | str | Callable | list): the policy.

    Returns:
        Policy: the policy object.

    Raises:
        ValueError: for an unknown or malformed policy string.
        TypeError: for anything else.

    >>> resolve("dots_saveable")
    dots_saveable
    >>> resolve("save:a,b + dots-no-batch-saveable")
    save_from_both_policies(save_only_these_names('a', 'b'), dots_with_no_batch_dims_saveable)
    >>> resolve("dots-savable")
    Traceback (most recent call last):
    ...
    ValueError: remat.policies.resolve: unknown policy 'dots-savable'; did you mean ...
    """
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, str):
        parts = [p.strip() for p in policy.split("+")]
        if not all(parts):
            raise ValueError(
                f"remat.policies.resolve: policy {policy.strip()!r} has an empty part around "
                "'+'; write 'A+B' with a policy on each side, e.g. 'save-last+dots-saveable'."
            )
        result = _resolve_one(parts[0])
        for part in parts[1:]:
            result = save_from_both_policies(result, _resolve_one(part))
        return result
    if isinstance(policy, list | tuple | set | frozenset):
        return save_these_ops(*policy)
    if isinstance(policy, OpOverload | OpOverloadPacket):
        raise TypeError(
            f"remat.policies.resolve: got the aten op {policy}, not a policy; to save its "
            f"outputs pass a list of ops: policy=[torch.ops.{policy}]."
        )
    if callable(policy):
        _check_policy_function(policy)
        return from_callable(policy)
    raise TypeError(
        "remat.policies.resolve: expected a Policy, a policy name such as 'dots-saveable', "
        "a function fn(op, *args, **kwargs) -> bool | Decision, or a list of aten ops; "
        f"got {policy!r} ({type(policy).__name__})."
    )
