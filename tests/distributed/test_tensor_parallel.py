"""`remat.wrap`ed blocks under tensor parallelism (DTensor): two CPU processes over gloo.

An attention block and an MLP block are parallelized with ``ColwiseParallel``
/ ``RowwiseParallel`` over both processes, wrapped, and trained one step on
the same data on every rank. Each configuration is compared with the same
model in one process without parallelism or remat (gradients gathered whole),
and the ops backward runs are counted at the DTensor level, the level remat's
modes see (`_tag_inner` in ``remat/_replay/log.py``): ``dots-saveable`` runs no
matmul again. Also: FSDP2 over a 1 x 2 mesh composed with tensor
parallelism, and torch's own refusal of ``torch.func`` over DTensor layers
(a `RematError` naming the cure with remat, `_engines/torch_func_refusal.py`).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import OpCounter
from process_group import DISTRIBUTED, run_in_group
from torch import nn

import remat

pytestmark = DISTRIBUTED

WORLD = 2
TIMEOUT_S = 180  # ~15 s alone, ~85 s on 2 shared cores under load; a hung try is started again
WIDTH, HEADS = 16, 2
POLICIES = (None, "nothing-saveable", "dots-saveable", "save-last")
#: Matmul-like ops, as DTensor runs them (3-D inputs fold to 2-D ``addmm``).
DOTS = ("addmm", "mm", "_scaled_dot_product_flash_attention_for_cpu")
#: The forward matmuls a recompute of both blocks runs: q, k, v, fc1 and the attention;
#: it stops before each block's last linear (``out``, ``fc2``), whose output nothing saves.
RECOMPUTED_DOTS = {"addmm": 4, "mm": 0, "_scaled_dot_product_flash_attention_for_cpu": 1}


class Attention(nn.Module):
    """Causal attention with separate q/k/v projections (column-parallel, heads split)."""

    def __init__(self) -> None:
        super().__init__()
        self.head_dim = WIDTH // HEADS
        self.q, self.k, self.v, self.out = (nn.Linear(WIDTH, WIDTH) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # ``-1`` heads: each rank holds its share of them.
        q, k, v = (
            m(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
            for m in (self.q, self.k, self.v)
        )
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(attn.transpose(1, 2).reshape(batch, seq, -1))  # type: ignore[no-any-return]


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, 4 * WIDTH)
        self.fc2 = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))  # type: ignore[no-any-return]


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Attention(), MLP())


def _data() -> torch.Tensor:
    return torch.randn(2, 5, WIDTH, generator=torch.Generator().manual_seed(1))


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()  # type: ignore[no-any-return]


def _parallel(mesh: Any) -> nn.Sequential:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model = _model()
    columns = {name: ColwiseParallel() for name in ("q", "k", "v")}
    parallelize_module(model[0], mesh, {**columns, "out": RowwiseParallel()})
    parallelize_module(model[1], mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    return model


def _whole(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.full_tensor().detach().clone() for name, p in model.named_parameters()}


def _step(model: nn.Module, policy: str | None) -> dict[str, Any]:
    if policy is not None:
        for block in model:
            remat.wrap(block, policy=policy)
    loss = _loss(model, _data())
    with OpCounter() as counter:
        loss.backward()
    return {"grads": _whole(model), "backward": {op: counter.counts[op] for op in DOTS}}


def _torch_func_error(model: nn.Module) -> str:
    params = dict(model.named_parameters())
    x = _data()
    try:
        torch.func.grad(lambda p: torch.func.functional_call(model, p, (x,)).pow(2).mean())(params)
    except RuntimeError as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def _functional_engine_error(mesh: Any) -> str:
    """``loss.backward()`` through blocks forced onto the torch.func engine."""
    model = _parallel(mesh)
    for block in model:
        remat.wrap(block, policy="dots-saveable", engine="functional")
    try:
        _loss(model, _data()).backward()
    except remat.RematError as error:
        return str(error)
    return "no error"


def _two_d(policy: str) -> dict[str, torch.Tensor]:
    """FSDP2 over the mesh's ``dp`` dimension (size 1) on top of tensor parallelism."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("dp", "tp"))
    model = _parallel(mesh["tp"])
    for block in model:
        remat.wrap(block, policy=policy)
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    _loss(model, _data()).backward()
    return _whole(model)


def _collect(rank: int) -> dict[Any, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,))
    results: dict[Any, Any] = {policy: _step(_parallel(mesh), policy) for policy in POLICIES}
    for policy in ("nothing-saveable", "dots-saveable"):
        results["2-D", policy] = _two_d(policy)
    results["torch.func", None] = _torch_func_error(_parallel(mesh))
    wrapped = _parallel(mesh)
    for block in wrapped:
        remat.wrap(block, policy="dots-saveable")
    results["torch.func", "dots-saveable"] = _torch_func_error(wrapped)
    results["functional engine"] = _functional_engine_error(mesh)
    return results


@pytest.fixture(scope="module")
def results() -> list[dict[Any, Any]]:
    return run_in_group(_collect, WORLD, TIMEOUT_S)


def _expected() -> dict[str, torch.Tensor]:
    model = _model()
    _loss(model, _data()).backward()
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def _assert_grads(got: dict[str, torch.Tensor], where: str) -> None:
    want = _expected()
    assert got.keys() == want.keys()
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-6, msg=f"{where}, {name}")


@pytest.mark.parametrize("policy", POLICIES)
def test_tensor_parallel_blocks_match_one_process(
    results: list[dict[Any, Any]], policy: str | None
) -> None:
    for rank, by_config in enumerate(results):
        _assert_grads(by_config[policy]["grads"], f"rank {rank}")


def test_dots_saveable_recomputes_no_matmul_of_dtensor(results: list[dict[Any, Any]]) -> None:
    for by_config in results:
        plain = by_config[None]["backward"]
        assert plain["addmm"] == 0  # backward's own matmuls are ``mm``
        assert by_config["dots-saveable"]["backward"] == plain
        again = {op: by_config["nothing-saveable"]["backward"][op] - plain[op] for op in DOTS}
        assert again == RECOMPUTED_DOTS
        # save-last: the attention block is recomputed (q, k, v), the MLP block (last) kept.
        again = {op: by_config["save-last"]["backward"][op] - plain[op] for op in DOTS}
        assert again == {**RECOMPUTED_DOTS, "addmm": 3}


@pytest.mark.parametrize("policy", ["nothing-saveable", "dots-saveable"])
def test_fsdp2_with_tensor_parallel_matches_one_process(
    results: list[dict[Any, Any]], policy: str
) -> None:
    for rank, by_config in enumerate(results):
        _assert_grads(by_config["2-D", policy], f"rank {rank}")


def test_torch_func_over_dtensor_layers_is_refused_by_torch_with_or_without_remat(
    results: list[dict[Any, Any]],
) -> None:
    """DTensor's ``from_local``/``to_local`` Functions have no ``setup_context`` (torch 2.13).

    With remat the refusal is a `RematError` naming the region and the cure,
    ``loss.backward()``, which `test_tensor_parallel_blocks_match_one_process` runs.
    """
    for by_config in results:
        plain, wrapped = by_config["torch.func", None], by_config["torch.func", "dots-saveable"]
        assert plain.startswith("RuntimeError: ")
        assert "it must override the setup_context staticmethod" in plain
        assert wrapped.startswith("RematError: remat: Attention.forward (")
        assert "torch refuses this function under torch.func with or without remat" in wrapped
        assert "Differentiate it with loss.backward()" in wrapped


def test_the_torch_func_engine_forced_on_dtensor_layers_names_the_default_engine(
    results: list[dict[Any, Any]],
) -> None:
    """The cure, ``engine='auto'`` (the default), is what the other tests run."""
    for by_config in results:
        message = by_config["functional engine"]
        assert message.startswith("remat: Attention.forward (")
        assert "autograd.Function without setup_context" in message
        assert "Use engine='auto' (the default) or engine='eager' for this region" in message
