"""Shared fixtures: deterministic seeds and the CPU-only default."""

from __future__ import annotations

import os

import hypothesis
import pytest
import torch

# The property tests draw the same examples on every run (CI must not turn red on a
# new random draw); ``HYPOTHESIS_PROFILE=explore`` draws fresh ones, for soak runs.
hypothesis.settings.register_profile("default", derandomize=True)
hypothesis.settings.register_profile("explore", derandomize=False)
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


class Engine:
    """How a test differentiates a rematerialized function under one engine.

    ``eager``: ``remat(..., engine="eager")`` and ``torch.autograd.grad`` (saved-tensor
    hooks). ``functional``: ``torch.func.grad`` with the default engine choice, which
    runs the region through the torch.func engine. ``grads(fn, *xs)`` returns the
    gradients of ``fn(*xs)`` (a scalar) w.r.t. every ``xs``; ``fn`` calls regions
    built with ``engine.remat``.
    """

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name

    def remat(self, fn: object = None, /, **options: object) -> object:
        import remat

        if self.name == "eager":
            options.setdefault("engine", "eager")
        if fn is None:
            return remat.remat(**options)  # type: ignore[call-overload]
        return remat.remat(fn, **options)  # type: ignore[call-overload]

    def grads(self, fn: object, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.name == "eager":
            leaves = [x.detach().requires_grad_() for x in xs]
            return torch.autograd.grad(fn(*leaves), leaves)  # type: ignore[operator]
        return torch.func.grad(fn, argnums=tuple(range(len(xs))))(*xs)  # type: ignore[arg-type]


@pytest.fixture(params=["eager", "functional"])
def engine(request: pytest.FixtureRequest) -> Engine:
    """Each test that takes ``engine`` runs once per engine; its id names the engine."""
    return Engine(request.param)
