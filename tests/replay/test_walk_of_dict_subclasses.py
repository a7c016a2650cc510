"""The generator walk's cache reads a dict subclass that redefines ``get``.

transformers 5 keeps ``_CAN_RECORD_REGISTRY``, a dict whose ``get(model)`` takes no
default, where a region's function reaches it (a Hugging Face model closed over):
the cache's check of the second call called ``get(key, default)`` and crashed.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import remat
from tests.helpers import RecomputeCounter, assert_recomputed


class _Registry(dict[str, Any]):
    def get(self, name: str) -> Any:  # type: ignore[override]  # transformers' signature
        return super().get(name) or {}


REGISTRY = _Registry(block={"hidden": 1})
W = torch.randn(8, 8, dtype=torch.float64)


def _block(x: torch.Tensor) -> torch.Tensor:
    assert REGISTRY.get("block")  # reached through the function's globals
    return torch.cos(torch.sin(remat.checkpoint_name(torch.tanh(x @ W), "hidden"))) @ W


@pytest.mark.parametrize("policy", ["nothing-saveable", "dots-saveable", "save:hidden"])
@pytest.mark.parametrize("engine", ["eager", "functional"])
def test_a_region_reaching_a_dict_subclass_runs_twice(engine: str, policy: str) -> None:
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    (want,) = torch.autograd.grad(_block(x).sum(), x)
    region = remat.remat(_block, policy=policy, engine=engine)
    for _ in range(2):  # the second call checks the first one's cached walk
        with RecomputeCounter() as counter:
            (got,) = torch.autograd.grad(region(x).sum(), x)
        torch.testing.assert_close(got, want)

    def everything() -> Any:
        with RecomputeCounter() as again:
            torch.autograd.grad(remat.remat(_block, engine=engine)(x).sum(), x)
        return again.counts

    assert_recomputed(policy, counter.counts, everything)
