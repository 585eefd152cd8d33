"""What an accepted token the calibration expects is worth to the call being decoded."""

from __future__ import annotations

from schedulers.estimates import nearest_size


class TokenWorth:
    """Two corrections scale the calibration's expected accepted tokens (`token_factor`), and each row of a batch
    has a weight (`set_rows`).

    `call_factor`: the calibration is pooled over every call, and a call's own drafted steps tell how far its text
    copies more or less than that. `batch_worth`: the row weights count what rows accept as if each token shortened
    the call by its weight, but rows level at the start of a call advance unevenly and the call is shortened only
    where every row still behind advances, so calls of several rows save fewer steps than their weighted tokens say;
    how many fewer is counted (not timed) from the calls before, per batch size, starting from the shipped prior's."""

    CALL_PRIOR_TOKENS = 8.0  # predicted tokens a call's own correction counts as before its steps show theirs
    CALL_MAX_FACTOR = 2.0  # the most a call's correction scales the calibration's prediction, either way
    SAVED_DECAY = 0.8  # an earlier call's weight in a batch size's saved steps, per call since
    SAVED_PRIOR = 8.0  # estimated steps saved that the batch worth's prior (`_prior_worth`) counts as

    def __init__(self, prior: dict | None):
        self.saved: dict[int, list[float]] = {}  # rows -> [steps calls saved, steps estimated], decayed sums
        self.shipped_worth: dict[int, float] = {}  # rows -> the batch worth the shipped prior's calls measured
        if prior is not None:
            self.saved = {int(rows): list(b["saved"]) for rows, b in prior["batches"].items()}
            self.shipped_worth = {
                rows: min(max(realized / promised, 0.0), 1.0)
                for rows, (realized, promised) in self.saved.items()
                if promised > 0
            }
        self.weights: list[float] = []  # what a token of each row of this step is worth (`set_rows`)
        self.start_call()

    def start_call(self) -> None:
        self.call_rows: int | None = None  # this call's rows at its first step (`set_rows`)
        self.call_predicted = 0.0  # this call's accepted tokens as the calibration predicted them, drafted steps
        self.call_accepted = 0.0  # and as they were
        self.step_predicted: float | None = None  # the prediction of the step in flight (`expect_step`)
        self.call_steps = 0  # steps this call has run
        self.call_worth = 0.0  # the steps its accepted tokens were estimated to save (weighted as `set_rows` says)
        self.call_alone = 0  # tokens it accepted on steps of a lone row, each of which saved a step

    def set_rows(self, steps_left: list[float]) -> None:
        """A batch's call ends with its last row: a row's token is worth its expected steps left over the most any
        row has left, so the rows that will finish last count fully and a row far ahead barely counts."""
        most = max(steps_left, default=0.0)
        self.weights = [left / most if most > 0 else 1.0 for left in steps_left]
        if self.call_rows is None:  # the call's first step: its batch size is the call's
            self.call_rows = len(steps_left)

    def row_weights(self, rows: int) -> list[float]:
        return self.weights if len(self.weights) == rows else [1.0] * rows

    def expect_step(self, predicted: float) -> None:
        """The calibration predicts `predicted` accepted tokens for the nodes chosen this step (`observe` meets it
        with the outcome)."""
        self.step_predicted = predicted

    def observe(self, accepted: list[list[int]], weights: list[float]) -> None:
        """One step's accepted nodes per row, the rows weighted by `weights`."""
        if self.step_predicted is not None:  # a step this scheduler selected: its prediction meets its outcome
            self.call_predicted += self.step_predicted
            self.call_accepted += sum(map(len, accepted))
        self.step_predicted = None
        if len(weights) > 1:
            self.call_worth += sum(w * len(kept) for w, kept in zip(weights, accepted)) / sum(weights)
        else:  # a lone row: its tokens are steps saved, counted apart from what the batch's weights promised
            self.call_alone += sum(map(len, accepted))
        self.call_steps += 1

    def finish(self, emitted: list[int]) -> None:
        """The call ended, its rows having emitted `emitted` tokens after their first: count the steps it saved."""
        rows = self.call_rows or len(emitted)
        if rows > 1 and self.call_worth > 0:
            saved = self.saved.setdefault(rows, [0.0, 0.0])
            saved[0] = self.SAVED_DECAY * saved[0] + max(emitted, default=0) - self.call_steps - self.call_alone
            saved[1] = self.SAVED_DECAY * saved[1] + self.call_worth

    def call_factor(self) -> float:
        """What this call's drafted steps accepted over what the calibration predicted for them, shrunk toward 1 by
        CALL_PRIOR_TOKENS. The calibration is pooled over every call, so on text that copies less than the average
        it predicts too much (novel chat) and where it copies more too little (code); a call's own steps tell which
        it is, and its later steps' estimates are scaled by what the earlier ones showed."""
        factor = (self.call_accepted + self.CALL_PRIOR_TOKENS) / (self.call_predicted + self.CALL_PRIOR_TOKENS)
        return min(max(factor, 1 / self.CALL_MAX_FACTOR), self.CALL_MAX_FACTOR)

    def batch_worth(self) -> float:
        """What a drafted token accepted in a batch of this call's rows is worth, as a share of what the row
        weights (`set_rows`) say: the steps calls of that size saved over the steps their weighted accepted tokens
        promised, shrunk by SAVED_PRIOR toward what the shipped prior's calls of that size measured (1 where it ran
        none). A batch's call ends with its slowest row, and rows level at the start of a call advance unevenly: the
        call is shortened only where every row still behind advances, so a batch saves fewer steps than its rows'
        tokens count (about two thirds of them on our prompts). Shrunk toward 1, a batch size whose last few calls are
        all that is remembered would count its tokens a fifth too dear and verify drafts that lose. At batch 1, and
        once a call's other rows have finished, it is 1: every token the row still decoding accepts saves a step."""
        rows = self.call_rows or 1
        if rows <= 1 or len(self.weights) == 1:
            return 1.0
        realized, estimated = self.saved.get(rows, (0.0, 0.0))
        prior = self._prior_worth(rows)
        return min(max((realized + self.SAVED_PRIOR * prior) / (estimated + self.SAVED_PRIOR), 0.0), 1.0)

    def _prior_worth(self, rows: int) -> float:
        """The batch worth the shipped prior measured at the batch size nearest `rows` (1 without one)."""
        if not self.shipped_worth:
            return 1.0
        return self.shipped_worth[nearest_size(self.shipped_worth, rows)]

    def token_factor(self) -> float:
        """What one accepted token the calibration expects counts as in this call's estimates: the call's own
        correction times what a token is worth to a batch of its size."""
        return self.call_factor() * self.batch_worth()
