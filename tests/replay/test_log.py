"""The replay core (``remat._replay``): op log, record, replay, liveness, stand-ins.

Unit tests through `OpLog`, `OpRecord`, `RecordMode` and `ReplayMode` (NOTE
[ Record and replay ]), below every engine: a region's forward is recorded into a
log, then replayed, and what ran is counted. Then the end-to-end cases where a
dead op's stand-in could leak into what Python reads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import Fn, OpCounter, RecomputeCounter, w44, x3

import remat
from remat._policy.base import Decision
from remat._policy.strings import resolve
from remat._replay.modes import RecordMode, ReplayMode
from remat._replay.records import OpLog
from remat._replay.tags import tag_of

aten = torch.ops.aten


def _record(policy: str, fn: Callable[..., Any], *args: Any) -> tuple[OpLog, Any]:
    """Record ``fn(*args)`` as one region's forward under ``policy``."""
    inputs = [a for a in args if isinstance(a, torch.Tensor)]  # the region's inputs
    log = OpLog(resolve(policy), "test region", inputs)
    with RecordMode(log):
        out = fn(*args)
    log.end_forward()
    return log, out


def _replay(log: OpLog, fn: Callable[..., Any], *args: Any, **mode: Any) -> tuple[Any, OpCounter]:
    """Run ``fn(*args)`` under `ReplayMode`; the counter below it sees the ops that ran."""
    with OpCounter() as ran, ReplayMode(log, **mode):
        out = fn(*args)
    return out, ran


def _mlp(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w).sin()


def _xw() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(3, 4), torch.randn(4, 5)


# -- record --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "kept"),
    [
        ("nothing-saveable", []),
        ("dots-saveable", ["mm"]),
        ("everything-saveable", ["mm", "tanh", "sin"]),
    ],
)
def test_record_logs_every_op_and_keeps_what_the_policy_saves(policy: str, kept: list[str]) -> None:
    log, _ = _record(policy, _mlp, *_xw())
    assert [rec.op for rec in log.records] == [aten.mm.default, aten.tanh.default, aten.sin.default]
    assert [rec.index for rec in log.records] == [0, 1, 2]
    saved = [rec.op.overloadpacket.__name__ for rec in log.records if rec.kept is not None]
    assert saved == kept
    for rec in log.records:
        assert (rec.decision is Decision.SAVE) == (rec.kept is not None)


def test_outputs_are_tagged_and_looked_up_by_log_op_and_position() -> None:
    x, w = _xw()
    log, out = _record("nothing-saveable", lambda x, w: torch.max(x @ w, dim=1), x, w)
    values, indices = out
    assert tag_of(values) == (log.serial, 1, 0)
    assert tag_of(indices) == (log.serial, 1, 1)
    assert log.lookup(indices) == (log.records[1], 1)
    other, out2 = _record("nothing-saveable", _mlp, x, w)
    assert other.serial != log.serial and log.lookup(out2) is None  # another region's
    assert log.lookup(x) is None  # an input: produced by no op of the log


def test_record_links_each_op_to_the_ops_that_produced_its_inputs() -> None:
    log, _ = _record("nothing-saveable", lambda x, w: (x @ w).tanh() * x.exp().sum(), *_xw())
    by_name = {rec.op.overloadpacket.__name__: rec for rec in log.records}
    assert by_name["mm"].inputs == () and by_name["exp"].inputs == ()  # region inputs
    assert by_name["tanh"].inputs == (by_name["mm"].index,)
    assert by_name["mul"].inputs == (by_name["tanh"].index, by_name["sum"].index)


def test_random_and_inplace_ops_are_never_kept() -> None:
    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = x @ w
        h.mul_(2)  # in place: its output is its input
        return h * torch.rand_like(h)  # random: skipping it would shift the stream

    log, _ = _record("everything-saveable", fn, *_xw())
    by_name = {rec.op.overloadpacket.__name__: rec for rec in log.records}
    for name in ("mul_", "rand_like"):
        rec = by_name[name]
        assert rec.decision is Decision.RECOMPUTE and rec.kept is None and rec.always_live, name
    assert by_name["mm"].kept is not None


def test_a_name_keeps_a_value_the_op_policy_would_not() -> None:
    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ w)
        log.name(h, "hidden")
        return h.sin()

    for policy, keeps in (("save:hidden", True), ("nothing-saveable", False)):
        log = OpLog(resolve(policy), "test region")
        x, w = _xw()
        with RecordMode(log):
            fn(x, w)
        log.end_forward()
        tanh = log.records[1]
        assert tanh.named == {0: ("hidden", Decision.SAVE if keeps else Decision.RECOMPUTE)}
        assert (tanh.kept is not None) == keeps
        assert tanh.decision_at(0) is (Decision.SAVE if keeps else Decision.RECOMPUTE)


def test_multi_output_ops_are_kept_only_until_the_forward_ends_unless_named() -> None:
    # Under a policy that uses names, a multi-output op keeps its outputs in case
    # `checkpoint_name` saves one of them (its siblings must be kept with it).
    def fn(name: bool) -> Callable[..., Any]:
        def run(x: torch.Tensor, w: torch.Tensor) -> Any:
            values, _ = torch.max(x @ w, dim=1)
            if name:
                log.name(values, "hidden")
            return values

        return run

    for named in (False, True):
        log = OpLog(resolve("save:hidden"), "test region")
        x, w = _xw()
        with RecordMode(log):
            fn(named)(x, w)
            assert log.records[1].kept is not None  # tentative, both outputs
        log.end_forward()
        rec = log.records[1]
        assert not rec.tentative
        assert (rec.kept is not None) == named


# -- replay --------------------------------------------------------------------------


def test_replay_returns_kept_outputs_instead_of_running_their_ops() -> None:
    x, w = _xw()
    log, expected = _record("dots-saveable", _mlp, x, w)
    # Other values of the same shapes: a replayed op returns the forward's output.
    got, ran = _replay(log, _mlp, x, torch.zeros_like(w))
    torch.testing.assert_close(got, expected)
    assert "mm" not in ran.counts and ran.counts["tanh"] == 1 and ran.counts["sin"] == 1
    _, ran = _replay(_record("nothing-saveable", _mlp, x, w)[0], _mlp, x, w)
    assert ran.counts["mm"] == 1


def test_replay_rebuilds_tuple_and_list_outputs() -> None:
    def fn(x: torch.Tensor) -> Any:
        values, indices = torch.max(x, dim=1)  # a tuple of two
        first, *_ = x.unbind(0)  # a list
        return values, indices, first

    x = torch.randn(3, 4)
    log, expected = _record("everything-saveable", fn, x)
    got, ran = _replay(log, fn, x.cos())
    for a, e in zip(got, expected, strict=True):
        torch.testing.assert_close(a, e)
    assert "max" not in ran.counts


def test_replay_substitutes_the_kept_outputs_of_a_partly_kept_op() -> None:
    def fn(x: torch.Tensor) -> Any:
        values, indices = torch.max(x, dim=1)
        log.name(values, "hidden")
        return values, indices

    x = torch.randn(3, 4)
    log = OpLog(resolve("save:hidden"), "test region")
    with RecordMode(log):
        expected_values, _ = fn(x)
    log.end_forward()
    rec = log.records[0]
    assert rec.kept is not None
    rec.drop(1)  # as the engines drop a fetched offload copy: the op must run again
    y = torch.flip(x, dims=(1,))  # same shape, other argmax positions
    (values, indices), ran = _replay(log, fn, y)
    assert ran.counts["max"] == 1  # ran, since one output was not kept...
    torch.testing.assert_close(values, expected_values)  # ...the kept one substituted
    torch.testing.assert_close(indices, torch.max(y, dim=1).indices)  # the rest recomputed


def test_a_kept_output_written_in_place_since_is_recomputed() -> None:
    x, w = _xw()
    log, (h, _) = _record("dots-saveable", lambda x, w: (x @ w, torch.tanh(x @ w)), x, w)
    assert log.records[0].fully_replayable()
    h.mul_(2)  # after the forward: the version counter shows it
    assert log.records[0].replayable() is None
    _, ran = _replay(log, lambda x, w: (x @ w, torch.tanh(x @ w)), x, w)
    assert ran.counts["mm"] == 1  # the first mm ran again; the second was replayed


def test_a_write_through_an_alias_with_its_own_version_counter_is_seen() -> None:
    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = x @ w
        alias = aten._unsafe_view(h, (-1,))  # shares h's storage, not its version counter
        alias.add_(1)
        return h

    log, _ = _record("dots-saveable", fn, *_xw())
    assert log.records[0].replayable() is None  # found by storage address
    assert log.records[0].written_after_kept(0)


def test_a_different_op_in_the_recompute_raises_naming_the_region_and_the_op() -> None:
    x, w = _xw()
    log, _ = _record("dots-saveable", _mlp, x, w)
    with pytest.raises(remat.NondeterministicRecomputeError) as info:
        _replay(log, lambda x, w: torch.cos(x @ w).sin(), x, w)
    message = str(info.value)
    assert "the recompute of test region differs from its forward at op #1" in message
    assert "the forward ran aten.tanh.default, the recompute ran aten.cos.default" in message


def test_other_python_numbers_raise_unless_the_check_is_off() -> None:
    x = torch.randn(3)
    log, _ = _record("nothing-saveable", lambda x: x * 2.0, x)
    with pytest.raises(remat.NondeterministicRecomputeError, match=r"got the numbers \(2.0,\)"):
        _replay(log, lambda x: x * 3.0, x)
    got, _ = _replay(log, lambda x: x * 3.0, x, check=False)  # determinism_check=False
    torch.testing.assert_close(got, x * 3.0)


def test_a_replayed_op_given_other_shapes_raises_even_without_the_check() -> None:
    x, w = _xw()
    log, _ = _record("dots-saveable", _mlp, x, w)
    with pytest.raises(remat.NondeterministicRecomputeError, match="got tensors of shapes"):
        _replay(log, _mlp, torch.randn(2, 4), w, check=False)


# -- liveness and stand-ins ---------------------------------------------------------


def _branches(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    dead = x.exp().sin()  # feeds nothing backward needs
    return torch.tanh(x @ w) + 0 * dead.sum()


def test_liveness_walks_back_from_what_backward_needs() -> None:
    log, _ = _record("nothing-saveable", _branches, *_xw())
    names = [rec.op.overloadpacket.__name__ for rec in log.records]
    tanh = names.index("tanh")
    live = dict(zip(names, log.liveness([tanh]), strict=True))
    assert live == {"exp": False, "sin": False, "sum": False, "mm": True, "tanh": True,
                    "mul": False, "add": False}


def test_a_replayed_op_needs_none_of_its_inputs() -> None:
    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x.exp() @ w)

    log, _ = _record("dots-saveable", fn, *_xw())
    assert log.liveness([2]) == [False, True, True]  # exp feeds only the kept mm
    log, _ = _record("nothing-saveable", fn, *_xw())
    assert log.liveness([2]) == [True, True, True]


def test_ops_python_may_read_and_random_ops_are_always_live() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        scale = x.abs().max().item()  # Python reads data
        noise = torch.rand_like(x)  # the random stream
        return x.tanh() * scale + 0 * noise

    log, _ = _record("nothing-saveable", fn, torch.randn(4))
    names = [rec.op.overloadpacket.__name__ for rec in log.records]
    live = dict(zip(names, log.liveness([names.index("tanh")]), strict=True))
    assert live["_local_scalar_dense"] and live["max"] and live["abs"]  # item() and its inputs
    assert live["rand_like"]


def test_an_inner_region_with_anything_live_is_live_whole() -> None:
    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = x.exp()
        start = len(log.records)
        inner = (h @ w).sin().cos()  # an inner region's ops, its input h
        log.inner_region([h], start)
        return inner.tanh()

    log = OpLog(resolve("nothing-saveable"), "test region")
    x, w = _xw()
    with RecordMode(log):
        fn(x, w)
    names = [rec.op.overloadpacket.__name__ for rec in log.records]
    assert names == ["exp", "mm", "sin", "cos", "tanh"]
    # backward needs only sin's output (say): the whole inner region and its input run.
    assert log.liveness([names.index("sin")]) == [True, True, True, True, False]


def test_a_dead_op_returns_a_meta_stand_in_of_its_shape() -> None:
    x, w = _xw()
    log, _ = _record("nothing-saveable", _branches, x, w)
    live = log.liveness([[rec.op for rec in log.records].index(aten.tanh.default)])
    seen: dict[str, torch.Tensor] = {}

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        seen["dead"] = x.exp().sin()
        seen["live"] = torch.tanh(x @ w)
        return seen["live"] + 0 * seen["dead"].sum()

    _, ran = _replay(log, fn, x, w, live=live)
    assert seen["dead"].device.type == "meta" and seen["dead"].shape == x.shape
    assert seen["dead"].stride() == x.stride()
    torch.testing.assert_close(seen["live"], torch.tanh(x @ w))
    assert "exp" not in ran.counts and "sin" not in ran.counts and ran.counts["tanh"] == 1


# -- end to end: a stand-in reaching Python -------------------------------------------


# Python reads a dead op's stand-in: the recompute runs again with every op live
# (NOTE [ Record and replay ] rule 5).
def test_tolist_of_dead_op_is_not_garbage() -> None:
    seen: list[list[float]] = []
    alive: list[torch.Tensor] = []

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = x.exp()
        if not remat.is_recomputing():
            alive.append(h)  # so the stand-in cannot reuse h's memory
        values = h.reshape(-1).tolist()
        seen.append(values)
        return (x @ w * (sum(values) / len(values))).sin()

    x, w = x3(), w44()
    remat.remat(fn, policy="dots-saveable")(x, w).sum().backward()
    assert len(seen) == 2
    assert seen[1] == seen[0], "the recompute read an uninitialized stand-in"


# NOTE [ Stand-ins in Python state ] in ``remat/_replay/stand_ins.py``.
def test_stand_in_escaping_through_python_state() -> None:
    box: dict[str, torch.Tensor] = {}

    def a(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        box["h"] = (x @ w) + 1  # add saves nothing: dead in a's recompute
        return (x @ w).cos().sin()

    def a_fixed(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = (x @ w) + 1  # the fix the error names: the same ops, stored in the forward only
        if not remat.is_recomputing():
            box["h"] = h
        return (x @ w).cos().sin()

    def b(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (y * box["h"]).sin() @ w

    def run(fa: Fn, fb: Fn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        torch.manual_seed(1)
        x, w = x3(), w44()
        ya = fa(x, w)
        forward_h = box["h"].detach().clone()
        yb = fb(torch.ones(2, 3, 4, requires_grad=True), w)
        (g1,) = torch.autograd.grad(ya.sum(), w)  # recomputes a: box["h"] may be replaced
        (g2,) = torch.autograd.grad(yb.sum(), w)  # recomputes b from box["h"]
        torch.testing.assert_close(box["h"].detach(), forward_h)
        return g1, g2, forward_h

    expected = run(a, b)
    for got, want in zip(run(a_fixed, b), expected, strict=True):  # the same function
        torch.testing.assert_close(got, want)
    region_b = remat.remat(b, policy="dots-saveable")
    with pytest.raises(remat.RematError) as info:
        run(remat.remat(a, policy="dots-saveable"), region_b)
    message = str(info.value)
    assert f"the recompute of {b.__qualname__} ({__file__}:" in message, message
    where = f"{a.__qualname__} ({__file__}:{a.__code__.co_firstlineno})"
    assert f"a stand-in made by the recompute of {where}" in message, message
    assert "shape (2, 3, 4) for its op aten.add.Tensor" in message, message
    assert "if not remat.is_recomputing(): box['h'] = h" in message, message
    assert isinstance(info.value.__cause__, RuntimeError)
    # The fix works: same gradients as without remat, and a's add is skipped still.
    with RecomputeCounter() as counter:
        actual = run(remat.remat(a_fixed, policy="dots-saveable"), region_b)
    for got, want in zip(actual, expected, strict=True):
        torch.testing.assert_close(got, want)
    assert counter.counts["add"] == 0, counter.counts
