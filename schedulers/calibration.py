"""Calibrated acceptance: P(a drafted node is accepted | its parent was), learned from history.

Cells are (depth, confidence bin): a chain's node i is at depth i + 1. A drafter without confidences uses one bin per
position. Each cell's estimate shrinks toward its bin's estimate pooled over a position class
(the first drafted position, which decides most steps, or all later ones, which are accepted far
more often once the first is), and that toward a prior (the bin's confidence, or 1/2), so a few
observations already give sensible numbers and many give the empirical rate. Counts can be saved and reloaded; the file
names the drafter and verifier it was measured on, and loading it for another pair is an error.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from drafters.base import Draft

NUM_BINS = 10  # confidence bins of width 0.1; bin NUM_BINS is "no confidence given"
PRIOR_STRENGTH = 2.0  # pseudo-observations behind each prior
NO_CONFIDENCE = NUM_BINS


def confidence_bins(draft: Draft) -> list[int]:
    if draft.confidence is None:
        return [NO_CONFIDENCE] * len(draft)
    return [min(int(c * NUM_BINS), NUM_BINS - 1) for c in draft.confidence.clamp(0, 1).tolist()]


class AcceptanceModel:
    def __init__(self, max_positions: int, fingerprint: dict | None = None):
        self.fingerprint = fingerprint or {}
        self.tried = torch.zeros(max_positions, NUM_BINS + 1, dtype=torch.float64)
        self.accepted = torch.zeros_like(self.tried)

    def predict(self, draft: Draft) -> list[float]:
        """Each node's probability of acceptance given its parent's (or, at depth 1, the pending token)."""
        if not len(draft):  # most steps of a batch that declines drafting: nothing to price
            return []
        bins = confidence_bins(draft)
        positions = [d - 1 for d in draft.depths()]
        # Pooled per (position class, bin) first, then each (position, bin) cell shrunk toward it.
        tried_class = (self.tried[0], self.tried[1:].sum(0))
        accepted_class = (self.accepted[0], self.accepted[1:].sum(0))
        result = []
        for position, b in zip(positions, bins):
            if position >= self.tried.shape[0]:  # beyond the calibrated depths: assume rejection
                result.append(0.0)
                continue
            prior = 0.5 if b == NO_CONFIDENCE else (b + 0.5) / NUM_BINS
            c = min(position, 1)
            pooled = (float(accepted_class[c][b]) + PRIOR_STRENGTH * prior) / (
                float(tried_class[c][b]) + PRIOR_STRENGTH
            )
            cell = (float(self.accepted[position, b]) + PRIOR_STRENGTH * pooled) / (
                float(self.tried[position, b]) + PRIOR_STRENGTH
            )
            result.append(cell)
        return result

    def update(self, draft: Draft, accepted: list[int]) -> None:
        """The nodes `accepted` (a path from the pending token) were accepted: every child of the pending token and
        of an accepted node was tried, and only the path's were accepted."""
        bins, depths, kept = confidence_bins(draft), draft.depths(), set(accepted)
        for node, parent in enumerate(draft.parent_list()):
            position = depths[node] - 1
            if (parent < 0 or parent in kept) and position < self.tried.shape[0]:
                self.tried[position, bins[node]] += 1
                self.accepted[position, bins[node]] += node in kept

    def save(self, path: str | Path) -> None:
        data = {"fingerprint": self.fingerprint, "tried": self.tried.tolist(), "accepted": self.accepted.tolist()}
        Path(path).write_text(json.dumps(data))

    @classmethod
    def load(cls, path: str | Path, fingerprint: dict) -> AcceptanceModel:
        try:
            data = json.loads(Path(path).read_text())
            saved, tried, accepted = data["fingerprint"], data["tried"], data["accepted"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"cannot read calibration file {path}: {e}") from None
        if saved != fingerprint:
            raise ValueError(
                f"calibration file {path} was measured for {saved}, not for {fingerprint}: "
                "calibrate this drafter and verifier under this decoding (greedy or sampled as this call is), or drop "
                "calibration= to learn online"
            )
        return cls.from_counts(tried, accepted, fingerprint)

    @classmethod
    def from_counts(cls, tried: list, accepted: list, fingerprint: dict) -> AcceptanceModel:
        model = cls(len(tried), fingerprint)
        model.tried = torch.tensor(tried, dtype=torch.float64)
        model.accepted = torch.tensor(accepted, dtype=torch.float64)
        return model

    def discounted(self, observations: float) -> AcceptanceModel:
        """This model with every cell's counts scaled down to at most `observations` tries, its rates kept: a prior
        that the evidence of a run soon outweighs."""
        scale = (observations / self.tried.clamp(min=observations)).clamp(max=1.0)
        model = AcceptanceModel(self.tried.shape[0], self.fingerprint)
        model.tried, model.accepted = self.tried * scale, self.accepted * scale
        return model
