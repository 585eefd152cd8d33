"""Verify the prefix of a draft whose nodes are each likely enough to be reached."""

from __future__ import annotations

from drafters.base import Draft
from schedulers.calibrated import CalibratedScheduler, reach_probabilities


class ConfidenceScheduler(CalibratedScheduler):
    """Verify the longest prefix of nodes each of which is reached (its path accepted whole) with probability at
    least `threshold`."""

    def __init__(self, threshold: float = 0.3, calibration: str | None = None):
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold={threshold!r} must be a probability in [0, 1]")
        super().__init__(calibration)
        self.threshold = threshold

    def select(self, drafts: list[Draft]) -> list[int]:
        return [self._reached_prefix(draft) for draft in drafts]

    def _reached_prefix(self, draft: Draft) -> int:
        k = 0
        for reach in reach_probabilities(self.acceptance.predict(draft), draft.parent_list()):
            if reach < self.threshold:
                break
            k += 1
        return max(k, 1) if len(draft) else 0  # always verify one: keeps the calibration learning
