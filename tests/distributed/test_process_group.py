"""`run_in_group` starts the group again when a worker is killed by a signal, once."""

from __future__ import annotations

import os
import pathlib
import signal

import pytest
from process_group import DISTRIBUTED, run_in_group

pytestmark = DISTRIBUTED

def _crash_once(rank: int) -> int:
    marker = pathlib.Path(os.environ["REMAT_CRASH_MARKER"])
    if rank == 1 and not marker.exists():
        marker.touch()
        os.kill(os.getpid(), signal.SIGSEGV)  # as gloo's worker died once in CI
    return rank * 10


def _always_crash(rank: int) -> int:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSEGV)
    return rank


def test_a_worker_killed_by_a_signal_is_started_again(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REMAT_CRASH_MARKER", str(tmp_path / "crashed"))
    assert run_in_group(_crash_once, 2, timeout_s=60) == [0, 10]
    assert (tmp_path / "crashed").exists()  # the first try did crash


def test_a_crash_on_every_try_fails() -> None:
    with pytest.raises(pytest.fail.Exception, match="killed by a signal, 2 times"):
        run_in_group(_always_crash, 2, timeout_s=60)
