"""Schedulers that read the drafter's confidence: cut the draft where verifying more stops paying.

Both predict, for each drafted node i, the calibrated probability a_i that it is accepted given that its
parent was (`AcceptanceModel`). Node i is reached (its whole path accepted) with probability
r_i = a_i r_parent(i), the pending token's r being 1, and accepting a node adds one token, so verifying the
first k nodes accepts E(k) = sum_{i<k} r_i tokens on average. For a chain r_j = prod_{i<=j} a_i; in a tree
siblings exclude each other (the verifier picks one token), and their r's add.
"""

from __future__ import annotations

import itertools
import weakref
from pathlib import Path

from drafters.base import Draft
from schedulers.base import Scheduler
from schedulers.calibration import AcceptanceModel
from schedulers.cost_model import VerifyCostModel
from schedulers.prior import PRIOR_OBSERVATIONS, shipped_prior


def pair_fingerprint(drafter, model, decoding: dict | None = None) -> dict:
    """What a calibration is specific to: the drafter (class, block size, its own id), the verifier, and how the
    verifier's tokens are chosen (`Scheduler.set_decoding`; {}: greedily). A drafted token matches a sampled choice
    less often than the argmax, the less the hotter the sampling, so each decoding is learned on its own."""
    config = model.config.get_text_config() if model is not None else None
    return {
        "drafter": f"{type(drafter).__name__}:{drafter.max_draft_len}:{getattr(drafter, 'fingerprint', '')}",
        "verifier": None
        if config is None
        else f"{type(model).__name__}:{config.hidden_size}x{config.num_hidden_layers}:{config.vocab_size}",
        "decoding": dict(decoding or {}),
    }


def reach_probabilities(conditional: list[float], parents: list[int]) -> list[float]:
    """r_i: the probability that node i's whole path is accepted."""
    reach: list[float] = []
    for a, parent in zip(conditional, parents):
        reach.append(a * (1.0 if parent < 0 else reach[parent]))
    return reach


def expected_accepted(conditional: list[float], parents: list[int] | None = None) -> list[float]:
    """[E(0), E(1), ..., E(k)]: expected accepted tokens when verifying the first k nodes (a chain: parents None)."""
    parents = list(range(-1, len(conditional) - 1)) if parents is None else parents
    return [0.0, *itertools.accumulate(reach_probabilities(conditional, parents))]


def draft_expectation(acceptance, draft: Draft) -> list[float]:
    """E(0..len(draft)) for `draft` under the calibrated acceptance model."""
    return expected_accepted(acceptance.predict(draft), draft.parent_list())


class _Calibrated(Scheduler):
    """Shared state: the acceptance model, learned online across calls, from the shipped prior for this drafter,
    verifier and decoding when there is one (`schedulers.prior`; `prior=False`: start uninformed), or loaded from
    `calibration`. A call of another drafter, verifier or decoding than the last starts again from its own prior."""

    def __init__(self, calibration: str | None = None, prior: bool = True):
        self.calibration_path = calibration
        self.use_prior = prior
        self.acceptance: AcceptanceModel | None = None
        self.prior: Path | None = None  # the shipped prior file it started from (None: uninformed or calibration=)
        self.decoding: dict = {}  # the next call's (`set_decoding`)

    def set_decoding(self, decoding: dict) -> None:
        self.decoding = dict(decoding)

    def reset(self, drafter, model=None) -> None:
        super().reset(drafter, model)
        fingerprint = pair_fingerprint(drafter, model, self.decoding)
        if self.acceptance is not None and self.acceptance.fingerprint == fingerprint:
            return  # same pair as the last call: keep learning
        found = shipped_prior(fingerprint) if self.use_prior and self.calibration_path is None else None
        self.prior, entry = found or (None, None)
        if self.calibration_path is not None:
            self.acceptance = AcceptanceModel.load(self.calibration_path, fingerprint)
        elif entry is not None:
            counts = AcceptanceModel.from_counts(entry["tried"], entry["accepted"], fingerprint)
            self.acceptance = counts.discounted(PRIOR_OBSERVATIONS)
        else:
            self.acceptance = AcceptanceModel(self.max_draft_len, fingerprint)
        self.start_pair(entry)

    def start_pair(self, prior: dict | None) -> None:
        """A new (drafter, verifier) pair: forget what was learned of the last one (`prior`: the shipped entry)."""

    def save_calibration(self, path) -> None:
        """Write what was learned, for `calibration=` in a later run with the same drafter and verifier."""
        self.acceptance.save(path)

    def update(self, draft: Draft, accepted: list[int], draft_time: float, verify_time: float) -> None:
        self.acceptance.update(draft, accepted)


class ConfidenceScheduler(_Calibrated):
    """Verify the longest prefix of nodes each of which is reached (its path accepted whole) with probability at
    least `threshold`."""

    def __init__(self, threshold: float = 0.3, calibration: str | None = None):
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold={threshold!r} must be a probability in [0, 1]")
        super().__init__(calibration)
        self.threshold = threshold

    def select(self, draft: Draft) -> int:
        k = 0
        for reach in reach_probabilities(self.acceptance.predict(draft), draft.parent_list()):
            if reach < self.threshold:
                break
            k += 1
        return max(k, 1) if len(draft) else 0  # always verify one: keeps the calibration learning


# verifier -> {(drafter kind, decoding): scheduler}; weak, so a scheduler lives as long as its verifier and no longer
_DEFAULTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def default_scheduler(drafter, model, decoding: dict | None = None) -> Scheduler:
    """The scheduler `hybrid.generate` uses when given none: a `CostAwareScheduler` kept per
    (verifier, drafter kind, decoding) for the life of the process, so its calibration keeps learning across calls,
    and greedy and sampled calls in turn never overwrite each other's."""
    per_model = _DEFAULTS.setdefault(model, {})
    scheduler = per_model.setdefault(str(pair_fingerprint(drafter, model, decoding)), CostAwareScheduler())
    scheduler.set_decoding(decoding or {})
    return scheduler


class CostAwareScheduler(_Calibrated):
    """Each step, one decision costed as the whole step: which drafting stages run, then how many nodes of each row's
    draft to verify, for the most expected emitted tokens per second of drafting and verifying together. Declining
    (no stage, or no node verified) is one of the options, costed like the others: the engine's plain step.

    After drafting it picks one width w for the batch (`select_batch`): rows verify min(w, their nodes), at
    Σ_r v_r (E_r(min(w, k_r)) + 1) / (draft cost + verify cost(rows, width(w + 1))), since a forward feeds every row
    at the widest row's width (short rows padded, so up to w their nodes cost nothing more). Rows with nothing drafted
    verify 0. v_r is what a token of row r is worth to the call (`set_rows`): a batch ends with its last row, so
    v_r is the row's expected steps left over the most any row has left (1 at batch 1, and for rows level). Verify
    cost comes from a `VerifyCostModel` measured on this device at start-up (cached) and corrected by observed verify
    times, per batch size; draft cost is the mean measured seconds of a step of this many rows drafting with the
    stages that ran.

    Two corrections scale the calibration's expected accepted tokens. `call_factor`: the calibration is pooled over
    every call, and a call's own drafted steps tell how far its text copies more or less than that. `batch_worth`: v_r
    counts what rows accept as if each token shortened the call by its weight, but rows level at the start of a call
    advance unevenly and the call is shortened only where every row still behind advances, so calls of several rows save
    fewer steps than their weighted tokens say; how many fewer is counted (not timed) from the calls before.

    Before drafting it picks how many of the drafter's stages run (`drafting_stages`; a `ChainDrafter`'s sources,
    cheapest first): the n maximising Σ_r v_r (1 + T_n) / (D_n + V_n), with T_n the mean accepted tokens per row the
    first n stages' nodes bring (weighted by v_r) and V_n the mean cost of the verifies they need (each step's widest
    row costed at its width: a mean of costs, not the cost of the mean width W_n, which a lookup's far-apart widths
    and the concave cost of a verify would make dearer than its steps were; V_n falls back to that where not yet
    measured). They are known for every n up to the stages that ran, since a stage's nodes never parent the earlier
    stages' nor change which of those are accepted (`Draft.stage`). T_n, V_n, W_n and D_n are kept per batch size (a
    wider batch verifies less of each row and pays more per drafter forward), T_n and W_n starting from the shipped
    prior's figures for that batch size; a batch size neither seen nor in the prior starts from the nearest one seen,
    D_n scaled by the rows. D_n is 0 for no stage; one never run counts as free, so it gets tried.
    T_n is a moving mean of recent steps, so the text of this call is in it already: only `batch_worth` scales it
    (scaled by `call_factor` too, a call whose first steps copied little would count that twice and stop drafting).

    Estimates are only corrected where they are tried, so a choice the estimates say loses (the next stage up when fewer
    win, a positive width when declining wins, a plain step when drafts win by less than PLAIN_DOUBT and no plain step
    of the batch size was timed lately: `VerifyCostModel.stale`) is still taken now and then, paid from a credit of
    EXPLORE_SHARE / r of the seconds of every step so far at the same batch size of r rows: a probe is taken where the
    credit covers what the estimates say it loses (the seconds more than the best choice would take for the same
    tokens), and once its step is verified it is charged what it lost: its drafting seconds and its verify's cost at
    the width it verified, less its tokens at the best choice's rate. A probed stage's drafts are often worse than its
    mean (exploring is done where the estimates are low), so the estimate alone would let a batch lose about twice its
    share. Where a probe is dear (a wide batch) it is rare, and a batch size runs at most EXPLORE_SHARE / r slower
    than its estimates' best. What a long run at batch 1 saved is not spent on a batch of 8, where one probe costs
    several cheap steps; and a batch, whose drafts gain a few percent where they gain at all, keeps almost all of that.

    For a multi-step drafter it also picks the number of denoising passes, per batch size: each is tried for
    `STEP_TRIALS` steps, then the one with the best measured tokens per second is used, and the runner-up is retried
    every `STEP_EXPLORE` steps (more passes cost drafter time and pay only if they raise acceptance, which only
    measurement can tell). Only steps that ran every stage and verified nodes of a multi-pass stage count: on the
    others the passes changed nothing.
    """

    STEP_TRIALS = 8
    STEP_EXPLORE = 16
    EXPLORE_SHARE = 0.02
    PLAIN_DOUBT = 0.2  # how far behind the best choice a plain step with a stale cost may be to be retried
    ALL_STAGES = False  # run every stage at every step (what `experiments.scheduler_prior` measures)
    PRIOR_STEPS = 8  # what the shipped prior's stage statistics count as: the run's own steps soon outweigh them
    MOVING = 0.05  # a step's weight in a running mean after its first 1 / MOVING steps (machine load drifts)
    CALL_PRIOR_TOKENS = 8.0  # predicted tokens a call's own correction counts as before its steps show theirs
    CALL_MAX_FACTOR = 2.0  # the most a call's correction scales the calibration's prediction, either way
    SAVED_DECAY = 0.8  # an earlier call's weight in a batch size's saved steps, per call since
    SAVED_PRIOR = 8.0  # estimated steps saved that the batch worth's prior (`_prior_worth`) counts as

    def __init__(self, calibration: str | None = None, costs: dict[int, float] | None = None, prior: bool = True):
        super().__init__(calibration, prior)
        self.verify_costs = VerifyCostModel(costs) if costs is not None else None
        self._chosen_steps = 1

    def reset(self, drafter, model=None) -> None:
        super().reset(drafter, model)
        if self.verify_costs is None:
            if model is None:
                raise ValueError("CostAwareScheduler needs the verifier (or costs=) to measure verification cost")
            self.verify_costs = VerifyCostModel.for_model(model)
        self._stages = self.num_stages  # until `drafting_stages` says otherwise
        self._call_rows: int | None = None  # this call's rows at its first step (`set_rows`)
        self._call_predicted = 0.0  # this call's accepted tokens as the calibration predicted them, drafted steps
        self._call_accepted = 0.0  # and as they were
        self._step_predicted: float | None = None  # the prediction of the step in flight (`select_batch`)
        self._call_steps = 0  # steps this call has run
        self._call_worth = 0.0  # the steps its accepted tokens were estimated to save (weighted as `set_rows` says)
        self._call_alone = 0  # tokens it accepted on steps of a lone row, each of which saved a step
        self._probe: tuple[int, float, float] | None = None  # this step's (rows, best choice's rate, loss charged)

    def start_pair(self, prior: dict | None) -> None:
        self._step_stats: dict[int, dict[int, list]] = {}  # rows -> passes -> [steps, tokens per s]
        self._step_count: dict[int, int] = {}  # rows -> steps that chose passes from measurements
        # rows -> n stages -> [steps, accepted tokens per row, verify width] of the nodes of the first n stages
        self._stage_gain: dict[int, list[list[float]]] = {1: self._no_gain()}
        self._saved: dict[int, list[float]] = {}  # rows -> [steps calls saved, steps estimated], decayed sums
        self._shipped_worth: dict[int, float] = {}  # rows -> the batch worth the shipped prior's calls measured
        if prior is not None:
            self._start_from(prior)
        self._draft_cost: dict[int, list[list[float]]] = {}  # rows -> n stages -> [steps, seconds]
        self._stage_verify: dict[int, list[list[float]]] = {}  # rows -> n stages -> [steps, verify seconds]
        self._credit: dict[int, float] = {}  # rows -> seconds exploration may still lose at that batch size
        self._weights: list[float] = []  # what a token of each row of this step is worth (`set_rows`)

    def _start_from(self, prior: dict) -> None:
        """Each batch size's stage statistics from the shipped prior (counting PRIOR_STEPS steps), and what the
        prior's calls of several rows saved. A batch of 8 verifies less of each row than one of 1, and saves fewer
        steps than its tokens count, so borrowing batch 1's figures would make a one-shot batch call draft at a loss
        until its own steps corrected them."""
        stages = {1: (prior["stage_tokens"], prior["stage_width"])}
        stages |= {int(rows): (b["stage_tokens"], b["stage_width"]) for rows, b in prior["batches"].items()}
        for rows, (tokens, widths) in stages.items():
            if len(tokens) == self.num_stages + 1:
                self._stage_gain[rows] = [[self.PRIOR_STEPS, t, w] for t, w in zip(tokens, widths)]
        self._saved = {int(rows): list(b["saved"]) for rows, b in prior["batches"].items()}
        self._shipped_worth = {
            rows: min(max(realized / promised, 0.0), 1.0)
            for rows, (realized, promised) in self._saved.items()
            if promised > 0
        }

    def _no_gain(self) -> list[list[float]]:
        return [[1, 0.0, 1.0]] + [[0, 0.0, 1.0] for _ in range(self.num_stages)]  # no stage: the pending token alone

    def prior_entry(self) -> dict:
        """What this scheduler learned that holds on any machine, for a shipped prior (`schedulers.prior`): the
        acceptance counts, what each stage adds at batch size 1 and, under "batches", at each larger batch size it
        ran, with the steps that batch size's calls saved against what their tokens promised (`batch_worth`)."""
        gain = self._stage_gain[1]
        batches = {
            str(rows): {
                "stage_tokens": [tokens for _, tokens, _ in self._stage_gain[rows]],
                "stage_width": [width for _, _, width in self._stage_gain[rows]],
                "saved": self._saved.get(rows, [0.0, 0.0]),
            }
            for rows in sorted(self._stage_gain)
            if rows > 1
        }
        return {
            "fingerprint": self.acceptance.fingerprint,
            "tried": self.acceptance.tried.tolist(),
            "accepted": self.acceptance.accepted.tolist(),
            "stage_tokens": [tokens for _, tokens, _ in gain],
            "stage_width": [width for _, _, width in gain],
            "batches": batches,
        }

    def set_rows(self, steps_left: list[float]) -> None:
        """A batch's call ends with its last row: a row's token is worth its expected steps left over the most any
        row has left, so the rows that will finish last count fully and a row far ahead barely counts."""
        most = max(steps_left, default=0.0)
        self._weights = [left / most if most > 0 else 1.0 for left in steps_left]
        if self._call_rows is None:  # the call's first step: its batch size is the call's
            self._call_rows = len(steps_left)

    def finish(self, emitted: list[int], seconds: float) -> None:
        rows = self._call_rows or len(emitted)
        if rows > 1 and self._call_worth > 0:
            saved = self._saved.setdefault(rows, [0.0, 0.0])
            saved[0] = self.SAVED_DECAY * saved[0] + max(emitted, default=0) - self._call_steps - self._call_alone
            saved[1] = self.SAVED_DECAY * saved[1] + self._call_worth

    def call_factor(self) -> float:
        """What this call's drafted steps accepted over what the calibration predicted for them, shrunk toward 1 by
        CALL_PRIOR_TOKENS. The calibration is pooled over every call, so on text that copies less than the average
        it predicts too much (novel chat) and where it copies more too little (code); a call's own steps tell which
        it is, and its later steps' estimates are scaled by what the earlier ones showed."""
        factor = (self._call_accepted + self.CALL_PRIOR_TOKENS) / (self._call_predicted + self.CALL_PRIOR_TOKENS)
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
        rows = self._call_rows or 1
        if rows <= 1 or len(self._weights) == 1:
            return 1.0
        realized, estimated = self._saved.get(rows, (0.0, 0.0))
        prior = self._prior_worth(rows)
        return min(max((realized + self.SAVED_PRIOR * prior) / (estimated + self.SAVED_PRIOR), 0.0), 1.0)

    def _prior_worth(self, rows: int) -> float:
        """The batch worth the shipped prior measured at the batch size nearest `rows` (1 without one)."""
        if not self._shipped_worth:
            return 1.0
        return self._shipped_worth[nearest_size(self._shipped_worth, rows)]

    def token_factor(self) -> float:
        """What one accepted token the calibration expects counts as in this call's estimates: the call's own
        correction times what a token is worth to a batch of its size."""
        return self.call_factor() * self.batch_worth()

    def _row_weights(self, rows: int) -> list[float]:
        return self._weights if len(self._weights) == rows else [1.0] * rows

    def denoising_steps(self) -> int:
        rows = len(self._weights) or 1  # `set_rows` has named this step's rows
        stats = self._passes_stats(rows)
        untried = [s for s, (n, _) in stats.items() if n < self.STEP_TRIALS]
        if untried:
            self._chosen_steps = untried[0]
        else:
            ranked = sorted(stats, key=lambda s: -stats[s][1])
            self._step_count[rows] = self._step_count.get(rows, 0) + 1
            explore = len(ranked) > 1 and self._step_count[rows] % self.STEP_EXPLORE == 0
            self._chosen_steps = ranked[1] if explore else ranked[0]
        return self._chosen_steps

    def _passes_stats(self, rows: int) -> dict[int, list]:
        """passes -> [steps, tokens per second] at this batch size: a batch's tokens per second is not a single
        row's, and its drafter forward and verify cost other shares of its step."""
        return self._step_stats.setdefault(rows, {s: [0, 0.0] for s in range(1, self.max_steps + 1)})

    def drafting_stages(self, rows: int) -> int:
        options = self.expected_stage_steps(rows)
        best = max(reversed(range(len(options))), key=lambda n: _rate(options[n]))  # a tie: more stages, measured
        if self.ALL_STAGES:
            best = self.num_stages
        elif best < self.num_stages and self._explore(rows, options[best], options[best + 1]):
            best += 1  # the next stage up: the cheapest probe, and a declined stage's estimate is only corrected by it
        self._stages = best
        return best

    def expected_stage_steps(self, rows: int) -> list[tuple[float, float]]:
        """(expected emitted tokens, expected seconds) of a step of `rows` rows that drafts with the first n stages,
        n = 0..all."""
        gain = self._gain(rows)
        worth = sum(self._row_weights(rows))
        factor = self.batch_worth()  # T_n is measured on recent steps: this call's text is in it already
        return [
            (worth * (1 + factor * tokens), self._draft_seconds(rows, n) + self._stage_verify_seconds(rows, n, width))
            for n, (_, tokens, width) in enumerate(gain)
        ]

    def _stage_verify_seconds(self, rows: int, n: int, width: float) -> float:
        """The mean verify seconds of steps of `rows` rows that ran n stages, each costed at the width of the first n
        stages' nodes it verified; where none was measured, the cost at the mean width. The widths a lookup's steps
        verify are far apart (1 where nothing matched, 16 where a passage repeats), and a verify's cost is concave
        in its width: costed at the mean width, such a stage looks dearer than its steps were."""
        measured = self._stage_verify.get(rows)
        if measured is not None and measured[n][0]:
            return measured[n][1]
        return self._verify_seconds(rows, max(1, round(width)))

    def expected_stage_rates(self, rows: int) -> list[float]:
        """Expected emitted tokens per second of a step of `rows` rows that drafts with the first n stages,
        n = 0..all."""
        return [_rate(option) for option in self.expected_stage_steps(rows)]

    def select(self, draft: Draft) -> int:
        return self.select_batch([draft])[0]

    def select_batch(self, drafts: list[Draft]) -> list[int]:
        predicted = [draft_expectation(self.acceptance, draft) for draft in drafts]
        options = self.expected_batch_steps(drafts, predicted)
        best = max(range(len(options)), key=lambda w: _rate(options[w]))
        rows = len(drafts)
        if best == 0 and len(options) > 1:  # what verifying would bring is only learned by verifying
            widest = max(range(1, len(options)), key=lambda w: _rate(options[w]))
            if self._explore(rows, options[0], options[widest]):
                best = widest
        elif best > 0 and self._plain_in_doubt(rows, options[0], options[best]):
            if self._explore(rows, options[best], options[0]):
                best = 0
        ks = [min(best, len(draft)) for draft in drafts]
        self._step_predicted = sum(row[k] for row, k in zip(predicted, ks))  # `update_batch` meets it with the outcome
        return ks

    def _plain_in_doubt(self, rows: int, plain: tuple[float, float], best: tuple[float, float]) -> bool:
        """Whether a plain step (a step verifying no drafts) is worth taking to be measured: no plain step of this
        batch size was timed lately (`VerifyCostModel.stale`), and the estimates put it within PLAIN_DOUBT of the
        best choice, near enough that its stale cost could be what ranks it below. At a batch of 4 on text with
        little to copy, a verify of drafts gains a few percent where it gains at all: a plain step's cost read
        under other load, or on other calls' longer contexts, can make the drafts look ahead for a whole call."""
        return self.verify_costs.stale(rows, drafted=False) and _rate(plain) >= (1 - self.PLAIN_DOUBT) * _rate(best)

    def _explore(self, rows: int, best: tuple[float, float], other: tuple[float, float]) -> bool:
        """Take `other` instead of `best` (each (tokens, seconds) of a step of `rows` rows) if the credit at this
        batch size covers what the estimates say it loses, and spend that."""
        loss = max(0.0, other[1] - other[0] / _rate(best))
        if loss > self._credit.get(rows, 0.0):
            return False
        self._credit[rows] -= loss
        _, rate, charged = self._probe or (rows, _rate(best), 0.0)  # a second probe: measured against the first's best
        self._probe = (rows, rate, charged + loss)
        return True

    def _settle_probe(
        self, rows: int, weights: list[float], accepted: list[list[int]], draft_seconds: float, width: int
    ) -> None:
        """Charge an explored step what it lost instead of what its estimate said: its drafting and the cost of the
        verify it ran, less its tokens (valued as the estimates value them) at the rate of the choice it displaced."""
        probe, self._probe = self._probe, None
        if probe is None or probe[0] != rows:  # none, or one whose step never reached the verifier
            return
        _, rate, charged = probe
        worth = self.batch_worth()
        tokens = sum(w * (1 + worth * len(kept)) for w, kept in zip(weights, accepted))
        lost = draft_seconds + self._verify_seconds(rows, width) - tokens / rate
        self._credit[rows] = self._credit.get(rows, 0.0) + charged - lost

    def expected_rates(self, draft: Draft) -> list[float]:
        """The objective for k = 0..len(draft) of a batch of one: expected emitted tokens per second."""
        return self.expected_batch_rates([draft])

    def expected_batch_rates(self, drafts: list[Draft]) -> list[float]:
        """Expected emitted tokens per second of the whole step for widths w = 0..max draft."""
        return [_rate(option) for option in self.expected_batch_steps(drafts)]

    def expected_batch_steps(
        self, drafts: list[Draft], predicted: list[list[float]] | None = None
    ) -> list[tuple[float, float]]:
        """(expected emitted tokens, expected seconds) of the whole step for widths w = 0..max draft: the rows'
        E(min(w, k_r)) + 1 over this step's draft cost plus one forward of rows x (w + 1) tokens. `predicted`: each
        row's E(0..k) as the calibration gives it (`draft_expectation`), when the caller has it already."""
        if predicted is None:
            predicted = [draft_expectation(self.acceptance, draft) for draft in drafts]
        factor = self.token_factor()
        # Scaled by the call's corrections, never past what k drafted nodes can give (k of them accepted).
        expected = [[min(factor * e, k) for k, e in enumerate(row)] for row in predicted]
        rows = len(drafts)
        weights = self._row_weights(rows)
        draft_seconds = self._draft_seconds(rows, self._stages)
        return [
            (
                sum(weight * (e[min(w, len(e) - 1)] + 1) for weight, e in zip(weights, expected)),
                draft_seconds + self._verify_seconds(rows, w + 1),
            )
            for w in range(max(len(d) for d in drafts) + 1)
        ]

    def _verify_seconds(self, rows: int, width: int) -> float:
        return self.verify_costs.step_cost(rows, self.verify_width(width, rows))

    def _draft_seconds(self, rows: int, stages: int) -> float:
        """D_n: mean seconds of a step of `rows` rows drafting with `stages` stages; where none was timed at this
        batch size, the nearest one timed, scaled by the rows (a drafter's forward grows with them); 0 if none."""
        if stages == 0:
            return 0.0
        timed = [r for r, cost in self._draft_cost.items() if cost[stages][0]]
        if not timed:
            return 0.0
        nearest = nearest_size(timed, rows)
        return self._draft_cost[nearest][stages][1] * rows / nearest

    def _gain(self, rows: int) -> list[list[float]]:
        """[steps, T_n, W_n] per n at this batch size; for an n never measured at it, the nearest batch size's."""
        own = self._stage_gain.get(rows)
        gain = []
        for n in range(self.num_stages + 1):
            measured = [r for r, stats in self._stage_gain.items() if stats[n][0]]
            if own is not None and own[n][0] or not measured:
                gain.append((own or self._stage_gain[1])[n])
            else:
                gain.append(self._stage_gain[nearest_size(measured, rows)][n])
        return gain

    def update(self, draft: Draft, accepted: list[int], draft_time: float, verify_time: float) -> None:
        self.update_batch([draft], [accepted], [draft_time], verify_time)

    def update_batch(
        self, drafts: list[Draft], accepted: list[list[int]], draft_times: list[float], verify_time: float
    ) -> None:
        for draft, kept in zip(drafts, accepted):
            self.acceptance.update(draft, kept)
        if self._step_predicted is not None:  # a step this scheduler selected: its prediction meets its outcome
            self._call_predicted += self._step_predicted
            self._call_accepted += sum(map(len, accepted))
        self._step_predicted = None
        rows = len(drafts)
        weights = self._row_weights(rows)
        if rows > 1:
            self._call_worth += sum(w * len(kept) for w, kept in zip(weights, accepted)) / sum(weights)
        else:  # a lone row: its tokens are steps saved, counted apart from what the batch's weights promised
            self._call_alone += sum(map(len, accepted))
        self._call_steps += 1
        width = 1 + max(len(d) for d in drafts)
        self.verify_costs.observe_step(rows, self.verify_width(width, rows), verify_time)
        self._settle_probe(rows, weights, accepted, sum(draft_times), width)
        self._observe_stages(drafts, accepted, sum(draft_times))
        earned = self.EXPLORE_SHARE / rows * (sum(draft_times) + verify_time)
        self._credit[rows] = self._credit.get(rows, 0.0) + earned
        if self._stages == self.num_stages and self._passes_mattered(drafts):
            self._observe_steps(rows, sum(map(len, accepted)) + rows, sum(draft_times) + verify_time)

    def _passes_mattered(self, drafts: list[Draft]) -> bool:
        """Whether a step's verified nodes include a multi-pass stage's. Passes are compared on those steps alone:
        where a lookup's match fills the block the passes change nothing, and such a step's tokens per second (one
        token to sixteen, by the match) would only bury the passes' difference in the lookup's spread."""
        return any(stage in self.pass_stages for draft in drafts for stage in draft.stage_list())

    def _observe_stages(self, drafts: list[Draft], accepted: list[list[int]], draft_seconds: float) -> None:
        """Fold one step into T_n and W_n for every n up to the stages that ran, and into D of those stages, at this
        step's batch size."""
        rows = len(drafts)
        if draft_seconds > 0:  # a step with no room left to draft says nothing of what drafting costs
            cost = self._draft_cost.setdefault(rows, [[0, 0.0] for _ in range(self.num_stages + 1)])
            _fold(cost[self._stages], draft_seconds, moving=self.MOVING)
        # A step that ran n stages measures T_m and W_m for every m <= n: the option chosen is always corrected by
        # its outcome (an estimate only stages that were not run could correct would lock a losing choice in).
        gain = self._stage_gain.setdefault(rows, self._no_gain())
        verify = self._stage_verify.setdefault(rows, [[0, 0.0] for _ in range(self.num_stages + 1)])
        stages = [draft.stage_list() for draft in drafts]
        weights = self._row_weights(rows)
        for n in range(1, self._stages + 1):
            kept = [sum(stage[node] < n for node in nodes) for stage, nodes in zip(stages, accepted)]
            tokens = sum(w * k for w, k in zip(weights, kept)) / sum(weights)  # the rows finishing last count most
            width = 1 + max(sum(s < n for s in stage) for stage in stages)
            _fold(gain[n], tokens, width, moving=self.MOVING)
            _fold(verify[n], self._verify_seconds(rows, width), moving=self.MOVING)

    def _observe_steps(self, rows: int, tokens: float, seconds: float) -> None:
        """Fold one step's emitted tokens per second into the statistics of the passes it used at its batch size."""
        stats = self._passes_stats(rows).get(self._chosen_steps)
        if stats is None or seconds <= 0:
            return
        stats[0] += 1
        weight = 1 / stats[0] if stats[0] <= self.STEP_TRIALS else 0.1  # a mean while trying, then a moving one
        stats[1] += weight * (tokens / seconds - stats[1])


def nearest_size(sizes, rows: int) -> int:
    """The batch size among `sizes` nearest `rows`, the smaller of two as near."""
    return min(sizes, key=lambda r: (abs(r - rows), r))


def _rate(option: tuple[float, float]) -> float:
    tokens, seconds = option
    return tokens / seconds if seconds > 0 else float("inf")


def _fold(stats: list, *values: float, moving: float) -> None:
    """stats = [steps, mean, ...]: one more step's values, in a mean for the first 1 / moving steps, then a moving one
    (moving = 0: a plain mean)."""
    stats[0] += 1
    weight = max(1 / stats[0], moving)
    for i, value in enumerate(values, start=1):
        stats[i] += weight * (value - stats[i])
