"""A statistic the forward writes in place under ``torch.no_grad()``, reached without
being passed (a tensor in a global dict, a plain tensor attribute), under the docs'
``if not remat.is_recomputing():`` recipe.

The third adversarial pass: the torch.func engine's recorded forward (op-tracing
policies under ``loss.backward()``) runs under ``torch.func.vjp``, where torch
refused the write as a "captured" tensor's (a torch error, no RematError). Such
tensors are now wrapped at the ``vjp``'s level, as module buffers were
(``functional/differentiated.py``): the statistic moves once, as without remat.

The eager engine's op-tracing policies still refuse the program, loudly: the
statistic's ops reach a tensor, not a Python number, so the replay cannot tell
them from ops the recompute needs (NOTE [ Ops the recompute may skip ]).
"""

from __future__ import annotations

import pytest
import torch
from helpers import RecomputeCounter
from torch import nn

import remat

D = torch.double
STATS = {"seen": torch.zeros(8, dtype=D)}
X = torch.linspace(-2, 2, 32, dtype=D).reshape(4, 8)


class Counting(nn.Module):
    def __init__(self, where: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8, dtype=D)
        self.where = where
        self.total = torch.zeros(8, dtype=D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if not remat.is_recomputing():
            with torch.no_grad():
                seen = STATS["seen"] if self.where == "global dict" else self.total
                seen.add_(h.mean(0))
        return torch.tanh(h)


def _step(where: str, wrap: object) -> tuple[torch.Tensor, torch.Tensor]:
    STATS["seen"] = torch.zeros(8, dtype=D)
    model = Counting(where)
    region = wrap(model)  # type: ignore[operator]
    region(X).pow(2).sum().backward()
    assert model.lin.weight.grad is not None
    seen = STATS["seen"] if where == "global dict" else model.total
    return model.lin.weight.grad, seen


WORKING = [("functional", "nothing-saveable"), ("functional", "dots-saveable"),
           ("functional", "save-last"), ("eager", "nothing-saveable"), ("eager", "save-last")]


@pytest.mark.parametrize(("engine", "policy"), WORKING)
@pytest.mark.parametrize("where", ["global dict", "attribute"])
def test_a_statistic_written_in_place_moves_once(where: str, policy: str, engine: str) -> None:
    want, want_seen = _step(where, lambda m: m)
    with RecomputeCounter() as counter:
        got, seen = _step(where, lambda m: remat.wrap(m, policy=policy, engine=engine))
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(seen, want_seen)  # once: the recompute skipped it
    if policy != "save-last":  # the only region is the latest: its compute kept
        assert counter.counts["tanh"] == 1, counter.counts


@pytest.mark.parametrize("where", ["global dict", "attribute"])
def test_the_eager_op_tracing_policies_refuse_it_loudly(where: str) -> None:
    with pytest.raises(remat.NondeterministicRecomputeError, match=r"\.item\(\)"):
        _step(where, lambda m: remat.wrap(m, policy="dots-saveable", engine="eager"))
