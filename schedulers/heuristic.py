"""HF assisted generation's draft-length rule."""

from __future__ import annotations

import dataclasses

from drafters.base import Draft
from schedulers.base import Scheduler, StepPlan
from schedulers.fixed import check_k


class HeuristicScheduler(Scheduler):
    """+2 after a fully accepted draft, -1 otherwise (never below 1), row by row."""

    def __init__(self, initial: int = 4):
        check_k(initial, initial if isinstance(initial, int) and initial >= 1 else 1)
        self.initial = initial

    def start(self, drafter, **call) -> None:
        super().start(drafter, **call)
        self.k = min(self.initial, self.max_nodes)

    def plan_step(self, steps_left: list[float]) -> StepPlan:
        return dataclasses.replace(super().plan_step(steps_left), max_nodes=self.k)

    def observe(
        self, drafts: list[Draft], accepted: list[list[int]], draft_times: list[float], verify_time: float
    ) -> None:
        for draft, kept in zip(drafts, accepted):
            if len(draft) == 0:
                continue  # the drafter had nothing to say: no evidence either way
            whole = len(kept) == draft.depth()  # the walk reached the end of the draft
            self.k = min(self.k + 2, self.max_nodes) if whole else max(1, self.k - 1)
