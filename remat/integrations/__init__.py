"""Integrations with libraries that already checkpoint: `remat.integrations.huggingface`.

Each integration imports its library lazily, so ``import remat.integrations``
works without it.
"""

__all__ = ["huggingface"]
