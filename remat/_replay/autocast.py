"""Capture the autocast settings a region's forward ran under, to recompute under the same."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch

__all__ = ["AutocastState", "autocast_on"]

_DEVICE_TYPES = ("cpu", "cuda")


def autocast_on() -> bool:
    """Whether autocast is on for any device type (``cpu``, ``cuda``)."""
    return any(torch.is_autocast_enabled(device) for device in _DEVICE_TYPES)


@dataclasses.dataclass(frozen=True)
class AutocastState:
    """Which device types had autocast on, with which dtype."""

    enabled: tuple[tuple[str, torch.dtype], ...]
    cache_enabled: bool

    @classmethod
    def capture(cls) -> AutocastState:
        enabled = tuple(
            (device, torch.get_autocast_dtype(device))
            for device in _DEVICE_TYPES
            if torch.is_autocast_enabled(device)
        )
        return cls(enabled, torch.is_autocast_cache_enabled())

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Run the block under the captured autocast settings."""
        with contextlib.ExitStack() as stack:
            for device in _DEVICE_TYPES:
                if torch.is_autocast_enabled(device) and device not in dict(self.enabled):
                    stack.enter_context(torch.autocast(device, enabled=False))
            for device, dtype in self.enabled:
                stack.enter_context(
                    torch.autocast(device, dtype=dtype, cache_enabled=self.cache_enabled)
                )
            yield
