"""`remat.sequential`: a sequence of layers in rematerialized segments.

Each segment is one region (NOTE [ Wrapped modules ] rule 3 in ``_modules.py``:
a segment runs its modules under a `StateGuard`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from . import policies
from ._api import remat
from ._capture.module_state import StateGuard
from ._capture.stateful import GuardsItsModules
from ._engines.select import traced
from ._modules import check_module_options
from .policies import PolicyLike

__all__ = ["segment_bounds", "sequential"]


@GuardsItsModules.register
class _Segment:
    """Layers ``[start, stop)`` of a sequence, run one after another."""

    def __init__(self, layers: Sequence[Callable[..., Any]]) -> None:
        # An attribute (not a closure cell) so the torch.func engine finds the modules.
        self.layers = list(layers)
        self.__qualname__ = "remat.sequential segment"
        self.state = StateGuard(
            self.__qualname__, roots=[m for m in self.layers if isinstance(m, nn.Module)]
        )

    def __call__(self, x: Any) -> Any:
        if traced():  # lowered: no guard (NOTE [ Lowering ... ] rule 8)
            return self._run(x)
        with self.state.guarded():
            return self._run(x)

    def _run(self, x: Any) -> Any:
        for layer in self.layers:
            x = layer(x)
        return x


def segment_bounds(n: int, segments: int) -> list[tuple[int, int]]:
    """Split ``n`` layers into ``segments`` runs, as ``checkpoint_sequential`` does.

    Every segment but the last has ``n // segments`` layers; the last takes the
    rest (so it is the largest).

    Examples:
        >>> from remat._sequential import segment_bounds
        >>> segment_bounds(7, 3)
        [(0, 2), (2, 4), (4, 7)]
    """
    if not 1 <= segments <= n:
        raise ValueError(
            f"remat.sequential: segments must be between 1 and the number of layers ({n}), "
            f"got {segments}"
        )
    size = n // segments
    bounds = [(i * size, (i + 1) * size) for i in range(segments - 1)]
    bounds.append(((segments - 1) * size, n))
    return bounds


def sequential(
    layers: nn.Sequential | nn.ModuleList | Sequence[Callable[..., Any]],
    x: Any,
    /,
    *,
    segments: int = 1,
    policy: PolicyLike = "save-last",
    **remat_options: Any,
) -> Any:
    """Run ``layers`` on ``x`` in ``segments`` rematerialized segments; return the output.

    Each layer gets the previous layer's output (any pytree) as its single
    argument. The layers are split as ``torch.utils.checkpoint.checkpoint_sequential``
    splits them (see `segment_bounds`), but *every* segment is a region. Under
    the default ``"save-last"`` the most recent segment keeps its activations,
    so backward starts without recomputing it (6 layers in 3 segments: layer
    forward counts ``[2, 2, 2, 2, 1, 1]``, as ``checkpoint_sequential``);
    ``"nothing-saveable"`` recomputes every segment, the last one too.

    Args:
        layers (nn.Sequential | nn.ModuleList | sequence of callables): the layers.
        x: the input of the first layer.
        segments (int, optional): how many regions, from 1 to ``len(layers)``.
            Default: 1.
        policy (optional): the policy of every segment, as for `remat.remat`.
            Default: "save-last".
        **remat_options: the other options of `remat.remat`.

    Returns:
        The last layer's output.

    Raises:
        ValueError: ``segments`` is out of range.
        TypeError: a layer is not callable.

    Examples:
        >>> import torch, remat
        >>> net = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(6)])
        >>> y = remat.sequential(net, torch.randn(2, 4), segments=3)
        >>> y.sum().backward()
        >>> net[0].weight.grad.shape
        torch.Size([4, 4])
    """
    check_module_options("remat.sequential", remat_options)
    policies.resolve(policy)
    layers = list(layers)
    for i, layer in enumerate(layers):
        if not callable(layer):
            raise TypeError(f"remat.sequential: layer {i} is not callable: {layer!r}")
    for start, stop in segment_bounds(len(layers), segments):
        x = remat(_Segment(layers[start:stop]), policy=policy, **remat_options)(x)
    return x
