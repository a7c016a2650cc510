"""Layers a model declares checkpointable (Hugging Face ``GradientCheckpointingLayer``).

Found by class name and module along the MRO, so no ``transformers`` import is
needed to look (and a model without ``transformers`` installed declares none).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from torch import nn

from ._errors import RematWarning

__all__ = ["is_declared_layer", "warn_if_checkpointed_twice"]

_DECLARED = (("transformers.modeling_layers", "GradientCheckpointingLayer"),)


def is_declared_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a layer its library lets a checkpoint function wrap."""
    return any((k.__module__, k.__qualname__) in _DECLARED for k in type(module).__mro__)


def hf_checkpoints(module: nn.Module) -> bool:
    """Whether Hugging Face's own checkpointing is on for this layer."""
    return is_declared_layer(module) and module.__dict__.get("gradient_checkpointing") is True


def warn_if_checkpointed_twice(api: str, chosen: Sequence[nn.Module]) -> None:
    """Warn when remat wraps layers that Hugging Face's own checkpointing also runs."""
    twice = [sub for module in chosen for sub in module.modules() if hf_checkpoints(sub)]
    if twice:
        warnings.warn(
            f"{api}: {len(twice)} layer(s) of type {type(twice[0]).__name__} are also "
            "checkpointed by Hugging Face's own gradient checkpointing, so they are "
            "checkpointed twice and Hugging Face's full checkpoint overrides remat's policy. "
            "Use remat.integrations.huggingface.enable(model, policy=...) instead, which "
            "replaces it, or turn it off first with "
            "remat.integrations.huggingface.disable(model).",
            RematWarning,
            stacklevel=3,
        )
