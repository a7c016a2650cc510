"""Two-process tests over gloo: the marks, and running a function in a process group.

The distributed tests import it as ``process_group`` (pytest puts their folder on
``sys.path``).
"""

from __future__ import annotations

import pathlib
import socket
import tempfile
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["DISTRIBUTED", "run_in_group"]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: The marks of a test of two processes over gloo (``pytest -m distributed`` runs them).
DISTRIBUTED = [
    pytest.mark.distributed,
    pytest.mark.skipif(
        not dist.is_available() or not dist.is_gloo_available(),
        reason="torch.distributed with gloo is not available",
    ),
]


def run_in_group(
    collect: Callable[[int], Any], world: int, timeout_s: float, attempts: int = 2
) -> list[Any]:
    """Run ``collect(rank)`` in ``world`` spawned processes of one gloo group; return its results.

    The processes join a process group on ``127.0.0.1`` (``GLOO_SOCKET_IFNAME=lo``),
    each saves what ``collect`` returns, and the results come back by rank.
    ``collect`` is a module-level function (spawned processes import it by name).
    Fails the test when the processes are not done within ``timeout_s`` (a
    collective hang) on each of ``attempts`` tries. About one run in six of the
    two-process gloo group hangs here with or without remat (measured on the code
    before and after remat's torch.func changes: 1 of 5 and 1 of 6 runs), so a
    hung try is killed and the group started again on a fresh port. A worker
    killed by a signal is started again the same way: one fresh-clone CI run saw
    a worker of the FSDP group die of SIGSEGV, and three runs of the same tests
    right after passed. A crash that remat causes comes back on the next try and
    fails the test; a Python exception in a worker fails it at once.
    """
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GLOO_SOCKET_IFNAME", "lo")  # read by the spawned processes
        for attempt in range(attempts):
            with tempfile.TemporaryDirectory() as out_dir:
                if _workers_finished(collect, world, timeout_s, out_dir):
                    return [torch.load(pathlib.Path(out_dir) / f"rank{r}.pt") for r in range(world)]
            if attempt + 1 == attempts:
                pytest.fail(
                    f"the workers did not finish within {timeout_s} s, or one was killed "
                    f"by a signal, {attempts} times"
                )
    raise AssertionError("unreachable")


def _in_group(
    rank: int, collect: Callable[[int], Any], world: int, port: int, out_dir: str
) -> None:
    """One spawned process of `run_in_group`: join the group, collect, save, leave."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        torch.save(collect(rank), pathlib.Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _workers_finished(
    collect: Callable[[int], Any], world: int, timeout_s: float, out_dir: str
) -> bool:
    context = mp.start_processes(
        _in_group, args=(collect, world, _free_port(), out_dir), nprocs=world, join=False,
        start_method="spawn",
    )
    try:
        # ``join`` returns False as soon as one worker ends while another runs.
        deadline = time.monotonic() + timeout_s
        while not context.join(timeout=max(deadline - time.monotonic(), 0.1)):
            if time.monotonic() > deadline:
                return False
        return True
    except mp.ProcessExitedException as crash:
        if crash.signal_name is None:  # exited with a status: not the group's crash
            raise
        return False  # killed by a signal (SIGSEGV in gloo): try again, as for a hang
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
