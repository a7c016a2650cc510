"""Name policies lowered into compiled graphs (NOTE [ Names under torch.compile ]).

Each test compiles two named blocks whole (``fullgraph=True``) and compares the
compiled graphs with remat's eager engine on the same program: the gradients,
the matmuls the backward recomputes, and the bytes held for backward (the
compiled forward graph's saved outputs against the eager engine's live bytes
after the forward, exact on CPU).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import OpCounter, assert_close_all, compile_inputs, two_blocks
from test_lowering import MM, Graphs, compiled_grads

import remat
from remat import policies
from remat._inspect.memory import MemoryMeter

pytestmark = [
    pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated"),
]

NAME_OP = "remat.checkpoint_name.default"
#: One (6, 4) float32 activation of `two_blocks`.
ACTIVATION = 6 * 4 * 4


def block(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return torch.sin(torch.tanh(x @ w1) @ w2) + x


def named(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    h = remat.checkpoint_name(torch.tanh(x @ w1), "hidden")
    return torch.sin(h @ w2) + x


def name_ops(graphs: list[torch.fx.GraphModule]) -> int:
    """Name op calls in ``graphs`` and their subgraphs (a checkpoint's body)."""
    return sum(
        str(node.target) == NAME_OP
        for gm in graphs
        for sub in gm.modules()
        if isinstance(sub, torch.fx.GraphModule)
        for node in sub.graph.nodes
    )


def saved_bytes(graphs: Graphs) -> int:
    """Bytes the compiled forward graph saves for backward, inputs excluded."""
    total = 0
    for gm in graphs.forward:
        placeholders = {node for node in gm.graph.nodes if node.op == "placeholder"}
        (output,) = [node for node in gm.graph.nodes if node.op == "output"]
        for node in output.args[0][1:]:  # after the loss
            value = node.meta.get("val")
            if node not in placeholders and isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
    return total


def eager_engine(policy: Any) -> tuple[tuple[torch.Tensor, ...], int, int]:
    """Gradients, live bytes after the forward (the loss excluded) and backward matmuls."""
    inputs = compile_inputs()
    fn = two_blocks(remat.remat(named, policy=policy, engine="eager"))
    with MemoryMeter() as meter:
        loss = fn(*inputs)
        held = meter.current - loss.untyped_storage().nbytes()
        with OpCounter() as ops:
            grads = torch.autograd.grad(loss, inputs)
    return grads, held, ops.counts["mm"]


#: Name policies that lower, and the forward matmuls (of 4) each recomputes.
NAMED = [
    ("save:hidden", 2),  # tanh's output kept: only the matmul feeding sin is recomputed
    ("save-except:hidden", 4),  # the only named value is not saved: nothing is
    ("save-except:other", 2),
    ("everything-except:hidden", 0),  # tanh recomputed from its kept input
    ("save:other", 4),
    (policies.dots_saveable + "save:hidden", 0),
]


@pytest.mark.parametrize(("policy", "recomputed"), NAMED, ids=lambda p: str(p))
def test_name_policies_lower_and_save_what_the_eager_engine_saves(
    policy: Any, recomputed: int
) -> None:
    expected = compiled_grads(two_blocks(block), "eager")
    graphs = Graphs()
    actual = compiled_grads(two_blocks(remat.remat(named, policy=policy)), graphs)
    assert_close_all(actual, expected)
    assert len(graphs.dynamo) == 1  # and fullgraph: no graph break
    assert graphs.count(graphs.dynamo, "tag_activation_checkpoint") == 2
    assert name_ops(graphs.dynamo) == 2
    # The name op never runs: no node for it in AOTAutograd's graphs.
    assert name_ops(graphs.forward + graphs.backward) == 0
    eager_grads, eager_held, eager_mm = eager_engine(policy)
    assert_close_all(eager_grads, expected)
    assert graphs.count(graphs.backward, MM) == eager_mm == 8 + recomputed
    assert saved_bytes(graphs) == eager_held


def test_the_named_value_is_what_is_saved() -> None:
    # save:hidden keeps tanh's outputs themselves, not a copy or a view of them.
    graphs = Graphs()
    compiled_grads(two_blocks(remat.remat(named, policy="save:hidden")), graphs)
    (forward,) = graphs.forward
    (output,) = [node for node in forward.graph.nodes if node.op == "output"]
    kept = [str(node.target) for node in output.args[0][1:] if node.op != "placeholder"]
    assert kept.count("aten.tanh.default") == 2
    # Region inputs (cos, the doubled hidden state) and exp's output, as without names.
    assert sorted(kept) == sorted(
        ["aten.cos.default", "aten.mul.Tensor", "aten.detach.default"]
        + ["aten.tanh.default"] * 2
    )
    assert saved_bytes(graphs) == 5 * ACTIVATION


@pytest.mark.parametrize("engine_name", ["eager", "functional"])
def test_lowered_names_match_both_engines(engine_name: str) -> None:
    inputs = compile_inputs()
    region = remat.remat(named, policy="save:hidden",
                         engine="eager" if engine_name == "eager" else "auto")
    fn = two_blocks(region)
    if engine_name == "eager":
        expected = torch.autograd.grad(fn(*inputs), inputs)
    else:
        expected = torch.func.grad(fn, argnums=tuple(range(len(inputs))))(*inputs)
    lowered = two_blocks(remat.remat(named, policy="save:hidden"))
    assert_close_all(compiled_grads(lowered, "aot_eager"), expected)


def test_a_write_to_a_named_value_raises_as_without_remat() -> None:
    # `checkpoint_name` returns tanh's output itself: writing it in place bumps
    # the version tanh's backward checks, with and without remat.
    def written(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        h = remat.checkpoint_name(torch.tanh(x @ w1), "hidden")
        h.mul_(2)
        return torch.sin(h @ w2) + x

    for fn in (written, remat.remat(written, policy="save:hidden")):
        torch._dynamo.reset()
        compiled = torch.compile(two_blocks(fn), backend="aot_eager")
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            inputs = compile_inputs()
            torch.autograd.grad(compiled(*inputs), inputs)


@pytest.mark.parametrize("policy", ["save:hidden", "everything-except:hidden"])
def test_a_write_to_a_named_value_backward_does_not_read(policy: str) -> None:
    # A matmul's backward does not read its output: writing it is allowed.
    def written(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        h = remat.checkpoint_name(x @ w1, "hidden")
        h.relu_()
        return torch.sin(h @ w2) + x

    expected = compiled_grads(two_blocks(written), "eager", fullgraph=False)
    graphs = Graphs()
    actual = compiled_grads(two_blocks(remat.remat(written, policy=policy)), graphs)
    assert_close_all(actual, expected)
    assert name_ops(graphs.dynamo) == 2


def test_names_are_inert_unless_the_policy_reads_them() -> None:
    graphs = Graphs()
    actual = compiled_grads(two_blocks(remat.remat(named, policy="dots-saveable")), graphs)
    assert_close_all(actual, compiled_grads(two_blocks(block), "eager"))
    assert name_ops(graphs.dynamo) == 0
    torch._dynamo.reset()
    outside = torch.compile(lambda x: remat.checkpoint_name(x.sin(), "hidden").cos(),
                            backend=graphs, fullgraph=True)
    torch.testing.assert_close(outside(torch.ones(3)), torch.ones(3).sin().cos())
    assert name_ops(graphs.dynamo) == 0


@pytest.mark.parametrize("policy", ["save:hidden", "everything-except:hidden"])
def test_name_policies_under_the_eager_backend(policy: str) -> None:
    # backend="eager" runs torch's eager selective checkpoint: every op recomputed,
    # the name op answered by remat's modes in the forward and in the recompute.
    expected = compiled_grads(two_blocks(block), "eager")
    actual = compiled_grads(two_blocks(remat.remat(named, policy=policy)), "eager")
    assert_close_all(actual, expected)


class Custom(policies.Policy):
    """A policy remat does not know: it must not lower unless it says so."""

    def decide_op(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return policies.Decision.RECOMPUTE

    def decide(self, verdict: Any, name: str | None) -> policies.Decision:
        return policies.Decision.RECOMPUTE

    uses_ops = True


def test_each_policy_answers_whether_it_lowers() -> None:
    lowering = {
        "nothing-saveable": True, "everything-saveable": True, "dots-saveable": True,
        "dots-no-batch-saveable": True, "save:a": True, "save-except:a": True,
        "everything-except:a": True, "save-last": False, "offload-dots": False,
        "offload:a": False, "dots-saveable+save:a": True, "dots-saveable+offload:a": False,
    }
    assert {p: policies.resolve(p).lowers for p in lowering} == lowering
    assert policies.save_these_ops(torch.ops.aten.mm).lowers
    assert not policies.from_callable(lambda op, *a, **k: True).lowers
    assert not Custom().lowers
    region = remat.remat(block, policy=Custom())
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported):
        torch.compile(two_blocks(region), backend="aot_eager", fullgraph=True)(*compile_inputs())
    # Without fullgraph it runs in the eager engine, right.
    actual = compiled_grads(two_blocks(region), "aot_eager", fullgraph=False)
    assert_close_all(actual, compiled_grads(two_blocks(block), "eager"))
