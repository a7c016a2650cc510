"""Functorch levels: which are live, which differentiate, when replay is valid.

NOTE [ The functional engine ] rules 3, 4 and 9 (in ``__init__.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ..._compat import (
    GRAD,
    JVP,
    eager_forward_ad_level,
    functorch_disabled,
    functorch_level,
    interpreters,
    is_batched,
    is_functorch_wrapped,
    no_dispatch_modes,
    physical,
    unwrap_once,
)
from ..._errors import RematError
from ..._state import internal
from ..region import Region


def _tracked(t: torch.Tensor) -> bool:
    """Whether some level (a functorch grad level or eager autograd) differentiates ``t``."""
    if not _differentiable(t):
        return False
    while True:
        if t.requires_grad:
            return True
        if not is_functorch_wrapped(t):
            return False
        t = unwrap_once(t)

def _wrapped(t: torch.Tensor) -> bool:
    return is_functorch_wrapped(t)

def _differentiable(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()

def _batched_at(t: torch.Tensor, level: int | None) -> bool:
    return is_batched(t) and functorch_level(t) == level

def _backward_is_differentiated(
    inputs: tuple[torch.Tensor, ...], grads: tuple[torch.Tensor | None, ...]
) -> bool:
    """Whether anything may differentiate this backward (NOTE [ The functional engine ] rule 4).

    ``inputs`` are the saved inputs as the level being differentiated saw them
    (wrapped at that level, which may have exited already): that level is the
    highest one they carry.
    """
    own = max((functorch_level(t) for t in inputs), default=-1)
    for interpreter in interpreters():
        if interpreter.key() == GRAD and interpreter.level() != own:
            return True
    tensors = [t for t in (*inputs, *grads) if t is not None]
    return any(physical(t).requires_grad for t in tensors)

@contextlib.contextmanager
def _below_all_levels() -> Iterator[None]:
    """Plain tensor ops, seen by no dispatch mode and no functorch level (store copies)."""
    with no_dispatch_modes(), functorch_disabled(), internal():
        yield

def _forward_ad_active() -> bool:
    """Whether a forward-mode level (functorch ``jvp`` or eager ``forward_ad``) is live."""
    return _forward_ad_levels() > 0

def _escape_seeds(inputs: tuple[torch.Tensor, ...], differentiated: list[int]) -> list[int]:
    """The inputs whose dependents, if ``fn`` lets them out, need derivatives.

    The differentiated ones, and under a forward-mode level every differentiable
    input: which inputs carry a tangent cannot be read below another level (a
    ``jvp`` around a ``grad``, ``jacfwd`` around a ``vmap``). An escape made
    from an input that has none gets a zero tangent: an extra output for nothing.
    """
    if not _forward_ad_active():
        return differentiated
    return [i for i, t in enumerate(inputs) if _differentiable(t)]

def _forward_ad_levels() -> int:
    """How many forward-mode levels (functorch ``jvp``s, eager ``forward_ad``) are live."""
    jvps = sum(i.key() == JVP for i in interpreters())
    # functorch's outermost jvp enters the eager dual level too, and torch refuses
    # both at once ("Nested forward mode AD is not supported"): count it once.
    return jvps if jvps else int(eager_forward_ad_level() >= 0)

@contextlib.contextmanager
def _inference_mode_errors(region: Region) -> Iterator[None]:
    """Say what to do when ``fn`` reads a transformed tensor under ``inference_mode``.

    This engine runs ``fn`` on functorch wrappers (its backward always does, under
    ``torch.func.vjp``), and torch refuses to detach or save one inside an
    ``inference_mode`` block. ``no_grad`` computes the same constant and works.
    """
    try:
        yield
    except RuntimeError as error:
        text = str(error)
        known = ("version_counter for inference tensor", "do not track version counter")
        if isinstance(error, RematError) or not any(k in text for k in known):
            raise
        raise RematError(
            f"remat: {region.label} uses a torch.func-transformed tensor inside a "
            f"torch.inference_mode() block ({error}). The torch.func engine runs the "
            "function on transformed tensors (its backward always does, through "
            "torch.func.vjp), and torch refuses those in inference mode. Use "
            "torch.no_grad() instead of torch.inference_mode() for that block (it "
            "computes the same constant), or, for a loss.backward() outside any "
            "torch.func transform, pass engine='eager' to remat."
        ) from error
