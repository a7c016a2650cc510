"""The region over a vmap batch: a twin call of ``vmap(fn)``.

NOTE [ The functional engine ] rule 10 (in ``__init__.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..._capture.closure import Bindings
from ..._compat import GRAD, VMAP, current_level
from ..._replay.checks import OpTrace
from ..._state import local
from .call import _Call
from .levels import _batched_at


def batched_twin(call: _Call, tensors: Sequence[torch.Tensor], runner: _VmapRunner) -> _Call:
    """This call over a vmap batch: ``runner`` (``vmap(fn)``) of the physical inputs."""
    twin = _Call(call.region, runner, tuple(tensors), {}, bindings=Bindings())
    twin.batched = True
    twin.differentiable = twin.differentiable or call.differentiable
    # The original call's trace, inside ``runner``, checks every recompute.
    twin.trace = OpTrace(call.region.label, enabled=False)
    # And its escape watch, inside ``runner``, finds what ``fn`` lets out (NOTE
    # [ Escaped tensors ] rule 6): the twin's would see dead inner wrappers.
    twin.escapes.enabled = False
    return twin


def reversed_inside_vmap(call: _Call) -> bool:
    """Whether a reverse level above this call's innermost vmap will call its backward.

    That backward (``vmap(grad)``) runs under the vmap with the grad level
    inside it, so the twin's forward runs ``vmap(vjp(fn))`` to see the same
    physical ops (NOTE [ The functional engine ] rule 7), not ``vjp(vmap(fn))``.
    """
    vmaps = [level for kind, level in call.transforms if kind == VMAP]
    if not vmaps:
        return False
    return any(kind == GRAD and level > max(vmaps) for kind, level in call.transforms)


class _VmapRunner:
    """``vmap`` of one call's ``run``; outputs that do not depend on the batch stay unbatched.

    ``torch.func.vmap`` needs its ``out_dims`` before the function runs, so the
    outputs not batched at its level leave it beside its return value, as they
    are (they belong to the levels below, which are still live), with out dim
    ``None``: no expanded copy, and no gradient summed over the batch.
    """

    def __init__(
        self, call: _Call, dims: Sequence[int | None], batch_size: int, randomness: str
    ) -> None:
        self.call = call
        self.dims = tuple(dims)
        self.batch_size = batch_size
        self.randomness = randomness
        self.out_dims: tuple[int | None, ...] = ()
        call_inside = reversed_inside_vmap(call)
        self.run = call.run_as_differentiated if call_inside else call.run
        #: The first run is the twin's forward; later ones are its recomputes.
        self.first = True
        #: Whether the region runs inside another region's run (a nested region).
        self.nested = bool(local.substitutions)

    def __call__(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        flags: list[bool] = []
        unbatched: list[torch.Tensor] = []

        def per_example(*example: torch.Tensor) -> tuple[torch.Tensor, ...]:
            out = self.run_with_escapes(example)
            level = current_level()
            flags[:] = [_batched_at(t, level) for t in out]
            unbatched[:] = [t for t, b in zip(out, flags, strict=True) if not b]
            return tuple(t for t, b in zip(out, flags, strict=True) if b)

        batched = iter(
            torch.func.vmap(per_example, in_dims=self.dims, out_dims=0, randomness=self.randomness)(
                *tensors
            )
        )
        rest = iter(unbatched)
        self.out_dims = tuple(0 if b else None for b in flags)
        return tuple(next(batched) if b else next(rest) for b in flags)

    def run_with_escapes(self, example: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """One example's outputs, then the tensors ``fn`` let out (NOTE [ Escaped
        tensors ] rule 6): found in the forward, captured again in a recompute."""
        escapes = self.call.escapes
        if not self.first:
            return escapes.run(lambda: self.run(example))
        self.first = False
        differentiated = self.call.escape_seeds
        if not differentiated and not self.nested:
            return self.run(example)
        # Nested, a call no level differentiates may still be differentiated by the
        # outer region's recompute: what it lets out, from any input, is loud then.
        seeds = [example[i] for i in differentiated] if differentiated else example
        with escapes.watching_calls(seeds):
            out = self.run(example)
        out, escaped = escapes.collect(out)
        if escaped and not differentiated:
            raise escapes.error_for_first(
                "it was made inside its vmap, inside another rematerialized region's run, "
                "where it cannot be handed back"
            )
        return (*out, *escaped)
