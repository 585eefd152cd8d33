"""What a draft is expected to yield, by the calibrated acceptance model learned for its drafter and verifier.

The model (`AcceptanceModel`) predicts, for each drafted node i, the calibrated probability a_i that it is accepted
given that its parent was. Node i is reached (its whole path accepted) with probability r_i = a_i r_parent(i), the
pending token's r being 1, and accepting a node adds one token, so verifying the first k nodes accepts
E(k) = sum_{i<k} r_i tokens on average. For a chain r_j = prod_{i<=j} a_i; in a tree siblings exclude each other (the
verifier picks one token), and their r's add.
"""

from __future__ import annotations

import itertools
from pathlib import Path

from drafters.base import Draft
from schedulers.base import Scheduler
from schedulers.calibration import AcceptanceModel
from schedulers.prior import PRIOR_OBSERVATIONS, shipped_prior


def pair_fingerprint(drafter, model, decoding: dict | None = None) -> dict:
    """What a calibration is specific to: the drafter (class, block size, its own id), the verifier, and how the
    verifier's tokens are chosen ({}: greedily; `Scheduler.start`'s decoding). A drafted token matches a sampled
    choice less often than the argmax, the less the hotter the sampling, so each decoding is learned on its own."""
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


def draft_expectation(acceptance: AcceptanceModel, draft: Draft) -> list[float]:
    """E(0..len(draft)) for `draft` under the calibrated acceptance model."""
    return expected_accepted(acceptance.predict(draft), draft.parent_list())


class CalibratedScheduler(Scheduler):
    """A scheduler that predicts from `acceptance`, an `AcceptanceModel` learned online across calls: from the
    shipped prior for this drafter, verifier and decoding when there is one (`schedulers.prior`; `prior=False`:
    start uninformed), or loaded from `calibration`. A call of another drafter, verifier or decoding than the last
    starts again from its own prior."""

    def __init__(self, calibration: str | None = None, prior: bool = True):
        self.calibration_path = calibration
        self.use_prior = prior
        self.acceptance: AcceptanceModel | None = None
        self.prior: Path | None = None  # the shipped prior file it started from (None: uninformed or calibration=)

    def start(self, drafter, *, model=None, **call) -> None:
        super().start(drafter, model=model, **call)
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

    def observe(
        self, drafts: list[Draft], accepted: list[list[int]], draft_times: list[float], verify_time: float
    ) -> None:
        for draft, kept in zip(drafts, accepted):
            self.acceptance.update(draft, kept)
