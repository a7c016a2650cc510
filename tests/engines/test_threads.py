"""Another thread never sees remat's work: nothing process-global is swapped.

The torch.func engine once wrote its views of the closed-over tensors into
their slots (closure cells, ``fn.__globals__``, ``module._parameters``) while
``fn`` ran, so a thread training plainly on the same global weight read the
engine's view and got a missing or wrong ``W.grad``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.func import grad

import remat
from remat._capture import module_state as _module_state

D = torch.float64
W = torch.randn(8, 8, dtype=D, requires_grad=True)  # read by both threads
X = torch.randn(4, 8, dtype=D)
STEPS = 300


def _plain_loss(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ W).pow(2).sum()


def _region_body(x: torch.Tensor) -> torch.Tensor:
    h = remat.checkpoint_name(torch.tanh(x @ W), "h")
    return (h @ W).sin().sum()


def _alongside(main: Callable[[], None], other: Callable[[int], None]) -> list[BaseException]:
    """Run ``other(step)`` STEPS times on a thread while ``main()`` loops here."""
    errors: list[BaseException] = []
    done = threading.Event()

    def worker() -> None:
        try:
            for step in range(STEPS):
                other(step)
        except BaseException as e:  # reported by the test, not swallowed
            errors.append(e)
        finally:
            done.set()

    thread = threading.Thread(target=worker, daemon=True)
    deadline = time.monotonic() + 20
    thread.start()
    while not done.is_set() and time.monotonic() < deadline:
        main()
    thread.join(timeout=5)
    assert done.is_set(), "the plain thread did not finish in time"
    return errors


@pytest.mark.parametrize("policy", ["nothing-saveable", "dots-saveable", "save-last", "save:h"])
def test_plain_thread_training_on_a_global_the_region_reads(policy: str) -> None:
    expected_w = torch.autograd.grad(_plain_loss(X), W)[0]
    region = remat.remat(_region_body, policy=policy)
    x_main = torch.randn(5, 8, dtype=D)
    expected_x = grad(_region_body)(x_main)
    wrong: list[int] = []

    def main() -> None:
        torch.testing.assert_close(grad(region)(x_main), expected_x, rtol=0, atol=0)

    def other(step: int) -> None:
        W.grad = None
        _plain_loss(X).backward()
        if W.grad is None or not torch.equal(W.grad, expected_w):
            wrong.append(step)

    errors = _alongside(main, other)
    W.grad = None
    assert not errors, errors
    assert wrong == [], f"{len(wrong)} of {STEPS} plain steps got a wrong W.grad"


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8, dtype=D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


@pytest.mark.parametrize("policy", ["nothing-saveable", "dots-saveable"])
def test_eager_regions_leave_another_threads_modules_alone(
    policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The eager engine watches modules through a global forward pre-hook: it must
    # report only the calling thread's modules to that thread's guards.
    seen: list[tuple[int, int]] = []
    original = _module_state.StateGuard.saw

    def saw(self: Any, module: nn.Module) -> None:
        seen.append((threading.get_ident(), id(module)))
        original(self, module)

    monkeypatch.setattr(_module_state.StateGuard, "saw", saw)
    torch.manual_seed(0)
    mine, theirs = Block(), Block()
    region = remat.remat(lambda x: mine(x).sum(), policy=policy, engine="eager")
    x_theirs = torch.randn(4, 8, dtype=D)
    expected = torch.autograd.grad(theirs(x_theirs).pow(2).sum(), list(theirs.parameters()))
    wrong: list[int] = []

    def main() -> None:
        region(X).backward()

    def other(step: int) -> None:
        got = torch.autograd.grad(theirs(x_theirs).pow(2).sum(), list(theirs.parameters()))
        if not all(torch.equal(g, e) for g, e in zip(got, expected, strict=True)):
            wrong.append(step)

    main_thread = threading.get_ident()
    errors = _alongside(main, other)
    assert not errors, errors
    assert wrong == []
    assert seen, "the guard saw no module at all: the test does not exercise the hook"
    assert all(ident == main_thread for ident, _ in seen)
    assert id(theirs) not in {m for _, m in seen}
