"""The matcher of a recompute's saved tensors to the forward's holders, when dead holders
may be left out (NOTE [ Saved tensors the recompute may skip ] in
``remat/_engines/eager/skipped_saves.py``). Programs: ``tests/replay/test_forward_only*.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

from remat._engines.eager.skipped_saves import MAX_READINGS, SkipMatcher


def _match(signatures: Sequence[str], dead: set[int], saves: str) -> dict[int, int] | None:
    """Holders signed by ``signatures`` (live unless in ``dead``; every live one needed),
    the recompute saving one tensor per letter of ``saves``."""
    needed = {i for i in range(len(signatures)) if i not in dead}
    matcher = SkipMatcher(len(signatures), dead, needed)
    for sign in saves:
        if not matcher.save(lambda i, sign=sign: signatures[i] == sign):
            return None
        if matcher.done():
            break
    return matcher.result()


def test_a_statistic_s_dead_holders_are_left_out() -> None:
    # forward: a, then the statistic's s s (dead), then b; the recompute saves a b.
    assert _match("assb", {1, 2}, "ab") == {0: 0, 3: 1}


def test_positions_that_match_need_no_skip() -> None:
    assert _match("ab", set(), "ab") == {0: 0, 1: 1}


def test_a_live_holder_is_never_left_out() -> None:
    assert _match("asb", set(), "ab") is None  # the statistic's holder still referenced


def test_two_readings_that_give_a_live_holder_different_tensors_raise() -> None:
    # The first ``a`` is a dead holder's or the live one's: either reading fills it.
    assert _match("aa", {0}, "aa") is None


def test_readings_that_agree_on_the_live_holders_are_used() -> None:
    # The dead ``a`` filled or skipped: the live ``b`` gets the same save either way.
    assert _match("ab", {0}, "b") == {1: 0}


def test_a_complete_reading_is_not_ended_by_a_later_save() -> None:
    # After ``a`` the only reading is complete (the live ``a`` filled); a later save
    # that fits no holder (the recompute going on for another reading) must not end it.
    matcher = SkipMatcher(2, {1}, {0})
    assert matcher.save(lambda i: i == 0)
    assert matcher.done()
    assert matcher.save(lambda i: False)
    assert matcher.result() == {0: 0}


def test_too_many_readings_raise() -> None:
    count = 2 * MAX_READINGS + 2
    matcher = SkipMatcher(count, set(range(count - 1)), {count - 1})
    alive = True
    for _ in range(count):
        alive = matcher.save(lambda i: True)
        if not alive:
            break
    assert not alive
