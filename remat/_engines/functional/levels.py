"""Functorch levels: which are live, which differentiate, when replay is valid.

NOTE [ The functional engine ] rules 3, 4 and 9 (in ``__init__.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from ..._compat import (
    GRAD,
    JVP,
    current_level,
    eager_forward_ad_level,
    functorch_disabled,
    functorch_level,
    interpreters,
    is_batched,
    is_functorch_wrapped,
    no_dispatch_modes,
    physical,
    unwrap_once,
    wrap_for_grad,
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

def _unrecorded(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors``, those eager autograd would record (plain, requiring grad) detached.

    A ``vjp`` must run with grad mode on: kernels below every level read it
    (CPU ``nn.LSTM``'s ``mkldnn_rnn_layer`` keeps its ``workspace`` for backward only
    then). Eager autograd must not record a backward's recompute that nothing
    differentiates (NOTE [ The functional engine ] rule 4): it would hold a
    second graph of the region. A detached alias shares the tensor's memory and
    version counter.
    """
    with internal():  # remat's own work: no op of the region's (an outer region's trace)
        return [
            t.detach() if t.requires_grad and not is_functorch_wrapped(t) else t
            for t in tensors
        ]

def _recompute_mode(
    inputs: tuple[torch.Tensor, ...], keep_graph: bool
) -> tuple[contextlib.AbstractContextManager[None], tuple[torch.Tensor, ...]]:
    """The grad mode a backward recomputes under, and the inputs it recomputes from.

    Its graph kept (rule 4): as the caller has it. Else under eager autograd (no
    functorch level: plain inputs) with grad mode on and no input eager autograd
    records (`_unrecorded`); inside a transform under
    ``no_grad``, so the outer levels drop the recompute (its ``vjp`` still records).
    """
    if keep_graph:
        return contextlib.nullcontext(), inputs
    if any(is_functorch_wrapped(t) for t in inputs):
        return torch.no_grad(), inputs
    return torch.enable_grad(), tuple(_unrecorded(inputs))

def _writable_inside(tensors: list[torch.Tensor], moved: Sequence[int]) -> None:
    """Wrap the inputs at ``tensors`` not at ``moved`` at the innermost grad level, in place.

    A recorded forward runs ``fn`` under ``torch.func.vjp`` of the differentiated
    inputs (NOTE [ The functional engine ] rule 7); an op writing another input in
    place there (BatchNorm's ``num_batches_tracked`` passed to ``functional_call``)
    is refused as a "captured" tensor. ``torch.func.grad`` wraps every argument
    for that reason, not requiring grad, and so do we: the ops are the same.
    """
    level = current_level()
    if level is None:
        return
    skip = set(moved)
    for i, t in enumerate(tensors):
        # (Inside a nested region an input may be a wrapper of that level already.)
        if i not in skip and functorch_level(t) < level:
            tensors[i] = wrap_for_grad(t, level)

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
    # Eager autograd records a backward only under grad mode (``create_graph``, or
    # functorch's own backward); ``loss.backward()`` runs it without.
    if not torch.is_grad_enabled():
        return False
    tensors = [t for t in (*inputs, *grads) if t is not None]
    return any(physical(t).requires_grad for t in tensors)

def _levels_differ(keep_graph: bool, inputs: Sequence[torch.Tensor]) -> bool:
    """Whether the recompute may be recorded by other levels than the forward was.

    The recorded forward runs its ``vjp`` under grad mode, with the outer
    levels lowered (NOTE [ The functional engine ] rules 1 and 7): eager autograd
    records it too where a plain input requires grad. The backward's recompute
    is recorded by its ``vjp`` and, when its graph is kept under grad mode (rule
    4), by the outer levels. Autograd saves a copy of what an in-place op
    overwrites once per recording level (``gru_cell``'s ``mul_``): where the counts
    may differ a failed replay is run again in full (`_recompute_or_rerun`),
    still checked against the forward's torch calls.
    """
    if keep_graph and torch.is_grad_enabled():
        return True
    return any(t.requires_grad and not is_functorch_wrapped(t) for t in inputs)

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
