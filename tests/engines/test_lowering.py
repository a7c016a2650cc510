"""Regions lowered into compiled graphs: ``torch.utils.checkpoint`` with a selective policy.

Each test compares the compiled program with the same program without remat,
and looks at the compiled backward graph to see that the policy's choices
became the partitioner's: what is recomputed there, and what is not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import assert_close_all, compile_inputs, two_blocks
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func

import remat
from remat import policies
from remat._demo_model import Stack, make_input

pytestmark = [
    pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated"),
]

MM = "aten.mm.default"


def block(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return torch.sin(torch.tanh(x @ w1) @ w2) + x


def random_block(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    h = torch.nn.functional.dropout(torch.tanh(x @ w1), 0.3, training=True)
    return torch.sin(h @ w2) + x


class Graphs:
    """A backend that compiles like ``aot_eager`` and keeps the graphs it saw."""

    def __init__(self) -> None:
        self.dynamo: list[torch.fx.GraphModule] = []
        self.forward: list[torch.fx.GraphModule] = []
        self.backward: list[torch.fx.GraphModule] = []
        self._aot = aot_autograd(
            fw_compiler=self._keeping(self.forward), bw_compiler=self._keeping(self.backward)
        )

    @staticmethod
    def _keeping(graphs: list[torch.fx.GraphModule]) -> Callable[..., Any]:
        def compiler(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
            graphs.append(gm)
            return make_boxed_func(gm)  # run as traced, as aot_eager does

        return compiler

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        self.dynamo.append(gm)
        return self._aot(gm, example_inputs)

    def count(self, graphs: list[torch.fx.GraphModule], target: str) -> int:
        return sum(str(node.target) == target for gm in graphs for node in gm.graph.nodes)


def compiled_grads(
    fn: Callable[..., torch.Tensor], backend: Any, seed: int = 1, fullgraph: bool = True
) -> tuple[torch.Tensor, ...]:
    torch._dynamo.reset()
    inputs = compile_inputs()
    torch.manual_seed(seed)
    compiled = torch.compile(fn, backend=backend, fullgraph=fullgraph)
    return torch.autograd.grad(compiled(*inputs), inputs)


#: Policies that lower, and the forward matmuls (of 4) each recomputes in backward.
LOWERED = [
    ("nothing-saveable", 4),
    ("dots-saveable", 0),
    ("dots-no-batch-saveable", 0),  # 2-D matmuls have no batch dimensions
    ("everything-saveable", 0),
    (policies.save_these_ops(torch.ops.aten.mm), 0),
    # tanh's output is kept: only the matmul feeding sin is recomputed, once a block.
    (policies.save_these_ops(torch.ops.aten.tanh), 2),
    (policies.save_from_both_policies(policies.nothing_saveable, policies.dots_saveable), 0),
]


@pytest.mark.parametrize(("policy", "recomputed"), LOWERED, ids=lambda p: str(p))
def test_lowered_regions_compile_whole_and_recompute_what_the_policy_drops(
    policy: Any, recomputed: int
) -> None:
    expected = compiled_grads(two_blocks(block), "eager")
    plain = Graphs()
    compiled_grads(two_blocks(block), plain)
    graphs = Graphs()
    rematerialized = two_blocks(remat.remat(block, policy=policy))
    actual = compiled_grads(rematerialized, graphs)  # fullgraph: no graph break
    assert_close_all(actual, expected)
    assert len(graphs.dynamo) == 1
    # The backward graph holds the 8 gradient matmuls and the recomputed ones.
    assert plain.count(plain.backward, MM) == 8
    assert graphs.count(graphs.backward, MM) == 8 + recomputed


@pytest.mark.parametrize("policy", ["nothing-saveable", "dots-saveable"])
def test_a_region_dynamo_cannot_trace_whole_runs_in_the_eager_engine(policy: str) -> None:
    # Dynamo refuses side effects inside a checkpoint and runs the checkpoint
    # call eagerly: remat's engine takes the call over (it sets is_recomputing).
    runs: list[bool] = []

    def counted(*args: torch.Tensor) -> torch.Tensor:
        runs.append(remat.is_recomputing())
        return random_block(*args)

    expected = compiled_grads(two_blocks(random_block), "aot_eager", fullgraph=False)
    region = remat.remat(counted, policy=policy)
    actual = compiled_grads(two_blocks(region), "aot_eager", fullgraph=False)
    assert_close_all(actual, expected)
    assert sorted(runs) == [False, False, True, True]


class CountingNorm(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.norm = torch.nn.BatchNorm1d(8)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1  # a side effect: Dynamo cannot trace the region whole
        return torch.relu(self.norm(self.linear(x)))


def test_running_statistics_update_once_when_dynamo_gives_up() -> None:
    # Torch's own checkpoint, run eagerly, would recompute the compiled
    # BatchNorm frame and update the running statistics a second time.
    torch.manual_seed(0)
    reference, net = CountingNorm(), CountingNorm()
    net.load_state_dict(reference.state_dict())
    x = torch.randn(16, 8)
    remat.wrap(net, policy="dots-saveable")
    grads = []
    for module in (reference, net):
        torch._dynamo.reset()
        out = torch.compile(module, backend="aot_eager")(x)
        grads.append(torch.autograd.grad(out.square().sum(), list(module.parameters())))
    assert_close_all(grads[1], grads[0])
    assert int(net.norm.num_batches_tracked) == 1
    torch.testing.assert_close(net.norm.running_mean, reference.norm.running_mean)


def test_eager_backend_allows_a_second_backward_and_writes_to_kept_outputs() -> None:
    # backend="eager" runs torch's eager selective checkpoint, which hands a
    # kept output to one backward only and refuses one written in place later.
    @remat.remat(policy="dots-saveable")
    def region(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x @ w

    def residual(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = region(x, w)
        h += x  # written in place after the region kept it
        return torch.tanh(h).sum()

    x, w = compile_inputs()[1:3]
    expected = torch.autograd.grad(torch.tanh(x @ w + x).sum(), [x, w])
    torch._dynamo.reset()
    loss = torch.compile(residual, backend="eager", fullgraph=True)(x, w)
    for _ in range(2):  # a second backward through the same graph
        assert_close_all(torch.autograd.grad(loss, [x, w], retain_graph=True), expected)


def test_buffer_updates_under_the_eager_backend_raise() -> None:
    # backend="eager" runs the traced checkpoint with torch's eager selective
    # checkpoint, which replays BatchNorm's in-place update: torch raises.
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    remat.wrap(net, policy="dots-saveable")
    torch._dynamo.reset()
    out = torch.compile(net, backend="eager", fullgraph=True)(torch.randn(16, 8))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.square().sum().backward()


@pytest.mark.parametrize("backend", ["aot_eager", "eager"])
@pytest.mark.parametrize("policy", ["nothing-saveable", "dots-saveable"])
def test_dropout_masks_are_replayed(backend: str, policy: str) -> None:
    # backend="eager" runs the checkpoint with preserve_rng_state=False: without
    # remat's own snapshot the recompute draws new masks (wrong by ~300 here).
    expected = compiled_grads(two_blocks(random_block), backend)
    actual = compiled_grads(two_blocks(remat.remat(random_block, policy=policy)), backend)
    assert_close_all(actual, expected)


def test_wrapped_modules_compile_whole() -> None:
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8), torch.nn.Tanh()
    )
    x = torch.randn(4, 8)
    expected = torch.autograd.grad(net(x).square().sum(), list(net.parameters()))
    remat.apply(net, where=torch.nn.Linear, policy="dots-saveable")
    torch._dynamo.reset()
    compiled = torch.compile(net, backend="aot_eager", fullgraph=True)
    actual = torch.autograd.grad(compiled(x).square().sum(), list(net.parameters()))
    assert_close_all(actual, expected)


def test_sequential_segments_lower() -> None:
    # `sequential` builds its regions when called (a graph break: no fullgraph),
    # then each segment's call lowers.
    torch.manual_seed(0)
    layers = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
                                   for _ in range(4)])
    x = torch.randn(4, 8)
    expected = torch.autograd.grad(layers(x).square().sum(), list(layers.parameters()))
    graphs = Graphs()
    torch._dynamo.reset()
    run = lambda x: remat.sequential(layers, x, segments=2, policy="nothing-saveable")  # noqa: E731
    out = torch.compile(run, backend=graphs)(x)
    assert_close_all(torch.autograd.grad(out.square().sum(), list(layers.parameters())), expected)
    assert graphs.count(graphs.dynamo, "tag_activation_checkpoint") == 2
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported):  # building regions is a graph break
        torch.compile(run, backend="aot_eager", fullgraph=True)(x)


def test_a_lowered_region_inside_your_own_checkpoint() -> None:
    # remat's count of lowered regions is a side effect torch's checkpoint
    # refuses inside its body: Dynamo runs that checkpoint eagerly. Values hold.
    region = remat.remat(block, policy="dots-saveable")

    def outer(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(region, x, w1, w2, use_reentrant=False)

    expected = compiled_grads(two_blocks(block), "eager", fullgraph=False)
    assert_close_all(compiled_grads(two_blocks(outer), "aot_eager", fullgraph=False), expected)


def test_names_inside_a_lowered_region_are_inert() -> None:
    # A dots policy ignores names; `checkpoint_name` must not break the graph.
    def named(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        h = remat.checkpoint_name(torch.tanh(x @ w1), "hidden")
        return torch.sin(h @ w2) + x

    expected = compiled_grads(two_blocks(block), "eager")
    graphs = Graphs()
    actual = compiled_grads(two_blocks(remat.remat(named, policy="dots-saveable")), graphs)
    assert_close_all(actual, expected)
    assert graphs.count(graphs.dynamo, "tag_activation_checkpoint") == 2


def test_keyword_arguments_reach_the_function() -> None:
    # ``debug`` is also a keyword of torch.utils.checkpoint: it must reach ``f``.
    @remat.remat(policy="dots-saveable")
    def f(x: torch.Tensor, w: torch.Tensor, debug: float = 1.0) -> torch.Tensor:
        return torch.tanh(x @ w) * debug

    x, w = compile_inputs()[:2]
    expected = torch.autograd.grad((torch.tanh(x @ w) * 3.0).sum(), [x, w])
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, w: f(x, w, debug=3.0).sum(), backend="aot_eager",
                             fullgraph=True)
    assert_close_all(torch.autograd.grad(compiled(x, w), [x, w]), expected)


@pytest.mark.parametrize("inner", ["save-last", "save:hidden", "offload-dots", "dots-saveable"])
def test_inside_a_lowered_region_the_outer_policy_decides(inner: str) -> None:
    # Inner regions run plainly, lowerable or not: one checkpoint per outer call,
    # and the outer "nothing-saveable" recomputes the inner dots too.
    inner_region = remat.remat(block, policy=inner)
    outer = remat.remat(lambda x, w1, w2: inner_region(x, w1, w2).cos(), policy="nothing-saveable")
    expected = compiled_grads(two_blocks(lambda *a: block(*a).cos()), "eager")
    graphs = Graphs()
    assert_close_all(compiled_grads(two_blocks(outer), graphs), expected)
    checkpoints = graphs.count(graphs.dynamo, "tag_activation_checkpoint")
    assert checkpoints == 2
    assert graphs.count(graphs.backward, MM) == 8 + 4


@pytest.mark.parametrize("policy", ["offload:hidden", "save-last", "offload-dots"])
def test_other_policies_stay_graph_breaks(policy: str) -> None:
    region = remat.remat(block, policy=policy)
    compiled = torch.compile(two_blocks(region), backend="aot_eager", fullgraph=True)
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported):
        compiled(*compile_inputs())


def test_explicit_engines_stay_graph_breaks() -> None:
    region = remat.remat(block, policy="dots-saveable", engine="eager")
    compiled = torch.compile(two_blocks(region), backend="aot_eager", fullgraph=True)
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported):
        compiled(*compile_inputs())


def test_torch_func_under_compile_uses_the_functional_engine() -> None:
    region = remat.remat(block, policy="dots-saveable")
    x, w1, w2 = compile_inputs()[:3]
    expected = torch.func.grad(lambda w: block(x, w, w2).sum())(w1)
    torch._dynamo.reset()
    compiled = torch.compile(torch.func.grad(lambda w: region(x, w, w2).sum()),
                             backend="aot_eager")
    torch.testing.assert_close(compiled(w1), expected)


def test_memory_budget_with_multi_output_ops() -> None:
    # torch 2.13 crashes on MUST_SAVE of a multi-output op (attention's output
    # and log-sum-exp) under a memory budget: those are PREFER_SAVE. (A lone
    # attention call does not crash; two GPT blocks do.)
    model = Stack(depth=2, width=16, heads=2)
    x = make_input(model, batch=2, seq=8)
    params = list(model.parameters())
    expected = torch.autograd.grad(model.loss(x), params)
    model.loss(x, "dots-saveable")  # build the regions before Dynamo traces
    torch._dynamo.reset()
    with torch._functorch.config.patch(activation_memory_budget=0.5):
        compiled = torch.compile(lambda x: model.loss(x, "dots-saveable"), backend="aot_eager",
                                 fullgraph=True)
        assert_close_all(torch.autograd.grad(compiled(x), params), expected)
