"""Capture and restore the random state a region's forward saw, so that its
recompute draws the same dropout masks."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator

import torch

__all__ = ["RngState"]


@dataclasses.dataclass(frozen=True)
class RngState:
    """The CPU generator state and the state of every CUDA device the inputs live on."""

    cpu: torch.Tensor
    cuda: tuple[tuple[int, torch.Tensor], ...]

    @classmethod
    def capture(cls, tensors: Iterable[torch.Tensor]) -> RngState:
        """Snapshot the generators that ops on ``tensors`` (or on the CPU) draw from."""
        devices = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
        if devices and not torch.cuda.is_initialized():
            devices = []  # an uninitialized CUDA context has drawn nothing yet
        if not devices and torch.cuda.is_available() and torch.cuda.is_initialized():
            devices = [torch.cuda.current_device()]
        cuda = tuple((d, torch.cuda.get_rng_state(d)) for d in devices)
        return cls(torch.get_rng_state(), cuda)

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        """Run the block with the captured state, then put the current state back."""
        cpu_now = torch.get_rng_state()
        cuda_now = [(d, torch.cuda.get_rng_state(d)) for d, _ in self.cuda]
        torch.set_rng_state(self.cpu)
        for device, state in self.cuda:
            torch.cuda.set_rng_state(state, device)
        try:
            yield
        finally:
            torch.set_rng_state(cpu_now)
            for device, state in cuda_now:
                torch.cuda.set_rng_state(state, device)
