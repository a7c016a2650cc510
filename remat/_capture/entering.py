"""A guard's generator entered as remat's own work, without `contextlib`'s machinery.

``entered_internally(contextmanager(gen)())`` (``_state.py``) costs three generator
context managers per entry: four Python calls each, twice per region call
(forward and recompute). `InternallyEntered` runs the same generator protocol
in one object: the body before the ``yield`` on entry, the rest (or the
exception, thrown in) on exit, each as remat's own work (``with INTERNAL:``).
"""

from __future__ import annotations

from collections.abc import Generator
from types import TracebackType

from .._state import INTERNAL

__all__ = ["InternallyEntered"]


class InternallyEntered:
    """Enter a one-``yield`` generator as a context manager, its steps as remat's work.

    The generator must not suppress an exception thrown into it (the state
    guard's do not): it runs its ``finally`` blocks and lets it propagate.

    Examples:
        >>> def steps():
        ...     print("before")
        ...     try:
        ...         yield
        ...     finally:
        ...         print("after")
        >>> with InternallyEntered(steps()):
        ...     print("body")
        before
        body
        after
    """

    __slots__ = ("_steps",)

    def __init__(self, steps: Generator[None, None, None]) -> None:
        self._steps = steps

    def __enter__(self) -> None:
        with INTERNAL:
            next(self._steps)

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        with INTERNAL:
            if error is None:
                for _ in self._steps:  # runs to its end
                    raise RuntimeError("this is a bug in remat, please report it")
                return
            try:
                self._steps.throw(error)
            except BaseException as raised:
                # (A StopIteration thrown in comes back as a RuntimeError: PEP 479.)
                if raised is not error and not (
                    isinstance(error, StopIteration) and raised.__cause__ is error
                ):
                    raise
                # The body's exception goes on, as it would without the guard, with
                # its own traceback: the one through the generator's frames (and
                # this one) would make a cycle keeping the body's frames, and the
                # tensors they hold, alive until a garbage collection (as
                # `contextlib` does it).
                error.__traceback__ = traceback
                return
            raise RuntimeError("this is a bug in remat, please report it")  # suppressed
