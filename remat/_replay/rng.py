"""Capture and restore the random state a region's forward saw, so that its
recompute draws the same dropout masks; refuse a recompute that cannot.

NOTE [ Explicit generators ]
A ``torch.Generator`` passed to an op (``torch.rand(..., generator=g)``)
advances like the default ones, so the recompute would draw other numbers.
`generators_of` finds the generators a region can reach: among its call's
arguments, and in what its function reaches (closure cells, default
arguments, the globals its code names, attributes of a bound method's object,
of modules and their submodules, of objects and containers held there, a few
levels deep and a few dozen items wide; `_replay/generators.py`, which walks
once per function: NOTE [ The generator walk cache ]). Their states are
captured with the default generators' and restored for the recompute. A
generator reached otherwise (returned by a function call) is not found: the
docs say to pass it as an argument.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator

import torch

from .._compat import VMAP, interpreters, no_dispatch_modes
from .._errors import RematError
from .generators import generators_of

__all__ = ["RngState", "check_batched_recompute", "generators_of", "vmap_levels"]


@dataclasses.dataclass(frozen=True)
class RngState:
    """The CPU generator state, the state of every CUDA device the inputs live on,
    and the states of the explicit generators the region reaches."""

    cpu: torch.Tensor
    cuda: tuple[tuple[int, torch.Tensor], ...]
    generators: tuple[tuple[torch.Generator, torch.Tensor], ...] = ()

    @classmethod
    def capture(
        cls, tensors: Iterable[torch.Tensor], generators: Iterable[torch.Generator] = ()
    ) -> RngState:
        """Snapshot the generators that ops on ``tensors`` (or on the CPU) draw from,
        and ``generators`` (see `generators_of`)."""
        devices = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
        if devices and not torch.cuda.is_initialized():
            devices = []  # an uninitialized CUDA context has drawn nothing yet
        if not devices and torch.cuda.is_available() and torch.cuda.is_initialized():
            devices = [torch.cuda.current_device()]
        cuda = tuple((d, torch.cuda.get_rng_state(d)) for d in devices)
        explicit = tuple((g, g.get_state()) for g in generators)
        return cls(torch.get_rng_state(), cuda, explicit)

    def now(self) -> RngState:
        """The same generators' states now (cheap: the forward's end keeps one)."""
        cuda = tuple((d, torch.cuda.get_rng_state(d)) for d, _ in self.cuda)
        explicit = tuple((g, g.get_state()) for g, _ in self.generators)
        return RngState(torch.get_rng_state(), cuda, explicit)

    def differs(self, other: RngState) -> bool:
        """Whether a generator moved between ``self`` and ``other``."""
        with no_dispatch_modes():  # our comparison is no op of an enclosing region
            if not torch.equal(other.cpu, self.cpu):
                return True
            states = [(a, b) for (_, a), (_, b) in zip(self.cuda, other.cuda, strict=True)]
            pairs = zip(self.generators, other.generators, strict=True)
            states += [(a, b) for (_, a), (_, b) in pairs]
            return any(not torch.equal(a, b) for a, b in states)

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        """Run the block with the captured state, then put the current state back."""
        cpu_now = torch.get_rng_state()
        cuda_now = [(d, torch.cuda.get_rng_state(d)) for d, _ in self.cuda]
        explicit_now = [(g, g.get_state()) for g, _ in self.generators]
        torch.set_rng_state(self.cpu)
        for device, state in self.cuda:
            torch.cuda.set_rng_state(state, device)
        for generator, state in self.generators:
            generator.set_state(state)
        try:
            yield
        finally:
            torch.set_rng_state(cpu_now)
            for device, state in cuda_now:
                torch.cuda.set_rng_state(state, device)
            for generator, state in explicit_now:
                generator.set_state(state)


def vmap_levels() -> frozenset[int]:
    """The levels of the live ``vmap`` transforms."""
    return frozenset(i.level() for i in interpreters() if i.key() == VMAP)


def check_batched_recompute(
    before: RngState | None, after: RngState | None, forward_levels: frozenset[int], label: str
) -> None:
    """Raise when a random region is recomputed under a ``vmap`` its forward did not run in.

    Restoring the generator replays the forward's draws only if the recompute
    draws the same shapes: under a new ``vmap`` (``jacrev``, ``vmap`` over a
    ``vjp_fn`` or over ``torch.autograd.grad``) a random op would draw per
    batch element (``randomness="different"``) or fail (``"error"``).
    ``"same"`` draws the forward's values again. (``is_grads_batched=True``
    uses torch's older vmap, which refuses random ops by itself.)
    """
    for interpreter in interpreters():
        if interpreter.key() != VMAP or interpreter.level() in forward_levels:
            continue
        randomness = interpreter.randomness()  # type: ignore[attr-defined]
        # The forward drew random numbers if a generator moved during it (compared
        # only here: a comparison costs more than keeping the end state).
        drew = before is not None and after is not None and before.differs(after)
        if randomness != "same" and drew:
            raise RematError(
                f"remat: {label} draws random numbers (dropout, rand) in its forward, and its "
                "backward runs under a vmap its forward did not run in (jacrev, vmap over a "
                "vjp_fn or over torch.autograd.grad) with "
                f"randomness={randomness!r}: the recompute cannot draw the forward's random "
                "numbers again. Use policy='everything-saveable' for this region, "
                "vmap(..., randomness='same'), or keep the random ops out of the region."
            )
