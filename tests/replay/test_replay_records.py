"""The op log's records own their invariants: every change of what they keep is a method."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from remat._policy.base import Decision
from remat._policy.strings import resolve
from remat._replay.modes import RecordMode, ReplayMode
from remat._replay.records import OpLog, OpRecord
from remat._replay.tags import OpTag, tag_of
from tests.helpers import OpCounter

PACKAGE = Path(__file__).resolve().parents[1] / "remat"

#: The record's state that only ``remat/_replay/`` may touch.
PRIVATE_FIELDS = {"_kept", "_kept_versions", "_named"}


def recorded(policy: str, fn: object, *xs: torch.Tensor) -> tuple[OpLog, torch.Tensor]:
    log = OpLog(resolve(policy), "f")
    with RecordMode(log):
        out = fn(*xs)  # type: ignore[operator]
    log.end_forward()
    return log, out


def mm_sin(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a @ b).sin()


def test_tags_are_named() -> None:
    a, b = torch.randn(3, 3), torch.randn(3, 3)
    log, out = recorded("dots-saveable", mm_sin, a, b)
    tag = tag_of(out)
    assert tag == OpTag(log.serial, 1, 0)
    assert (tag.log_serial, tag.op_index, tag.position) == (log.serial, 1, 0)
    assert log.lookup(out) == (log.records[1], 0)
    assert tag_of(a) is None


def test_kept_outputs_follow_the_policy_and_are_read_only() -> None:
    a, b = torch.randn(3, 3), torch.randn(3, 3)
    log, _ = recorded("dots-saveable", mm_sin, a, b)
    mm, sin = log.records
    assert mm.holds_outputs() and not sin.holds_outputs()
    kept = mm.kept
    assert kept is not None and len(kept) == 1
    torch.testing.assert_close(kept[0], a @ b)
    with pytest.raises(TypeError):
        kept[0] = None  # type: ignore[index]  # a copy: only methods change a record
    assert mm.fully_replayable()


def test_a_write_after_keeping_makes_the_output_unreplayable() -> None:
    def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        y = a @ b
        y.add_(1)  # through the kept output's storage
        return y.sin()

    log, _ = recorded("dots-saveable", fn, torch.randn(3, 3), torch.randn(3, 3))
    mm = log.records[0]
    assert mm.holds_outputs() and mm.written_after_kept(0)
    assert not mm.fully_replayable() and mm.replayable() is None
    assert list(mm.unwritten_outputs()) == []


def test_transitions() -> None:
    x = torch.randn(2)
    rec = OpRecord(torch.ops.aten.sin.default, None, Decision.SAVE, 0)
    rec.keep(0, x, 2)
    assert rec.kept_version(0) == x._version and rec.kept_at(1) is None
    assert [p for p, _ in rec.unwritten_outputs()] == [0]
    placeholder = torch.empty(0)
    rec.mark_offloaded(0, placeholder)
    assert rec.kept_at(0) is placeholder and not rec.version_moved(0, placeholder)
    fetched = x.clone()
    rec.restore(0, fetched)
    assert rec.kept_at(0) is fetched
    rec.drop(0)
    assert rec.holds_outputs() and rec.kept == (None, None)
    rec.release()
    assert not rec.holds_outputs() and rec.replay_state() == (None, False)


def test_names_recompute_and_demote() -> None:
    rec = OpRecord(torch.ops.aten.sin.default, None, Decision.SAVE, 0)
    rec.keep(0, torch.randn(2), 1)
    rec.name(0, "h", Decision.RECOMPUTE)
    assert rec.name_at(0) == "h" and rec.decision_at(0) is Decision.RECOMPUTE
    assert rec.kept_at(0) is None
    kept = OpRecord(torch.ops.aten.mm.default, "mm", Decision.SAVE, 0)
    kept.keep(0, torch.randn(2), 1)
    kept.demote(resolve("nothing-saveable"))
    assert not kept.holds_outputs()


@pytest.mark.parametrize("policy", ["dots-saveable", "everything-saveable"])
def test_replay_returns_the_kept_output_without_running_the_op(policy: str) -> None:
    a, b = torch.randn(3, 3), torch.randn(3, 3)
    log, out = recorded(policy, mm_sin, a, b)
    mm_out = log.records[0].kept
    assert mm_out is not None
    with OpCounter() as ran, ReplayMode(log) as replay:  # the counter sees what runs
        again = mm_sin(a, b)
    torch.testing.assert_close(again, out)
    assert replay.index == 2
    assert ran.counts["mm"] == 0
    assert ran.counts["sin"] == (0 if policy == "everything-saveable" else 1)


def _private_uses(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in PRIVATE_FIELDS:
            found.append(f"{path.name}:{node.lineno} .{node.attr}")
    return found


def test_no_record_state_is_touched_outside_replay() -> None:
    outside = [p for p in PACKAGE.rglob("*.py") if "_replay" not in p.parts]
    uses = [use for path in outside for use in _private_uses(path)]
    assert not uses, "record state changed outside remat/_replay/: " + ", ".join(uses)


def test_the_scan_sees_a_private_write(tmp_path: Path) -> None:
    source = tmp_path / "engine.py"
    source.write_text("def f(record):\n    record._kept[0] = None\n")
    assert _private_uses(source) == ["engine.py:2 ._kept"]
