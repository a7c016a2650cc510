"""`remat.wrap`ed blocks under FSDP2 (``fully_shard``): two CPU processes over gloo.

Each configuration trains the same block stack for two steps, every rank on
its own data, and is compared with the same model trained in one process on
all the data, without FSDP and without remat: the gradients after each
backward and the parameters after each step, gathered whole.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from process_group import DISTRIBUTED, run_in_group
from torch import nn

import remat

pytestmark = DISTRIBUTED

WORLD = 2
TIMEOUT_S = 60  # a run takes ~8 s alone; a hung try is started again (process_group.run_in_group)
STEPS = 2
WIDTH = 16

#: (policy, order, reshard_after_forward, whether each block recomputes).
CONFIGS = [
    ("nothing-saveable", "wrap-then-shard", True, [1, 1, 1, 1]),
    ("dots-saveable", "wrap-then-shard", True, [1, 1, 1, 1]),
    ("save-last", "wrap-then-shard", True, [1, 1, 1, 0]),  # the last block keeps all
    ("everything-saveable", "wrap-then-shard", True, [0, 0, 0, 0]),
    ("nothing-saveable", "shard-then-wrap", False, [1, 1, 1, 1]),
    ("dots-saveable", "shard-then-wrap", False, [1, 1, 1, 1]),
]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, 2 * WIDTH)
        self.fc2 = nn.Linear(2 * WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.recomputes = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.recomputes += remat.is_recomputing()
        return self.norm(x + self.fc2(nn.functional.gelu(self.fc1(x))))


class Stage(nn.Module):
    """Two blocks in one region: FSDP units inside a region."""

    def __init__(self, a: nn.Module, b: nn.Module) -> None:
        super().__init__()
        self.a, self.b = a, b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))  # type: ignore[no-any-return]


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(4)], nn.Linear(WIDTH, 1))


def _data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(4, WIDTH, generator=generator), torch.randn(4, 1, generator=generator)


def _sharded(policy: str | None, order: str, reshard: bool, **options: Any) -> nn.Sequential:
    """The model, its blocks wrapped (``policy`` None: not) and sharded in ``order``."""
    from torch.distributed.fsdp import fully_shard

    model = _model()
    blocks = list(model)[:4] if policy is not None else []
    if order == "wrap-then-shard":
        for block in blocks:
            remat.wrap(block, policy=policy)
    for block in list(model)[:4]:
        fully_shard(block, reshard_after_forward=reshard, **options)
    fully_shard(model, reshard_after_forward=reshard, **options)
    if order == "shard-then-wrap":
        for block in blocks:
            remat.wrap(block, policy=policy)
    return model


def _whole(t: torch.Tensor) -> torch.Tensor:
    full = t.full_tensor() if hasattr(t, "full_tensor") else t
    return full.detach().clone()


def _train(model: nn.Module, rank: int | None) -> dict[str, Any]:
    """Two SGD steps; ``rank`` None: one process on every rank's data."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trace: dict[str, Any] = {"grads": [], "params": []}
    for step in range(STEPS):
        ranks = range(WORLD) if rank is None else (rank,)
        x, y = (torch.cat(parts) for parts in zip(*[_data(step, r) for r in ranks], strict=True))
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        trace["grads"].append([_whole(p.grad) for p in model.parameters()])
        optimizer.step()
        trace["params"].append([_whole(p) for p in model.parameters()])
    trace["recomputes"] = [block.recomputes for block in list(model)[:4]]
    return trace


def _stage_regions(policy: str) -> nn.Module:
    """Blocks sharded one by one, run two at a time by regions that contain them."""
    from torch.distributed.fsdp import fully_shard

    model = _model()
    blocks = list(model)[:4]
    for block in blocks:
        fully_shard(block)
    stages = [remat.wrap(Stage(blocks[0], blocks[1]), policy=policy),
              remat.wrap(Stage(blocks[2], blocks[3]), policy=policy)]
    return fully_shard(nn.Sequential(*stages, model[4]))  # type: ignore[no-any-return]


def _collect(rank: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for policy, order, reshard, _ in CONFIGS:
        results[f"{policy} {order} {reshard}"] = _train(_sharded(policy, order, reshard), rank)
    # Mixed precision: bf16 compute, against the same FSDP model without remat.
    from torch.distributed.fsdp import MixedPrecisionPolicy

    bf16 = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)}
    results["bf16"] = [
        _train(_sharded(policy, "wrap-then-shard", True, **bf16), rank)
        for policy in ("dots-saveable", None)
    ]
    x, y = _data(0, rank)
    stages = _stage_regions("nothing-saveable")  # records no ops: FSDP runs as usual
    nn.functional.mse_loss(stages(x), y).backward()
    results["stages nothing-saveable"] = [_whole(p.grad) for p in stages.parameters()]
    try:  # last: the error leaves this model's FSDP state mid-forward
        _stage_regions("dots-saveable")(x)
    except remat.RematError as error:
        results["stages dots-saveable"] = str(error)
    return results


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_in_group(_collect, WORLD, TIMEOUT_S)


@pytest.mark.parametrize(("policy", "order", "reshard", "recomputes"), CONFIGS)
def test_wrapped_blocks_train_as_one_process(
    results: list[dict[str, Any]], policy: str, order: str, reshard: bool, recomputes: list[int]
) -> None:
    expected = _train(_model(), rank=None)
    for rank, by_config in enumerate(results):
        trace = by_config[f"{policy} {order} {reshard}"]
        for kind in ("grads", "params"):
            for step, (got, want) in enumerate(zip(trace[kind], expected[kind], strict=True)):
                for i, (g, w) in enumerate(zip(got, want, strict=True)):
                    torch.testing.assert_close(
                        g, w, rtol=1e-5, atol=1e-5, msg=f"rank {rank}, step {step}, {kind} {i}"
                    )
        assert trace["recomputes"] == [STEPS * r for r in recomputes]


def test_mixed_precision_matches_fsdp_without_remat(results: list[dict[str, Any]]) -> None:
    for by_config in results:
        wrapped, plain = by_config["bf16"]
        assert wrapped["recomputes"] == [STEPS] * 4
        for kind in ("grads", "params"):
            for got, want in zip(wrapped[kind], plain[kind], strict=True):
                for g, w in zip(got, want, strict=True):
                    torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_fsdp_units_inside_a_region_without_op_trace(results: list[dict[str, Any]]) -> None:
    model = _model()
    x, y = _data(0, 0)
    x = torch.cat([x, _data(0, 1)[0]])
    y = torch.cat([y, _data(0, 1)[1]])
    nn.functional.mse_loss(model(x), y).backward()
    for by_config in results:
        got = by_config["stages nothing-saveable"]
        assert len(got) == len(list(model.parameters()))
        for g, p in zip(got, model.parameters(), strict=True):
            torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-5)


def test_fsdp_units_inside_a_region_that_records_ops_raise(
    results: list[dict[str, Any]],
) -> None:
    for by_config in results:
        message = by_config["stages dots-saveable"]
        assert "fully_shard (FSDP2) module inside it" in message
        assert "Stage.forward" in message and "region of its own" in message
