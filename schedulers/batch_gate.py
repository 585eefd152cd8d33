"""Whether drafting pays at a batch size, judged on whole calls rather than on the steps' estimates.

At batch 1 a step's estimate is its outcome: the tokens it accepts shorten the call. In a batch the call ends with
its slowest row, so tokens accepted by the others are worth less than one step's share each, and the gain is small
against the wider verify every row then pays (about 1.4x a plain step at 8 rows x 2 tokens on the 2-core CPU this
project is measured on): a step-by-step estimate off by a few percent, or calibrated on other text, drafts where the
call loses. So at every batch size of more than one row the calls themselves decide (`BatchGate`): the first runs
plain and measures what plain steps of those rows take; the next drafts, and its realized speed-up is what the same
tokens would have taken plain (`plain_seconds`, the cost model's plain steps, corrected by what the plain calls
measured against it) over its time. While that stays at least 1, calls draft; below it they run plain, and drafting
is tried again after 1, 2, 4, ... plain calls (at most MAX_WAIT), so a batch size where drafting loses costs about one
losing call in MAX_WAIT + 1, and one where it starts to pay (other prompts, a warmer calibration) is found again.
"""

from __future__ import annotations


def plain_seconds(emitted: list[int], step_seconds) -> float:
    """Seconds plain decoding takes for rows that emit `emitted` tokens each after their first: one step per token,
    every row still unfinished in it, each step costing `step_seconds(rows)`."""
    total, done = 0.0, 0  # steps already counted
    for finished, tokens in enumerate(sorted(emitted)):  # the steps up to a row's last run every row not yet done
        total += (tokens - done) * step_seconds(len(emitted) - finished)
        done = tokens
    return total


class BatchGate:
    """Per batch size (rows at a call's start): whether the call drafts, from the realized speed-up of earlier calls."""

    MAX_WAIT = 16  # plain calls at most between two tries of drafting where it lost
    MOVING = 0.5  # a call's weight in the running ratios (calls are few and the machine's load drifts)

    def __init__(self):
        self._plain_fit: dict[int, float] = {}  # rows -> plain calls' seconds over the cost model's
        self._speedup: dict[int, float] = {}  # rows -> drafting calls' realized speed-up
        self._wait: dict[int, int] = {}  # rows -> plain calls still to run before drafting is tried again
        self._backoff: dict[int, int] = {}  # rows -> the wait after the next losing try

    def drafts(self, rows: int) -> bool:
        """Whether a call of `rows` rows may draft (its steps still decide how much)."""
        if rows <= 1:
            return True
        if rows not in self._plain_fit:
            return False  # first learn what plain steps of this many rows take
        speedup = self._speedup.get(rows)
        return speedup is None or speedup >= 1.0 or self._wait.get(rows, 0) <= 0

    def speedup(self, rows: int) -> float | None:
        """The realized speed-up of drafting calls of `rows` rows (None: none measured)."""
        return self._speedup.get(rows)

    def finish(self, rows: int, drafted: bool, modelled: float, seconds: float) -> None:
        """Fold a finished call of `rows` rows in: `drafted` if any step ran a drafter, `modelled` the cost model's
        seconds for its tokens decoded plain (`plain_seconds`), `seconds` what its steps took."""
        if rows <= 1 or modelled <= 0 or seconds <= 0:
            return
        if not drafted:
            self._plain_fit[rows] = _moved(self._plain_fit.get(rows), seconds / modelled, self.MOVING)
            self._wait[rows] = self._wait.get(rows, 0) - 1
            return
        fit = self._plain_fit.get(rows, 1.0)
        self._speedup[rows] = speedup = _moved(self._speedup.get(rows), fit * modelled / seconds, self.MOVING)
        if speedup >= 1.0:
            self._backoff[rows] = 1
        else:
            self._wait[rows] = self._backoff.get(rows, 1)
            self._backoff[rows] = min(2 * self._wait[rows], self.MAX_WAIT)


def _moved(mean: float | None, value: float, weight: float) -> float:
    return value if mean is None else mean + weight * (value - mean)
