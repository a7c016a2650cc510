"""`remat.wrap`ed blocks under DistributedDataParallel: two CPU processes over gloo."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import run_workers
from torch import nn

from remat import apply, sequential

pytestmark = pytest.mark.distributed

WORLD = 2
TIMEOUT_S = 60  # a run takes ~8 s alone; a hung try is started again (helpers.run_workers)


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


def _worker(rank: int, port: int, out_dir: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    try:
        x, y = _data()
        shard = slice(rank * 4, (rank + 1) * 4)
        results = {}
        for name, model in _variants().items():
            ddp = nn.parallel.DistributedDataParallel(model)
            for _ in range(2):  # a second step catches "marked ready twice" on reuse
                ddp.zero_grad()
                nn.functional.mse_loss(ddp(x[shard]), y[shard]).backward()
            results[name] = [p.grad for p in model.parameters()]
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(),
    reason="torch.distributed with gloo is not available",
)
def test_ddp_wrapped_blocks_match_single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # stay on 127.0.0.1
    model = _model()
    x, y = _data()
    nn.functional.mse_loss(model(x), y).backward()
    expected = [p.grad for p in model.parameters()]
    # Every rank holds the all-reduced gradient.
    for rank, results in enumerate(run_workers(_worker, WORLD, TIMEOUT_S)):
        assert results.keys() == {"apply", "sequential"}
        for name, grads in results.items():
            assert len(grads) == len(expected)
            for i, (got, want) in enumerate(zip(grads, expected, strict=True)):
                torch.testing.assert_close(got, want, msg=f"rank {rank}, {name}, parameter {i}")
