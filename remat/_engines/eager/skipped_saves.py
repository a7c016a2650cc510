"""Which forward holder each saved tensor of a recompute fills, when the recompute saves
fewer tensors than the forward did.

NOTE [ Saved tensors the recompute may skip ]
1. The eager engine puts the recompute's k-th saved tensor into the forward's
   k-th holder (NOTE [ The eager engine ] rule 2). A statistic computed only in
   the forward (``if not remat.is_recomputing(): log(h.norm().item())``) on a
   tensor that requires grad is recorded by autograd, which saves tensors for
   it: the recompute, which does not run it, saves fewer, and every later
   position is shifted. The op replay already leaves such ops out (NOTE [ Ops
   the recompute may skip ] in ``_replay/alignment.py``); the saved tensors must
   be matched the same way.
2. Such a statistic's graph is freed once Python has its number: its holders are
   dead (autograd dropped them) when backward first unpacks. Only dead holders
   may be left out. A holder backward still references must be filled by the
   recompute, in order.
3. A dead holder may also be one whose node backward consumed already, or one
   of an output dropped unused: an op the recompute does run. Which dead
   holders the recompute skipped is then not known, so every reading is
   followed at once (`SkipMatcher`): a reading is the next forward holder to
   fill and what it gave the live holders so far; each saved tensor either
   fills the reading's next holder (its signature must match) or skips dead
   holders to a later one that matches. No reading is guessed: the result is
   used only when every reading that fills all the needed holders gave each
   live holder the same saved tensor (a complete reading stops there: a later
   save cannot end it). Then, whichever reading is true, each
   live holder gets what its own op saved, so the gradients are those of no
   remat. Otherwise (no reading, or two that disagree, or more than
   `MAX_READINGS`) the recompute raises as it did, naming ``torch.no_grad()``
   for the statistic (that fix works).
4. This runs only after the positional match failed and some holder was dead,
   as a second recompute from the region's inputs (``recompute.py``): the usual
   recompute pays nothing for it. It holds every tensor it saves until the
   matching is known: a region's saved tensors, as without remat, for a moment.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["MAX_READINGS", "SkipMatcher"]

#: More readings than this of one recompute: raise rather than follow them all.
MAX_READINGS = 64

#: One reading: the next forward holder to fill, and (holder, save) for each live
#: holder filled so far.
_Reading = tuple[int, tuple[tuple[int, int], ...]]


class SkipMatcher:
    """Every reading of a recompute's saved tensors as forward holders (NOTE rule 3).

    ``count``: the forward's holders; ``dead``: those autograd dropped;
    ``needed``: the live ones the recompute must fill.
    """

    def __init__(self, count: int, dead: set[int], needed: set[int]) -> None:
        self.count = count
        self.dead = dead
        self.last_needed = max(needed)
        self.readings: set[_Reading] = {(0, ())}
        self.saves = 0

    def save(self, fits: Callable[[int], bool]) -> bool:
        """The recompute's next saved tensor, which fits forward holder ``i`` if
        ``fits(i)``; False when no reading is left or too many are."""
        k, self.saves = self.saves, self.saves + 1
        after: set[_Reading] = set()
        for position, given in self.readings:
            if position > self.last_needed:  # complete: what it gave stays (rule 3)
                after.add((position, given))
                continue
            i = position
            while i < self.count:
                if fits(i):
                    filled = given if i in self.dead else (*given, (i, k))
                    after.add((i + 1, filled))
                if i not in self.dead:
                    break  # a live holder is never skipped (rule 2)
                i += 1
        self.readings = after
        return 0 < len(after) <= MAX_READINGS

    def done(self) -> bool:
        """Whether every reading has filled every needed holder: the recompute may stop."""
        return all(position > self.last_needed for position, _ in self.readings)

    def result(self) -> dict[int, int] | None:
        """Live holder -> the save that fills it, if every complete reading agrees."""
        complete = {given for position, given in self.readings if position > self.last_needed}
        if len(complete) != 1:
            return None
        (given,) = complete
        return dict(given)


def dead_holders(holders: Sequence[object | None]) -> set[int]:
    """The positions of the holders autograd no longer references."""
    return {i for i, h in enumerate(holders) if h is None}
