"""`remat.wrap`ed blocks under DistributedDataParallel: two CPU processes over gloo."""

from __future__ import annotations

import torch
from process_group import DISTRIBUTED, run_in_group
from torch import nn

from remat import apply, sequential

pytestmark = DISTRIBUTED

WORLD = 2
TIMEOUT_S = 60  # a run takes ~8 s alone; a hung try is started again (process_group.run_in_group)


class SequentialNet(nn.Module):
    """Its forward runs its layers through `sequential`: every segment a region."""

    def __init__(self, layers: nn.Module) -> None:
        super().__init__()
        self.layers = layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sequential(self.layers, x, segments=2)  # type: ignore[no-any-return]


def _model() -> nn.Module:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)]
    return nn.Sequential(*blocks, nn.Linear(8, 1))


def _variants() -> dict[str, nn.Module]:
    wrapped = apply(_model(), where=lambda name, m: name in ("1", "2"))
    apply(wrapped, where=lambda name, m: name == "0", policy="save-last")
    return {"apply": wrapped, "sequential": SequentialNet(_model())}


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(8, 8, generator=generator), torch.randn(8, 1, generator=generator)


def _collect(rank: int) -> dict[str, list[torch.Tensor | None]]:
    x, y = _data()
    shard = slice(rank * 4, (rank + 1) * 4)
    results = {}
    for name, model in _variants().items():
        ddp = nn.parallel.DistributedDataParallel(model)
        for _ in range(2):  # a second step catches "marked ready twice" on reuse
            ddp.zero_grad()
            nn.functional.mse_loss(ddp(x[shard]), y[shard]).backward()
        results[name] = [p.grad for p in model.parameters()]
    return results


def test_ddp_wrapped_blocks_match_single_process() -> None:
    model = _model()
    x, y = _data()
    nn.functional.mse_loss(model(x), y).backward()
    expected = [p.grad for p in model.parameters()]
    # Every rank holds the all-reduced gradient.
    for rank, results in enumerate(run_in_group(_collect, WORLD, TIMEOUT_S)):
        assert results.keys() == {"apply", "sequential"}
        for name, grads in results.items():
            assert len(grads) == len(expected)
            for i, (got, want) in enumerate(zip(grads, expected, strict=True)):
                torch.testing.assert_close(got, want, msg=f"rank {rank}, {name}, parameter {i}")
