"""`InternallyEntered`: a guard's generator entered as remat's own work, as
``entered_internally(contextmanager(gen)())`` entered it."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Generator

import pytest
import torch

from remat._capture.entering import InternallyEntered
from remat._state import local


def _steps(log: list[str]) -> Generator[None, None, None]:
    log.append(f"enter internal={local.internal_depth}")
    try:
        yield
    except ValueError:
        log.append("saw ValueError")
        raise
    finally:
        log.append(f"exit internal={local.internal_depth}")


def test_steps_run_as_remat_work_and_the_body_does_not() -> None:
    log: list[str] = []
    depth = local.internal_depth
    with InternallyEntered(_steps(log)):
        log.append(f"body internal={local.internal_depth}")
    assert log == [f"enter internal={depth + 1}", f"body internal={depth}",
                   f"exit internal={depth + 1}"]
    assert local.internal_depth == depth


@pytest.mark.parametrize("error", [ValueError("v"), KeyError("k"), StopIteration()])
def test_the_body_exception_propagates_after_the_generator_cleans_up(
    error: BaseException,
) -> None:
    log: list[str] = []
    with pytest.raises(type(error)) as raised, InternallyEntered(_steps(log)):
        raise error
    assert raised.value is error
    assert log[-1].startswith("exit")
    assert ("saw ValueError" in log) == isinstance(error, ValueError)
    assert local.internal_depth == 0


def test_an_exception_of_the_generator_replaces_the_body_one() -> None:
    def refusing() -> Generator[None, None, None]:
        try:
            yield
        finally:
            raise RuntimeError("the guard's own check")

    with pytest.raises(RuntimeError, match="the guard's own check"), InternallyEntered(
        refusing()
    ):
        raise ValueError("body")
    with pytest.raises(RuntimeError, match="the guard's own check"), InternallyEntered(
        refusing()
    ):
        pass


def test_an_exception_entering_propagates() -> None:
    def failing() -> Generator[None, None, None]:
        raise RuntimeError("refused before the recompute")
        yield

    with pytest.raises(RuntimeError, match="refused before"), InternallyEntered(failing()):
        pytest.fail("the body must not run")
    assert local.internal_depth == 0


def test_a_handled_exception_keeps_the_body_frames_tensors_without_a_collection() -> None:
    # A stopped recompute ends in an exception through the guard: its frames' tensors
    # must go when it is handled, not at the next garbage collection.
    ref: list[weakref.ref[torch.Tensor]] = []

    def body() -> None:
        activation = torch.ones(1024)
        ref.append(weakref.ref(activation))
        raise ValueError("stop")

    def handled() -> type[BaseException] | None:
        try:
            with InternallyEntered(_steps([])):
                body()
        except ValueError as error:
            return type(error)
        return None

    gc.disable()
    try:
        assert handled() is ValueError
        assert ref[0]() is None
    finally:
        gc.enable()
