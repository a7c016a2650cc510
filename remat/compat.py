"""``torch.utils.checkpoint``'s signatures on remat's engines: a one-line migration.

Replace ``torch.utils.checkpoint.checkpoint`` with `remat.compat.checkpoint` (and
``checkpoint_sequential`` with `remat.compat.checkpoint_sequential`): the same
call, and code that takes a checkpoint *function* (Hugging Face's
``_gradient_checkpointing_func``, ``checkpoint_wrapper(checkpoint_fn=...)``)
runs remat unchanged. What changes is what remat adds: the call works under
``torch.func`` (where torch's raises "don't yet support saved tensor hooks"),
and it takes a ``policy=``.

NOTE [ torch's options on remat's engines ]
1. ``use_reentrant``: ``None``, ``False`` and ``True`` all run remat's engine,
   without torch's warning for ``None``. torch's reentrant variant differs only
   where it is wrong or refuses (no parameter gradients when no input requires
   grad; ``torch.autograd.grad`` and keyword arguments refused); remat's
   gradients are ``function``'s in every case, which is what ``True`` asks for
   wherever it works.
2. ``context_fn`` from ``create_selective_checkpoint_contexts`` becomes the
   region's policy (NOTE [ context_fn from create_selective_checkpoint_contexts ]);
   giving it together with a ``policy`` other than the default raises. Other
   contexts raise ``ValueError`` with the fix (enter them inside ``function``).
3. ``determinism_check`` (``"default"``/``"none"``), ``debug`` and
   ``preserve_rng_state`` are remat's options of the same names. ``early_stop``
   is accepted and changes nothing: remat's recompute always runs the region to
   its end, and gradients do not depend on it.
4. A ``functools.partial`` is unpacked into its function and arguments (Hugging
   Face hands ``partial(forward, layer, **kwargs)``), so the module and tensors
   it binds are region arguments the ``torch.func`` engine sees.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from ._api import remat
from ._engines.region import describe_callable
from ._policy.contexts import policy_of_context_fn
from ._sequential import sequential
from .policies import PolicyLike

__all__ = ["checkpoint", "checkpoint_sequential"]

_DEFAULT_POLICY = "nothing-saveable"


def checkpoint(
    function: Callable[..., Any],
    *args: Any,
    use_reentrant: bool | None = None,
    context_fn: Callable[[], Any] | None = None,
    determinism_check: str | bool = "default",
    debug: bool = False,
    preserve_rng_state: bool = True,
    early_stop: bool = True,
    policy: PolicyLike = _DEFAULT_POLICY,
    **kwargs: Any,
) -> Any:
    """Run ``function(*args, **kwargs)`` as a rematerialized region, with torch's signature.

    A drop-in for ``torch.utils.checkpoint.checkpoint`` that runs on remat's
    engines: it works under ``torch.func`` transforms and takes a ``policy``.

    Args:
        function (callable): the function (or module) to rematerialize.
        *args: its positional arguments (any pytrees).
        use_reentrant (bool, optional): accepted for torch's signature; every
            value runs remat's engine (NOTE [ torch's options on remat's engines ]
            rule 1). Default: None.
        context_fn (callable, optional): ``functools.partial(
            create_selective_checkpoint_contexts, policy_fn_or_ops)``; its policy
            becomes the region's. Default: None.
        determinism_check ("default" | "none" | bool, optional): check that the
            recompute reproduces the forward. Default: "default".
        debug (bool, optional): keep op logs, shown side by side on a mismatch.
        preserve_rng_state (bool, optional): replay dropout masks. Default: True.
        early_stop (bool, optional): accepted for torch's signature; no effect.
        policy (optional): what to keep, as for `remat.remat`.
            Default: "nothing-saveable".
        **kwargs: keyword arguments of ``function``.

    Returns:
        ``function``'s output.

    Raises:
        ValueError: ``context_fn`` is not from ``create_selective_checkpoint_contexts``,
            or it comes with another ``policy``.
        TypeError: an option has the wrong type.

    Examples:
        >>> import torch, remat.compat
        >>> block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
        >>> x = torch.randn(2, 4, requires_grad=True)
        >>> remat.compat.checkpoint(block, x, use_reentrant=False).sum().backward()
        >>> def loss(x):
        ...     return remat.compat.checkpoint(block, x).sum()
        >>> torch.func.grad(loss)(x).shape
        torch.Size([2, 4])
    """
    api = "remat.compat.checkpoint"
    _check_reentrant(api, use_reentrant)
    _check_flag(api, "early_stop", early_stop)
    target, args, kwargs = _unpack_partial(function, args, kwargs)
    policy = _policy(api, policy, context_fn, target)
    region = remat(
        target,
        policy=policy,
        preserve_rng_state=preserve_rng_state,
        determinism_check=determinism_check,  # type: ignore[arg-type]  # checked by remat
        debug=debug,
    )
    return region(*args, **kwargs)


def checkpoint_sequential(
    functions: nn.Sequential | nn.ModuleList | Sequence[Callable[..., Any]],
    segments: int,
    input: Any,
    use_reentrant: bool | None = None,
    policy: PolicyLike = "save-last",
    **kwargs: Any,
) -> Any:
    """Run ``functions`` on ``input`` in ``segments`` regions, with torch's signature.

    A drop-in for ``torch.utils.checkpoint.checkpoint_sequential``. The layers
    are split as torch splits them; under the default ``"save-last"`` every
    segment is a region and the last one keeps its activations, so the
    recompute counts are torch's (which runs its last segment plainly). Any
    other policy applies to every segment, the last one too.

    Args:
        functions (nn.Sequential | nn.ModuleList | sequence of callables): the layers.
        segments (int): how many segments, from 1 to ``len(functions)``.
        input: the first layer's input.
        use_reentrant (bool, optional): accepted; every value runs remat's engine.
        policy (optional): the policy of every segment. Default: "save-last".
        **kwargs: ``preserve_rng_state`` (torch's only keyword here), and the
            other options of `remat.remat`.

    Returns:
        The last layer's output.

    Raises:
        ValueError: ``segments`` is out of range.

    Examples:
        >>> import torch, remat.compat
        >>> net = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(4)])
        >>> y = remat.compat.checkpoint_sequential(net, 2, torch.randn(2, 4), use_reentrant=False)
        >>> y.sum().backward()
    """
    _check_reentrant("remat.compat.checkpoint_sequential", use_reentrant)
    return sequential(functions, input, segments=segments, policy=policy, **kwargs)


def _check_reentrant(api: str, use_reentrant: object) -> None:
    if use_reentrant is not None:
        _check_flag(api, "use_reentrant", use_reentrant)


def _check_flag(api: str, name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(
            f"{api}: {name} must be True or False, got {value!r} ({type(value).__name__})"
        )


def _policy(
    api: str, policy: PolicyLike, context_fn: Callable[[], Any] | None, fn: Callable[..., Any]
) -> PolicyLike:
    label = describe_callable(fn)
    selective = policy_of_context_fn(context_fn, api, label)
    if selective is None:
        return policy
    if not (isinstance(policy, str) and policy == _DEFAULT_POLICY):
        raise ValueError(
            f"{api}: got both context_fn (a selective-checkpoint policy) and "
            f"policy={policy!r} for {label}; give one of them: drop context_fn, or drop policy="
        )
    return selective


def _unpack_partial(
    function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
    """``partial(f, *a, **k)(*args, **kwargs)`` as ``f(*a, *args, **k, **kwargs)`` (NOTE rule 4)."""
    if isinstance(function, functools.partial):
        return function.func, (*function.args, *args), {**function.keywords, **kwargs}
    return function, args, kwargs
