"""Whether drafting pays at a batch size, judged on whole calls rather than on the steps' estimates.

At batch 1 a step's estimate is its outcome: the tokens it accepts shorten the call. In a batch the call ends with
its slowest row, so tokens accepted by the others are worth less than one step's share each, and the gain is small
against the wider verify every row then pays (about 1.4x a plain step at 8 rows x 2 tokens on the 2-core CPU this
project is measured on): a step-by-step estimate off by a few percent, or calibrated on other text, drafts where the
call loses. So at every batch size of more than one row the calls themselves decide (`BatchGate`): the first runs
plain and measures what plain steps of those rows take against the cost model, and so does the second; the next
drafts, and its realized speed-up is what the same tokens would have taken plain (`plain_seconds`, the cost model's
plain steps, corrected by what the plain calls measured against it) over its time. While drafting pays, one call in
REFRESH still runs plain, so that correction follows the machine rather than resting on the calls that set it.

One call's time is a noisy reading (on a shared machine identical calls differ by 10-20%), and a batch size where
drafting truly gains a few percent is worth less than one where it truly loses costs. So calls keep drafting only
while the running speed-up stays above 1 by its uncertainty: the spread the calls' readings have shown around
their running means (`noise`), shrunk by how many readings the running speed-up and the plain correction hold.
Below that they run plain, and drafting is tried again after 1, 2, 4, ... plain calls (at most MAX_WAIT), so a batch
size where drafting loses costs about one losing call in MAX_WAIT + 1, and one where it starts to pay (other
prompts, a warmer calibration) is found again after a few tries.
"""

from __future__ import annotations

import math


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
    NOISE_MOVING = 0.25  # a reading's weight in the running spread of readings
    NOISE_PRIOR = 0.1  # the spread (of log readings) assumed until calls have shown theirs; the readings replace it
    PLAIN_FIRST = 2  # plain calls that measure a batch size before it drafts
    REFRESH = 8  # while drafting pays, one call in REFRESH runs plain (the plain correction follows the machine)

    def __init__(self):
        self._log_fit: dict[int, float] = {}  # rows -> log of plain calls' seconds over the cost model's
        self._log_speedup: dict[int, float] = {}  # rows -> log of drafting calls' realized speed-up
        self._spread: dict[int, float] = {}  # rows -> the running speed-up's variance over a reading's (sum w^2)
        self._fit_spread: dict[int, float] = {}  # rows -> the same of the plain correction
        self._plain_calls: dict[int, int] = {}  # rows -> plain calls so far
        self._since_plain: dict[int, int] = {}  # rows -> calls since the last plain one
        self._noise_var = self.NOISE_PRIOR**2  # readings' variance around their running means, all batch sizes
        self._wait: dict[int, int] = {}  # rows -> plain calls still to run before drafting is tried again
        self._backoff: dict[int, int] = {}  # rows -> the wait after the next losing try

    def drafts(self, rows: int) -> bool:
        """Whether a call of `rows` rows may draft (its steps still decide how much)."""
        if rows <= 1:
            return True
        if self._plain_calls.get(rows, 0) < self.PLAIN_FIRST:
            return False  # first learn what plain steps of this many rows take
        if rows not in self._log_speedup:
            return True
        if self._pays(rows):
            return self._since_plain.get(rows, 0) < self.REFRESH - 1
        return self._wait.get(rows, 0) <= 0

    def speedup(self, rows: int) -> float | None:
        """The running realized speed-up of drafting calls of `rows` rows (None: none measured)."""
        log_speedup = self._log_speedup.get(rows)
        return None if log_speedup is None else math.exp(log_speedup)

    def noise(self) -> float:
        """The spread of one call's log reading around the running mean (measured; NOISE_PRIOR until then)."""
        return math.sqrt(self._noise_var)

    def _pays(self, rows: int) -> bool:
        """Whether the running speed-up is above 1 by more than its uncertainty (its readings' and the plain
        correction's, which every reading shares)."""
        return self._log_speedup[rows] >= self.noise() * math.sqrt(self._spread[rows] + self._fit_spread[rows])

    def finish(self, rows: int, drafted: bool, modelled: float, seconds: float) -> None:
        """Fold a finished call of `rows` rows in: `drafted` if any step ran a drafter, `modelled` the cost model's
        seconds for its tokens decoded plain (`plain_seconds`), `seconds` what its steps took."""
        if rows <= 1 or modelled <= 0 or seconds <= 0:
            return
        if not drafted:
            self._log_fit[rows] = self._fold(self._log_fit.get(rows), math.log(seconds / modelled))
            self._fit_spread[rows] = self._spread_after(self._fit_spread.get(rows))
            self._plain_calls[rows] = self._plain_calls.get(rows, 0) + 1
            self._since_plain[rows] = 0
            self._wait[rows] = self._wait.get(rows, 0) - 1
            return
        self._since_plain[rows] = self._since_plain.get(rows, 0) + 1
        reading = self._log_fit.get(rows, 0.0) + math.log(modelled / seconds)
        self._log_speedup[rows] = self._fold(self._log_speedup.get(rows), reading)
        self._spread[rows] = self._spread_after(self._spread.get(rows))
        if self._pays(rows):
            self._backoff[rows] = 1
        else:
            self._wait[rows] = self._backoff.get(rows, 1)
            self._backoff[rows] = min(2 * self._wait[rows], self.MAX_WAIT)

    def _spread_after(self, spread: float | None) -> float:
        """A running mean's variance over one reading's once another reading is folded in (`spread` None: the
        mean's first reading, 1)."""
        return 1.0 if spread is None else (1 - self.MOVING) ** 2 * spread + self.MOVING**2

    def _fold(self, mean: float | None, reading: float) -> float:
        """The running mean with `reading` folded in; the reading's miss against it feeds the noise estimate."""
        if mean is None:
            return reading
        self._noise_var += self.NOISE_MOVING * ((reading - mean) ** 2 - self._noise_var)
        return mean + self.MOVING * (reading - mean)
