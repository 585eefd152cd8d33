"""The default scheduler: each step, the choice with the most expected emitted tokens per second."""

from __future__ import annotations

import functools
import weakref

from drafters.base import Draft
from schedulers.base import Scheduler, StepPlan
from schedulers.calibrated import CalibratedScheduler, draft_expectation, pair_fingerprint
from schedulers.cost_model import VerifyCostModel
from schedulers.estimates import rate
from schedulers.exploration import Exploration, Option
from schedulers.passes import DenoisingPasses
from schedulers.stage_gains import StageGains
from schedulers.step_costs import StepCosts
from schedulers.token_worth import TokenWorth


class CostAwareScheduler(CalibratedScheduler):
    """Each step, one decision costed as the whole step: which drafting stages run, then how many nodes of each row's
    draft to verify, for the most expected emitted tokens per second of drafting and verifying together. Declining
    (no stage, or no node verified) is one of the options, costed like the others: the engine's plain step.

    After drafting it picks one width w for the batch (`select`): rows verify min(w, their nodes), at
    Σ_r v_r (E_r(min(w, k_r)) + 1) / (draft cost + verify cost(rows, width(w + 1))), since a forward feeds every row
    at the widest row's width (short rows padded, so up to w their nodes cost nothing more). Rows with nothing drafted
    verify 0. E_r is what the calibration expects of row r's draft (`schedulers.calibrated`), scaled by the call's
    corrections (`worth`, a `TokenWorth`); v_r is what a token of row r is worth to the call: a batch ends with its
    last row, so v_r is the row's expected steps left over the most any row has left (1 at batch 1, and for rows
    level). Seconds come from `costs` (a `StepCosts`): the verify's from a `VerifyCostModel` measured on this device
    at start-up (cached) and corrected by observed verify times, per batch size; the drafting's the mean measured
    seconds of a step of this many rows drafting with the stages that ran.

    Before drafting it picks how many of the drafter's stages run (a `ChainDrafter`'s sources, cheapest first): the n
    maximising Σ_r v_r (1 + T_n) / (D_n + V_n), with T_n the mean accepted tokens per row the first n stages' nodes
    bring (weighted by v_r) and V_n the mean cost of the verifies they need (each step's widest row costed at its
    width: a mean of costs, not the cost of the mean width W_n, which a lookup's far-apart widths and the concave
    cost of a verify would make dearer than its steps were; V_n falls back to that where not yet measured). T_n and
    W_n (`gains`, a `StageGains`) and D_n and V_n (`costs`) are kept per batch size (a wider batch verifies less of
    each row and pays more per drafter forward), T_n and W_n starting from the shipped prior's figures for that batch
    size; a batch size neither seen nor in the prior starts from the nearest one seen, D_n scaled by the rows. D_n is
    0 for no stage; one never run counts as free, so it gets tried. T_n is a moving mean of recent steps, so the text
    of this call is in it already: only the batch worth scales it (scaled by the call's correction too, a call whose
    first steps copied little would count that twice and stop drafting).

    Estimates are only corrected where they are tried, so a choice the estimates say loses (the next stage up when
    fewer win, a positive width when declining wins, a plain step when drafts win by less than
    `Exploration.PLAIN_DOUBT` and no plain step of the batch size was timed lately: `VerifyCostModel.stale`) is still
    taken now and then, paid from a credit (`exploration`, an `Exploration`).

    For a multi-step drafter it also picks the number of denoising passes, per batch size, by their measured tokens
    per second (`passes`, a `DenoisingPasses`). Only steps that ran every stage and verified nodes of a multi-pass
    stage count: on the others the passes changed nothing.
    """

    ALL_STAGES = False  # run every stage at every step (what `experiments.scheduler_prior` measures)
    MOVING = 0.05  # a step's weight in a running mean after its first 1 / MOVING steps (machine load drifts)

    def __init__(self, calibration: str | None = None, costs: dict[int, float] | None = None, prior: bool = True):
        super().__init__(calibration, prior)
        self.costs = StepCosts(costs)
        self.passes = DenoisingPasses()

    def start(self, drafter, *, model=None, **call) -> None:
        super().start(drafter, model=model, **call)
        if self.costs.verify_costs is None:
            if model is None:
                raise ValueError("CostAwareScheduler needs the verifier (or costs=) to measure verification cost")
            self.costs.verify_costs = VerifyCostModel.for_model(model)
        self.costs.verify_width = self.verify_width
        self.stages = self.num_stages  # until `plan_step` says otherwise
        self.worth.start_call()
        self.exploration.probe = None

    def start_pair(self, prior: dict | None) -> None:
        self.passes.new_pair()
        self.gains = StageGains(self.num_stages, prior)
        self.worth = TokenWorth(prior)
        self.costs.new_pair(self.num_stages)
        self.exploration = Exploration()

    def prior_entry(self) -> dict:
        """What this scheduler learned that holds on any machine, for a shipped prior (`schedulers.prior`): the
        acceptance counts, what each stage adds at batch size 1 and, under "batches", at each larger batch size it
        ran, with the steps that batch size's calls saved against what their tokens promised (`batch_worth`)."""
        batches = {
            str(rows): self.gains.prior_entry(rows) | {"saved": self.worth.saved.get(rows, [0.0, 0.0])}
            for rows in sorted(self.gains.by_rows)
            if rows > 1
        }
        return {
            "fingerprint": self.acceptance.fingerprint,
            "tried": self.acceptance.tried.tolist(),
            "accepted": self.acceptance.accepted.tolist(),
            **self.gains.prior_entry(1),
            "batches": batches,
        }

    # ------------------------------------------------------------------ before drafting: passes and stages

    def plan_step(self, steps_left: list[float]) -> StepPlan:
        self.worth.set_rows(steps_left)
        rows = len(steps_left)
        steps = self.passes.choose(rows or 1, self.max_steps)
        return StepPlan(self.max_nodes, steps, self._choose_stages(rows))

    def _choose_stages(self, rows: int) -> int:
        options = self.expected_stage_steps(rows)
        best = max(reversed(range(len(options))), key=lambda n: rate(options[n]))  # a tie: more stages, measured
        if self.ALL_STAGES:
            best = self.num_stages
        elif best < self.num_stages and self.exploration.take(rows, options[best], options[best + 1]):
            best += 1  # the next stage up: the cheapest probe, and a declined stage's estimate is only corrected by it
        self.stages = best
        return best

    def expected_stage_steps(self, rows: int) -> list[Option]:
        """(expected emitted tokens, expected seconds) of a step of `rows` rows that drafts with the first n stages,
        n = 0..all."""
        gain = self.gains.at(rows)
        worth = sum(self.worth.row_weights(rows))
        factor = self.worth.batch_worth()  # T_n is measured on recent steps: this call's text is in it already
        return [
            (
                worth * (1 + factor * tokens),
                self.costs.draft_seconds(rows, n) + self.costs.stage_verify_seconds(rows, n, width),
            )
            for n, (_, tokens, width) in enumerate(gain)
        ]

    def expected_stage_rates(self, rows: int) -> list[float]:
        """Expected emitted tokens per second of a step of `rows` rows that drafts with the first n stages,
        n = 0..all."""
        return [rate(option) for option in self.expected_stage_steps(rows)]

    # ------------------------------------------------------------------ after drafting: the width verified

    def select(self, drafts: list[Draft]) -> list[int]:
        predicted = [draft_expectation(self.acceptance, draft) for draft in drafts]
        options = self.expected_batch_steps(drafts, predicted)
        best = max(range(len(options)), key=lambda w: rate(options[w]))
        rows = len(drafts)
        if best == 0 and len(options) > 1:  # what verifying would bring is only learned by verifying
            widest = max(range(1, len(options)), key=lambda w: rate(options[w]))
            if self.exploration.take(rows, options[0], options[widest]):
                best = widest
        elif best > 0 and self.exploration.plain_in_doubt(
            self.costs.verify_costs.stale(rows, drafted=False), options[0], options[best]
        ):
            if self.exploration.take(rows, options[best], options[0]):
                best = 0
        ks = [min(best, len(draft)) for draft in drafts]
        self.worth.expect_step(sum(row[k] for row, k in zip(predicted, ks)))
        return ks

    def expected_rates(self, draft: Draft) -> list[float]:
        """The objective for k = 0..len(draft) of a batch of one: expected emitted tokens per second."""
        return self.expected_batch_rates([draft])

    def expected_batch_rates(self, drafts: list[Draft]) -> list[float]:
        """Expected emitted tokens per second of the whole step for widths w = 0..max draft."""
        return [rate(option) for option in self.expected_batch_steps(drafts)]

    def expected_batch_steps(self, drafts: list[Draft], predicted: list[list[float]] | None = None) -> list[Option]:
        """(expected emitted tokens, expected seconds) of the whole step for widths w = 0..max draft: the rows'
        E(min(w, k_r)) + 1 over this step's draft cost plus one forward of rows x (w + 1) tokens. `predicted`: each
        row's E(0..k) as the calibration gives it (`draft_expectation`), when the caller has it already."""
        if predicted is None:
            predicted = [draft_expectation(self.acceptance, draft) for draft in drafts]
        factor = self.worth.token_factor()
        # Scaled by the call's corrections, never past what k drafted nodes can give (k of them accepted).
        expected = [[min(factor * e, k) for k, e in enumerate(row)] for row in predicted]
        rows = len(drafts)
        weights = self.worth.row_weights(rows)
        draft_seconds = self.costs.draft_seconds(rows, self.stages)
        return [
            (
                sum(weight * (e[min(w, len(e) - 1)] + 1) for weight, e in zip(weights, expected)),
                draft_seconds + self.costs.verify_seconds(rows, w + 1),
            )
            for w in range(max(len(d) for d in drafts) + 1)
        ]

    # ------------------------------------------------------------------ after verifying: learn

    def observe(
        self, drafts: list[Draft], accepted: list[list[int]], draft_times: list[float], verify_time: float
    ) -> None:
        super().observe(drafts, accepted, draft_times, verify_time)  # the calibration
        rows = len(drafts)
        weights = self.worth.row_weights(rows)
        self.worth.observe(accepted, weights)
        width = 1 + max(len(d) for d in drafts)
        draft_seconds = sum(draft_times)
        self.costs.observe_verify(rows, width, verify_time)
        self.exploration.settle(
            rows, functools.partial(self._seconds_lost, rows, weights, accepted, draft_seconds, width)
        )
        self.costs.observe_draft(rows, self.stages, draft_seconds, self.MOVING)
        widths = self.gains.observe(drafts, accepted, self.stages, weights, self.MOVING)
        self.costs.observe_stage_verifies(rows, widths, self.MOVING)
        self.exploration.earn(rows, draft_seconds + verify_time)
        if self.stages == self.num_stages and self._passes_mattered(drafts):
            self.passes.observe(rows, self.max_steps, sum(map(len, accepted)) + rows, draft_seconds + verify_time)

    def _seconds_lost(
        self, rows: int, weights: list[float], accepted: list[list[int]], draft_seconds: float, width: int, best: float
    ) -> float:
        """What an explored step lost against the choice it displaced (`best` tokens per second): its drafting and the
        cost of the verify it ran, less its tokens (valued as the estimates value them) at that rate."""
        worth = self.worth.batch_worth()
        tokens = sum(w * (1 + worth * len(kept)) for w, kept in zip(weights, accepted))
        return draft_seconds + self.costs.verify_seconds(rows, width) - tokens / best

    def _passes_mattered(self, drafts: list[Draft]) -> bool:
        """Whether a step's verified nodes include a multi-pass stage's. Passes are compared on those steps alone:
        where a lookup's match fills the block the passes change nothing, and such a step's tokens per second (one
        token to sixteen, by the match) would only bury the passes' difference in the lookup's spread."""
        return any(stage in self.pass_stages for draft in drafts for stage in draft.stage_list())

    def finish(self, emitted: list[int], seconds: float) -> None:
        self.worth.finish(emitted)


# verifier -> {(drafter kind, decoding): scheduler}; weak, so a scheduler lives as long as its verifier and no longer
_DEFAULTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def default_scheduler(drafter, model, decoding: dict | None = None) -> Scheduler:
    """The scheduler `hybrid.generate` uses when given none: a `CostAwareScheduler` kept per
    (verifier, drafter kind, decoding) for the life of the process, so its calibration keeps learning across calls,
    and greedy and sampled calls in turn never overwrite each other's."""
    per_model = _DEFAULTS.setdefault(model, {})
    return per_model.setdefault(str(pair_fingerprint(drafter, model, decoding)), CostAwareScheduler())
