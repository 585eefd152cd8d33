"""Exploration: now and then a choice the estimates say loses, paid from a credit, so that wrong estimates get
corrected (an estimate is only corrected where its choice is tried)."""

from __future__ import annotations

from collections.abc import Callable

from schedulers.estimates import rate

Option = tuple[float, float]  # (expected tokens, expected seconds) of a step


class Exploration:
    """A credit of seconds per batch size: EXPLORE_SHARE / r of the seconds of every step of r rows so far. A probe (a
    choice the estimates rank below the best) is taken where the credit covers what the estimates say it loses (the
    seconds more than the best choice would take for the same tokens), and once its step is verified it is charged
    what it lost instead (`settle`). A probed choice's steps are often worse than its mean (exploring is done where
    the estimates are low), so the estimate alone would let a batch lose about twice its share. Where a probe is dear
    (a wide batch) it is rare, and a batch size runs at most EXPLORE_SHARE / r slower than its estimates' best. What a
    long run at batch 1 saved is not spent on a batch of 8, where one probe costs several cheap steps; and a batch,
    whose drafts gain a few percent where they gain at all, keeps almost all of that."""

    EXPLORE_SHARE = 0.02
    PLAIN_DOUBT = 0.2  # how far behind the best choice a plain step with a stale cost may be to be retried

    def __init__(self):
        self.credit: dict[int, float] = {}  # rows -> seconds exploration may still lose at that batch size
        self.probe: tuple[int, float, float] | None = None  # this step's (rows, best choice's rate, loss charged)

    def earn(self, rows: int, seconds: float) -> None:
        """A step of `rows` rows took `seconds`: its share goes to the credit of its batch size."""
        earned = self.EXPLORE_SHARE / rows * seconds
        self.credit[rows] = self.credit.get(rows, 0.0) + earned

    def take(self, rows: int, best: Option, other: Option) -> bool:
        """Take `other` instead of `best` (each (tokens, seconds) of a step of `rows` rows) if the credit at this
        batch size covers what the estimates say it loses, and spend that."""
        loss = max(0.0, other[1] - other[0] / rate(best))
        if loss > self.credit.get(rows, 0.0):
            return False
        self.credit[rows] -= loss
        _, best_rate, charged = self.probe or (rows, rate(best), 0.0)  # a second probe: against the first's best
        self.probe = (rows, best_rate, charged + loss)
        return True

    def plain_in_doubt(self, stale: bool, plain: Option, best: Option) -> bool:
        """Whether a plain step (a step verifying no drafts) is worth taking to be measured: no plain step of this
        batch size was timed lately (`stale`: `VerifyCostModel.stale`), and the estimates put it within PLAIN_DOUBT
        of the best choice, near enough that its stale cost could be what ranks it below. At a batch of 4 on text
        with little to copy, a verify of drafts gains a few percent where it gains at all: a plain step's cost read
        under other load, or on other calls' longer contexts, can make the drafts look ahead for a whole call."""
        return stale and rate(plain) >= (1 - self.PLAIN_DOUBT) * rate(best)

    def settle(self, rows: int, lost: Callable[[float], float]) -> None:
        """Charge an explored step of `rows` rows what it lost instead of what its estimate said: `lost(rate)`, its
        seconds less its tokens at the rate of the choice it displaced. A probe whose step never reached the verifier
        is dropped."""
        probe, self.probe = self.probe, None
        if probe is None or probe[0] != rows:
            return
        _, best_rate, charged = probe
        self.credit[rows] = self.credit.get(rows, 0.0) + charged - lost(best_rate)
