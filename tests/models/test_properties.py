"""Property tests: random small programs x random policies, remat vs no remat."""

from __future__ import annotations

from collections.abc import Callable

import torch
from helpers import STEPS, assert_close_or_unused, step_program
from hypothesis import example, given, settings
from hypothesis import strategies as st

import remat

POLICY_STRINGS = [
    "nothing-saveable",
    "everything-saveable",
    "dots-saveable",
    "dots-no-batch-saveable",
    "save:a",
    "save:a,b",
    "save-except:a",
    "everything-except:b",
    "save-last",
    "save-last+dots-saveable",
    "offload-dots",
    "offload:a+dots-saveable",
]


programs = st.lists(st.sampled_from(sorted(STEPS)), min_size=1, max_size=7)


@settings(deadline=None, max_examples=60)
@given(
    steps=programs,
    policy=st.sampled_from(POLICY_STRINGS),
    blocks=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_random_programs_match_reference(
    steps: list[str], policy: str, blocks: int, seed: int
) -> None:
    body = step_program(steps)
    block = remat.remat(body, policy=policy)
    torch.manual_seed(seed)
    x = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)

    def stack(f: Callable[..., torch.Tensor]) -> tuple[torch.Tensor | None, ...]:
        torch.manual_seed(seed)
        h = x
        for _ in range(blocks):
            h = f(h, w)
        return torch.autograd.grad((h * h).sum(), (x, w), allow_unused=True)

    assert_close_or_unused(stack(block), stack(body))


@settings(deadline=None, max_examples=25)
# Found by this test: a dead op whose output fed an inner region (which recomputes
# from its own inputs later) was replaced by a stand-in in the outer recompute.
@example(outer=["bmm"], inner=["name_a", "bmm"], outer_policy="save:a",
         inner_policy="nothing-saveable")
# ...and one whose inner region kept (as a saved dot) a stand-in the outer replay gave it.
@example(outer=["bmm"], inner=["bmm", "name_a", "bmm"], outer_policy="save:a",
         inner_policy="dots-saveable")
@given(
    outer=st.lists(st.sampled_from(sorted(STEPS)), min_size=1, max_size=3),
    inner=programs,
    outer_policy=st.sampled_from(POLICY_STRINGS),
    inner_policy=st.sampled_from(POLICY_STRINGS),
)
def test_random_nested_programs_match_reference(
    outer: list[str], inner: list[str], outer_policy: str, inner_policy: str
) -> None:
    inner_fn = step_program(inner)
    outer_fn = step_program(outer)
    wrapped_inner = remat.remat(inner_fn, policy=inner_policy)

    def plain(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return outer_fn(inner_fn(outer_fn(h, w), w), w)

    def nested(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return outer_fn(wrapped_inner(outer_fn(h, w), w), w)

    x = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)

    def grads_of(f: Callable[..., torch.Tensor]) -> tuple[torch.Tensor | None, ...]:
        torch.manual_seed(0)
        return torch.autograd.grad(f(x, w).sum(), (x, w), allow_unused=True)

    assert_close_or_unused(grads_of(remat.remat(nested, policy=outer_policy)), grads_of(plain))


@settings(deadline=None, max_examples=20)
@given(steps=programs, policy=st.sampled_from(POLICY_STRINGS))
def test_random_programs_double_backward(steps: list[str], policy: str) -> None:
    steps = [s for s in steps if s != "relu_inplace"] or ["tanh"]
    body = step_program(steps)
    x = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)

    def second(f: Callable[..., torch.Tensor]) -> tuple[torch.Tensor | None, ...]:
        torch.manual_seed(0)
        gx, gw = torch.autograd.grad(
            f(x, w).sum(), (x, w), create_graph=True, allow_unused=True, materialize_grads=True
        )
        total = (gx * gx).sum() + (gw * gw).sum()
        if not total.requires_grad:
            return (None, None)
        return torch.autograd.grad(total, (x, w), allow_unused=True)

    assert_close_or_unused(second(remat.remat(body, policy=policy)), second(body))


#: Policies that lower under torch.compile, and two that stay graph breaks.
COMPILED_POLICIES = [
    "nothing-saveable",
    "dots-saveable",
    "dots-no-batch-saveable",
    "everything-saveable",
    "nothing-saveable+dots-saveable",
    "save:a",
    "save:a,b",
    "save-except:a",
    "everything-except:b",
    "dots-saveable+save:b",
    "save-last",
    "offload:a+dots-saveable",
]


@settings(deadline=None, max_examples=12)
@given(
    steps=programs,
    policy=st.sampled_from(COMPILED_POLICIES),
    backend=st.sampled_from(["aot_eager", "eager"]),
    blocks=st.integers(1, 2),
)
def test_random_programs_under_torch_compile(
    steps: list[str], policy: str, backend: str, blocks: int
) -> None:
    body = step_program(steps)
    block = remat.remat(body, policy=policy)
    x = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)

    def compiled(f: Callable[..., torch.Tensor]) -> tuple[torch.Tensor | None, ...]:
        def loss(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            h = x
            for _ in range(blocks):
                h = f(h, w)
            return (h * h).sum()

        torch._dynamo.reset()
        torch.manual_seed(0)  # the same dropout masks in both programs
        out = torch.compile(loss, backend=backend)(x, w)
        return torch.autograd.grad(out, (x, w), allow_unused=True)

    assert_close_or_unused(compiled(block), compiled(body))
