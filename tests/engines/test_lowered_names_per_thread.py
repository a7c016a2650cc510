"""Whether `checkpoint_name` becomes the name op under torch.compile is per-thread state.

A lowered region whose policy reads names makes `checkpoint_name` add
``remat::checkpoint_name`` to the graph being traced (NOTE [ Names under
torch.compile ] rule 1). The flag saying so is ``lowering_names`` of the thread
state (`remat._state.ThreadState`), set by ``_engines/lowered.py`` around the
region: a trace on another thread meanwhile (a function without remat, or a
region whose policy reads no names) gets no name op, and the flag is down again
when the region ends, whatever it raised.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from helpers import OpCounter

from remat._engines.lowered import contexts_for, run_lowered
from remat._engines.lowered_names import traced_name
from remat._engines.region import Region
from remat._state import local
from remat.policies import resolve

NAME_OP = "checkpoint_name"  # the custom op's short name, as `OpCounter` counts it


def _name_ops(x: torch.Tensor) -> int:
    """How many name ops `checkpoint_name`'s traced form runs here and now."""
    with OpCounter() as counter:
        assert traced_name(x, "h") is x
    return counter.counts[NAME_OP]


def _region(policy: str) -> Region:
    resolved = resolve(policy)
    return Region(fn=torch.sin, policy=resolved, label="f", selective=contexts_for(resolved))


def _lowered(policy: str, inside: Any) -> Any:
    """Run a lowered region of ``policy`` on this thread; ``inside()`` runs within it.

    Outside a trace, torch's checkpoint runs the region's body eagerly, which
    hands it to remat's engine (NOTE [ Lowering under torch.compile ] rule 9):
    ``inside`` stands in for that engine.
    """
    x = torch.ones(3, requires_grad=True)
    return run_lowered(_region(policy), torch.sin, (x,), {}, lambda args, kwargs: inside())


def test_a_lowered_name_region_adds_the_name_op_on_its_own_thread_only() -> None:
    x = torch.ones(3)
    inside_a = threading.Event()
    b_done = threading.Event()
    seen: dict[str, int] = {}

    def on_b() -> None:
        inside_a.wait(timeout=30)
        seen["other thread"] = _name_ops(x)
        b_done.set()

    def in_region() -> torch.Tensor:
        seen["region's thread"] = _name_ops(x)
        inside_a.set()
        assert b_done.wait(timeout=30), "the other thread did not finish"
        return x

    other = threading.Thread(target=on_b)
    other.start()
    _lowered("save:h", in_region)
    other.join(timeout=30)
    assert seen == {"region's thread": 1, "other thread": 0}
    assert _name_ops(x) == 0 and local.lowering_names is False


def test_a_policy_that_reads_no_names_adds_no_name_op() -> None:
    x = torch.ones(3)
    seen: list[int] = []
    _lowered("dots-saveable", lambda: seen.append(_name_ops(x)) or x)
    assert seen == [0]


def test_the_flag_is_down_after_a_region_that_raised() -> None:
    def fails() -> None:
        assert local.lowering_names is True
        raise ValueError("inside the region")

    with pytest.raises(ValueError, match="inside the region"):
        _lowered("save:h", fails)
    assert local.lowering_names is False and local.lowering_depth == 0
    assert _name_ops(torch.ones(3)) == 0
