"""Hugging Face models train with remat in one call: `enable` / `disable`.

NOTE [ Through Hugging Face's own checkpointing layers ]
1. A Hugging Face model checkpoints through its ``GradientCheckpointingLayer``s:
   each layer whose ``gradient_checkpointing`` flag is on calls
   ``self._gradient_checkpointing_func(partial(forward, self, **kwargs), *args)``
   in training. `enable` hands the model's own ``_set_gradient_checkpointing``
   a `RematCheckpoint` as that function, so the model decides, as it always
   does, which layers run through it (``every_n_layers``) and when (training,
   gradients on).
2. The KV cache: before calling the function, the layer sets ``use_cache=False``
   and drops the cache it was handed (``cache``/``layer_past``), with Hugging
   Face's warning, exactly as under its own checkpointing. A recomputed layer
   therefore never appends to a cache twice; ``model.eval()`` or
   ``torch.no_grad()`` (``generate``) runs the layers plainly, cache included.
3. One function slot, so no stacking: `enable` replaces Hugging Face's own
   checkpointing when it was on, and ``gradient_checkpointing_enable()`` after
   `enable` replaces remat's. Layers wrapped by `remat.apply`/`remat.wrap` are
   unwrapped first, so a layer is never checkpointed twice. `disable` turns
   checkpointing through the layers off, whoever turned it on.
4. The function is `remat.compat.checkpoint`, so it works under
   ``torch.func.grad``/``vmap(grad)`` over ``functional_call`` (the torch.func
   engine sees the layer, handed in the ``partial``, as a region argument).
"""

from __future__ import annotations

import inspect
from typing import Any, TypeVar

from torch import nn

from .. import policies
from .._declared_layers import is_declared_layer
from .._modules import unwrap
from .._options import check_options
from ..compat import checkpoint
from ..policies import PolicyLike

__all__ = ["RematCheckpoint", "checkpointed_layers", "disable", "enable"]

M = TypeVar("M", bound=nn.Module)


class RematCheckpoint:
    """The checkpoint function `enable` gives a Hugging Face model (NOTE rule 1).

    Calls `remat.compat.checkpoint` with the policy and options `enable` got.
    """

    def __init__(self, policy: policies.Policy, options: dict[str, Any]) -> None:
        self.policy = policy
        self.options = options

    def __call__(self, function: Any, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(function, *args, policy=self.policy, **self.options, **kwargs)

    def __repr__(self) -> str:
        return f"RematCheckpoint(policy={self.policy!r})"


def enable(
    model: M,
    /,
    *,
    policy: PolicyLike = "nothing-saveable",
    every_n_layers: int = 1,
    preserve_rng_state: bool = True,
    determinism_check: bool | str = "default",
) -> M:
    """Checkpoint a Hugging Face model's layers with remat; return ``model``.

    Goes through the model's own checkpointing layers (NOTE [ Through Hugging
    Face's own checkpointing layers ]): the KV cache is handled in training as
    Hugging Face's checkpointing handles it, and Hugging Face's own
    checkpointing, if on, is replaced, not stacked on.

    Args:
        model (PreTrainedModel): the model, changed in place.
        policy (optional): what each layer keeps, as for `remat.remat`.
            Default: "nothing-saveable".
        every_n_layers (int, optional): checkpoint layers 0, n, 2n, ...; the
            others keep their activations. Default: 1 (every layer).
        preserve_rng_state (bool, optional): replay dropout masks. Default: True.
        determinism_check (bool | "default" | "none", optional): as for
            `remat.remat`. Default: "default".

    Returns:
        ``model`` itself.

    Raises:
        ImportError: ``transformers`` is not installed.
        ValueError: the model does not support Hugging Face's checkpointing, or
            ``every_n_layers`` is not a positive int, or the policy is unknown.

    Examples:
        >>> import torch, transformers
        >>> from remat.integrations import huggingface
        >>> config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2,
        ...                                  vocab_size=32, n_positions=16)
        >>> model = huggingface.enable(transformers.GPT2LMHeadModel(config).train(),
        ...                            policy="dots-saveable")
        >>> huggingface.checkpointed_layers(model)
        ['transformer.h.0', 'transformer.h.1']
        >>> ids = torch.randint(0, 32, (2, 8))
        >>> model(ids, labels=ids).loss.backward()
    """
    _require_transformers()
    resolved = policies.resolve(policy)
    if type(every_n_layers) is not int or every_n_layers < 1:
        raise ValueError(
            "remat.integrations.huggingface.enable: every_n_layers must be a positive int, "
            f"got {every_n_layers!r}"
        )
    setter = _setter(model)
    unwrap(model)  # remat.apply's wrappers would stack on the layers' checkpoint (rule 3)
    function = RematCheckpoint(
        resolved,
        {"preserve_rng_state": preserve_rng_state, "determinism_check": determinism_check},
    )
    check_options("remat.integrations.huggingface.enable", **function.options)
    if "every_n_layers" in inspect.signature(setter).parameters:
        setter(enable=True, gradient_checkpointing_func=function, every_n_layers=every_n_layers)
    else:  # transformers before every_n_layers existed: the same rule, applied here
        setter(enable=True, gradient_checkpointing_func=function)
        layers = [m for m in model.modules() if is_declared_layer(m)]
        for i, layer in enumerate(layers):
            setattr(layer, "gradient_checkpointing", i % every_n_layers == 0)  # noqa: B010
    return model


def disable(model: M, /) -> M:
    """Turn off checkpointing through the model's layers (remat's or Hugging Face's); return it.

    Afterwards the layers run their own forward, with no region and no
    checkpoint.

    Examples:
        >>> import transformers
        >>> from remat.integrations import huggingface
        >>> config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2,
        ...                                  vocab_size=32, n_positions=16)
        >>> model = huggingface.enable(transformers.GPT2LMHeadModel(config))
        >>> huggingface.checkpointed_layers(huggingface.disable(model))
        []
    """
    _require_transformers()
    _setter(model)(enable=False)
    return model


def checkpointed_layers(model: nn.Module, /) -> list[str]:
    """The qualified names of the layers remat checkpoints through `enable`."""
    return [
        name
        for name, module in model.named_modules()
        if is_declared_layer(module)
        and module.__dict__.get("gradient_checkpointing") is True
        and isinstance(module.__dict__.get("_gradient_checkpointing_func"), RematCheckpoint)
    ]


def _setter(model: nn.Module) -> Any:
    setter = getattr(model, "_set_gradient_checkpointing", None)
    supported = getattr(model, "supports_gradient_checkpointing", False)
    parameters = inspect.signature(setter).parameters if callable(setter) else {}
    if not supported or "gradient_checkpointing_func" not in parameters:
        raise ValueError(
            f"remat.integrations.huggingface: {type(model).__name__} does not support Hugging "
            "Face's gradient checkpointing (no supports_gradient_checkpointing, or the "
            "pre-4.35 _set_gradient_checkpointing(value=...) format); wrap its blocks "
            "directly instead: remat.apply(model, where=BlockType, policy=...)"
        )
    return setter


def _require_transformers() -> None:
    try:
        import transformers  # noqa: F401
    except ImportError as error:
        raise ImportError(
            "remat.integrations.huggingface needs transformers: pip install transformers"
        ) from error
