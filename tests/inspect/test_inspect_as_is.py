"""`saved_residuals(fn)` with no policy inspects ``fn`` as it is, and inspecting changes nothing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat import Residual, measure_memory, residual_totals, saved_residuals
from remat.policies import Decision

POLICIES = ("nothing-saveable", "dots-saveable", "everything-saveable", "save-last",
            "save:hidden", "everything-except:hidden")


def kept(residuals: list[Residual]) -> int:
    totals = residual_totals(residuals)
    return totals["saved"] + totals["offloaded"]


W1, W2 = torch.randn(16, 32, requires_grad=True), torch.randn(32, 16, requires_grad=True)


def mlp(x: torch.Tensor) -> torch.Tensor:
    hidden = remat.checkpoint_name(torch.tanh(x @ W1), "hidden")
    return (torch.sin(hidden @ W2)).sum()


class Block(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = remat.checkpoint_name(F.gelu(self.fc1(x)), "hidden")
        return x + self.fc2(hidden)


def stack(n: int = 3) -> nn.Sequential:
    return nn.Sequential(*[Block() for _ in range(n)])


@pytest.mark.parametrize("policy", POLICIES)
def test_a_decorated_function_reports_what_its_region_keeps(policy: str) -> None:
    x = torch.randn(8, 16)
    as_is = saved_residuals(remat.remat(mlp, policy=policy), x)
    one_region = saved_residuals(mlp, x, policy=policy)
    assert residual_totals(as_is) == residual_totals(one_region)
    # Exact: what stays alive after the forward is what backward holds, plus the 4-byte loss.
    assert kept(as_is) == measure_memory(remat.remat(mlp, policy=policy), x).held_bytes - 4


def test_the_jax_idiom_shows_the_inner_policy(capsys: pytest.CaptureFixture[str]) -> None:
    x = torch.randn(8, 16)
    remat.print_saved_residuals(remat.remat(mlp, policy="dots-saveable"), x)
    footer = capsys.readouterr().out.splitlines()[-1]
    # x @ W1 (8x32) and hidden @ W2 (8x16), float32: the inner policy's choice, not 0 B.
    assert "1.5 KiB kept by the policy (saved 1.5 KiB in 2 tensors" in footer, footer
    assert kept(saved_residuals(remat.remat(mlp, policy="nothing-saveable"), x)) == 0


def test_a_plain_function_reports_what_plain_autograd_saves() -> None:
    x = torch.randn(8, 16)
    held = saved_residuals(mlp, x)
    assert kept(held) == measure_memory(mlp, x).held_bytes - 4
    assert kept(held) == kept(saved_residuals(mlp, x, policy="everything-saveable"))
    ops = {r.op for r in held if r.decision is Decision.SAVE}
    assert ops == {torch.ops.aten.mm.default, torch.ops.aten.tanh.default}


@pytest.mark.parametrize("policy", ["nothing-saveable", "dots-saveable", "save:hidden",
                                    "everything-saveable"])
def test_an_applied_model_reports_what_its_blocks_keep(policy: str) -> None:
    model, x = stack(), torch.randn(8, 16)

    def loss(x: torch.Tensor) -> torch.Tensor:
        return model(x).sum()

    plain = kept(saved_residuals(loss, x))
    remat.apply(model, policy=policy, where=Block)
    held = saved_residuals(loss, x)
    assert kept(held) == measure_memory(loss, x).held_bytes - 4
    if policy == "everything-saveable":
        assert kept(held) == plain
    else:
        assert kept(held) < plain
    if policy == "nothing-saveable":  # only the block boundaries: two (8, 16) inputs
        saved = [r for r in held if r.decision is Decision.SAVE]
        assert [r.shape for r in saved] == [(8, 16), (8, 16)]
        assert all("an input of Block.forward" in r.source for r in saved)
    if policy == "save:hidden":  # the boundaries and each block's named (8, 64) value
        assert sorted(r.nbytes for r in held if r.decision is Decision.SAVE) == [512] * 2 + [
            2048
        ] * 3


def test_save_last_keeps_only_the_last_block_whole() -> None:
    model, x = stack(), torch.randn(8, 16)
    remat.apply(model, policy="save-last", where=Block)
    held = saved_residuals(model, x)
    everything = saved_residuals(remat.unwrap(model), x)
    assert 0 < kept(held) < kept(everything)
    assert kept(held) == measure_memory(lambda x: remat.apply(
        model, policy="save-last", where=Block)(x).sum(), x).held_bytes - 4


def test_inspection_leaves_a_pending_save_last_region_alone() -> None:
    x = torch.randn(8, 16, requires_grad=True)
    region = remat.remat(mlp, policy="save-last")
    loss = region(x)
    saved_residuals(remat.remat(mlp, policy="save-last"), x)  # would demote `loss`'s region
    with remat.testing.ComputeOpCounter() as counter:
        torch.autograd.grad(loss, x)
    without = remat.remat(mlp, policy="save-last")(x)
    with remat.testing.ComputeOpCounter() as reference:
        torch.autograd.grad(without, x)
    assert counter.count == reference.count  # nothing recomputed: still the last region


# -- no state changed ----------------------------------------------------------


class Stateful(nn.Module):
    """Draws from the global and an explicit generator, updates BatchNorm and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.bn = nn.BatchNorm1d(16)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.generator = torch.Generator().manual_seed(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        noise = torch.randn(x.shape, generator=self.generator)
        return F.dropout(self.bn(self.fc(x + noise)), p=0.3, training=True).sum()


def snapshot(model: Stateful) -> tuple[torch.Tensor, ...]:
    return (torch.get_rng_state(), model.generator.get_state(),
            *(b.clone() for b in model.buffers()))


INSPECTIONS = {
    "as is": lambda m, x: saved_residuals(m, x),
    "policy": lambda m, x: saved_residuals(m, x, policy="dots-saveable"),
    "decorated": lambda m, x: saved_residuals(remat.remat(m, policy="save-last"), x),
    "applied": lambda m, x: saved_residuals(remat.apply(m, where=nn.BatchNorm1d), x),
    "compare": lambda m, x: remat.compare(m, x, policies="dots-saveable", repeats=2),
    "compare where": lambda m, x: remat.compare(m, x, policies="nothing-saveable",
                                                where=nn.Linear, repeats=2),
}


@pytest.mark.parametrize("how", list(INSPECTIONS))
def test_inspection_changes_no_generator_and_no_buffer(
    how: str, capsys: pytest.CaptureFixture[str]
) -> None:
    model, x = Stateful().train(), torch.randn(8, 16)
    model(x)  # the buffers hold something other than their initial values
    before = snapshot(model)
    buffers = [id(b) for b in model.buffers()]
    INSPECTIONS[how](model, x)
    after = snapshot(model)
    assert len(before) == len(after) == 6
    for a, b in zip(before, after, strict=True):
        assert torch.equal(a, b)
    assert [id(b) for b in model.buffers()] == buffers
    # And the model then trains as if never inspected.
    twin = Stateful().train()
    twin.load_state_dict(model.state_dict())
    twin.generator.set_state(model.generator.get_state())
    torch.manual_seed(11)
    expected = twin(x)
    torch.manual_seed(11)
    torch.testing.assert_close(remat.unwrap(model)(x), expected)


def test_a_rebound_buffer_gets_its_tensor_back() -> None:
    class Counter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("count", torch.zeros(()))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.count = self.count + 1  # a new tensor in the buffer slot
            return (x * 2).sum()

    model = Counter()
    original = model.count
    saved_residuals(model, torch.randn(3, requires_grad=True))
    assert model.count is original and float(model.count) == 0.0


def test_compare_leaves_the_gradients_as_they_were() -> None:
    model, x = stack(2), torch.randn(8, 16)
    model(x).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    remat.policy_costs(model, x, policies=["nothing-saveable"], repeats=1)
    for p, g in zip(model.parameters(), grads, strict=True):
        torch.testing.assert_close(p.grad, g)


# -- keywords --------------------------------------------------------------------


def scaled(x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
    return (torch.sin(x) * scale).sum()


@pytest.mark.parametrize("api", ["saved_residuals", "print_saved_residuals", "compare",
                                 "policy_costs"])
def test_a_misspelled_keyword_raises_naming_the_inspection_function(api: str) -> None:
    function = getattr(remat, api)
    option = "policy" if "residuals" in api else "policies"
    x = torch.randn(4, requires_grad=True)
    with pytest.raises(TypeError) as info:
        function(scaled, x, polcy="dots-saveable")
    message = str(info.value)
    assert message.startswith(f"remat.{api}() got an unexpected keyword argument 'polcy'")
    assert "scaled has no parameter 'polcy'" in message
    assert f"Did you mean {option}=...?" in message
    # The fix works, and fn's own keywords still reach it.
    function(scaled, x, **{option: "dots-saveable"}, scale=2.0, **_quick(api))


def _quick(api: str) -> dict[str, int]:
    return {"repeats": 1} if api in ("compare", "policy_costs") else {}


def test_a_function_taking_any_keyword_gets_it() -> None:
    def loose(x: torch.Tensor, **options: float) -> torch.Tensor:
        return (x * x * options["gain"]).sum()

    held = saved_residuals(loose, torch.randn(3, requires_grad=True), gain=2.0)
    assert [r.source for r in held] == ["argument x"]


def test_a_function_running_torch_func_raises_with_what_to_inspect_instead() -> None:
    x = torch.randn(8, 16)

    def per_example(x: torch.Tensor) -> torch.Tensor:
        return torch.func.vmap(torch.func.grad(mlp))(x).sum()

    with pytest.raises(remat.RematError, match="Inspect the function the transform differentiates"):
        saved_residuals(per_example, x)
    forced = remat.remat(mlp, policy="dots-saveable", engine="functional")
    # The region's own refusal (``_engines/torch_func_refusal.py``): it names the
    # region and the engines that work.
    with pytest.raises(remat.RematError, match=r"mlp \(.*engine='auto' \(the default\)"):
        saved_residuals(forced, x)
    # The fix: the differentiated function, or the region on its default engine.
    assert kept(saved_residuals(remat.remat(mlp, policy="dots-saveable"), x)) == 1536
