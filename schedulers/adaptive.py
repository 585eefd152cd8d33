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

from drafters.base import Draft
from schedulers.base import Scheduler
from schedulers.calibration import AcceptanceModel
from schedulers.cost_model import VerifyCostModel


def pair_fingerprint(drafter, model) -> dict:
    """What a calibration is specific to: the drafter (class, block size, its own id) and the verifier."""
    config = model.config.get_text_config() if model is not None else None
    return {
        "drafter": f"{type(drafter).__name__}:{drafter.max_draft_len}:{getattr(drafter, 'fingerprint', '')}",
        "verifier": None
        if config is None
        else f"{type(model).__name__}:{config.hidden_size}x{config.num_hidden_layers}:{config.vocab_size}",
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
    """Shared state: the acceptance model, learned online across calls (or loaded from a file)."""

    def __init__(self, calibration: str | None = None):
        self.calibration_path = calibration
        self.acceptance: AcceptanceModel | None = None

    def reset(self, drafter, model=None) -> None:
        super().reset(drafter, model)
        fingerprint = pair_fingerprint(drafter, model)
        if self.acceptance is not None and self.acceptance.fingerprint == fingerprint:
            return  # same pair as the last call: keep learning
        if self.calibration_path is not None:
            self.acceptance = AcceptanceModel.load(self.calibration_path, fingerprint)
        else:
            self.acceptance = AcceptanceModel(self.max_draft_len, fingerprint)

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


# verifier -> {drafter kind: scheduler}; weak, so a scheduler lives as long as its verifier and no longer
_DEFAULTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def default_scheduler(drafter, model) -> Scheduler:
    """The scheduler `hybrid.generate` uses when given none: a `CostAwareScheduler` kept per
    (verifier, drafter kind) for the life of the process, so its calibration keeps learning across calls."""
    per_model = _DEFAULTS.setdefault(model, {})
    return per_model.setdefault(str(pair_fingerprint(drafter, model)), CostAwareScheduler())


class CostAwareScheduler(_Calibrated):
    """Pick k (nodes) maximising expected emitted tokens per second: (E(k) + 1) / (draft cost + verify cost(k + 1)).

    Verify cost comes from a `VerifyCostModel` measured on this device at start-up (cached) and
    rescaled by observed verify times; draft cost is the running mean of observed draft times.
    For a multi-step drafter it also picks the number of denoising passes: each is tried for
    `STEP_TRIALS` steps, then the one with the best measured tokens per second is used, and the
    runner-up is retried every `STEP_EXPLORE` steps (more passes cost drafter time and pay only
    if they raise acceptance, which only measurement can tell).
    """

    STEP_TRIALS = 8
    STEP_EXPLORE = 16

    def __init__(self, calibration: str | None = None, costs: dict[int, float] | None = None):
        super().__init__(calibration)
        self.verify_costs = VerifyCostModel(costs) if costs is not None else None
        self.draft_cost = 0.0
        self._declined = 0
        self._step_stats: dict[int, list[float]] = {}  # passes -> [steps measured, tokens per second]
        self._steps_for = None  # the pair those statistics belong to
        self._chosen_steps, self._step_count = 1, 0

    def reset(self, drafter, model=None) -> None:
        super().reset(drafter, model)
        if self.verify_costs is None:
            if model is None:
                raise ValueError("CostAwareScheduler needs the verifier (or costs=) to measure verification cost")
            self.verify_costs = VerifyCostModel.for_model(model)
        if self._steps_for != self.acceptance.fingerprint:
            self._step_stats = {s: [0, 0.0] for s in range(1, self.max_steps + 1)}
            self._steps_for = self.acceptance.fingerprint

    def denoising_steps(self) -> int:
        untried = [s for s, (n, _) in self._step_stats.items() if n < self.STEP_TRIALS]
        if untried:
            self._chosen_steps = untried[0]
        else:
            ranked = sorted(self._step_stats, key=lambda s: -self._step_stats[s][1])
            self._step_count += 1
            explore = len(ranked) > 1 and self._step_count % self.STEP_EXPLORE == 0
            self._chosen_steps = ranked[1] if explore else ranked[0]
        return self._chosen_steps

    def _observe_steps(self, tokens: float, seconds: float) -> None:
        """Fold one step's emitted tokens per second into the statistics of the passes it used."""
        stats = self._step_stats.get(self._chosen_steps)
        if stats is None or seconds <= 0:
            return
        stats[0] += 1
        weight = 1 / stats[0] if stats[0] <= self.STEP_TRIALS else 0.1  # a mean while trying, then a moving one
        stats[1] += weight * (tokens / seconds - stats[1])

    def select(self, draft: Draft) -> int:
        if not len(draft):
            return 0
        rate = self.expected_rates(draft)
        best = max(range(len(rate)), key=rate.__getitem__)
        if best == 0:  # still verify the best positive k now and then, or a bad start would never be unlearned
            self._declined += 1
            if self._declined % 4 == 0:
                return max(range(1, len(rate)), key=rate.__getitem__)
        return best

    def update(self, draft: Draft, accepted: list[int], draft_time: float, verify_time: float) -> None:
        super().update(draft, accepted, draft_time, verify_time)
        self.verify_costs.observe(self.verify_width(len(draft) + 1), verify_time)
        self.draft_cost += 0.05 * (draft_time - self.draft_cost)
        self._observe_steps(len(accepted) + 1, draft_time + verify_time)

    def select_batch(self, drafts: list[Draft]) -> list[int]:
        """One width for the batch, chosen for expected tokens per second over all rows; each row verifies
        its drafts up to it (a shorter row is padded in the forward anyway, so its drafts cost nothing)."""
        if len(drafts) == 1:
            return [self.select(drafts[0])]
        rate = self.expected_batch_rates(drafts)
        best = max(range(len(rate)), key=rate.__getitem__)
        if best == 0 and len(rate) > 1:  # as in `select`: keep learning
            self._declined += 1
            if self._declined % 4 == 0:
                best = max(range(1, len(rate)), key=rate.__getitem__)
        return [min(best, len(draft)) for draft in drafts]

    def update_batch(
        self, drafts: list[Draft], accepted: list[list[int]], draft_times: list[float], verify_time: float
    ) -> None:
        if len(drafts) == 1:
            return self.update(drafts[0], accepted[0], draft_times[0], verify_time)
        for draft, kept, draft_time in zip(drafts, accepted, draft_times):
            self.acceptance.update(draft, kept)
            self.draft_cost += 0.05 * (draft_time - self.draft_cost)
        self.verify_costs.observe(len(drafts) * self.verify_width(1 + max(len(d) for d in drafts)), verify_time)
        self._observe_steps(sum(map(len, accepted)) + len(drafts), sum(draft_times) + verify_time)

    def expected_batch_rates(self, drafts: list[Draft]) -> list[float]:
        """Expected emitted tokens per second of the whole batch for widths w = 0..max draft: the rows'
        E(min(w, k_r)) + 1 over their draft costs plus one forward of rows x (w + 1) tokens."""
        expected = [draft_expectation(self.acceptance, draft) for draft in drafts]
        rows = len(drafts)
        return [
            (sum(e[min(w, len(e) - 1)] + 1 for e in expected))
            / (rows * self.draft_cost + self.verify_costs.cost(rows * self.verify_width(w + 1)))
            for w in range(max(len(d) for d in drafts) + 1)
        ]

    def expected_rates(self, draft: Draft) -> list[float]:
        """The objective for k = 0..len(draft): expected emitted tokens per second."""
        expected = draft_expectation(self.acceptance, draft)
        return [
            (expected[k] + 1) / (self.draft_cost + self.verify_costs.cost(self.verify_width(k + 1)))
            for k in range(len(draft) + 1)
        ]
