"""What a step of several rows costs in seconds, drafting and verifying, as the cost-aware scheduler estimates it."""

from __future__ import annotations

from schedulers.base import unpadded
from schedulers.cost_model import VerifyCostModel
from schedulers.estimates import fold, nearest_size


class StepCosts:
    """Seconds of a step of `rows` rows. Its verify: a `VerifyCostModel` measured on this device (`verify_costs`,
    kept for the life of the scheduler) at the width the verifier pads to (`verify_width`, told at each call's
    start). Its drafting with the first n stages, D_n, and the verifies the steps that ran n stages needed, V_n:
    running means per batch size, learned per (drafter, verifier) pair."""

    def __init__(self, costs: dict[int, float] | None):
        self.verify_costs = VerifyCostModel(costs) if costs is not None else None
        self.verify_width = unpadded
        self.new_pair(0)

    def new_pair(self, num_stages: int) -> None:
        self.num_stages = num_stages
        self.draft_cost: dict[int, list[list[float]]] = {}  # rows -> n stages -> [steps, seconds]
        self.stage_verify: dict[int, list[list[float]]] = {}  # rows -> n stages -> [steps, verify seconds]

    def verify_seconds(self, rows: int, width: int) -> float:
        return self.verify_costs.step_cost(rows, self.verify_width(width, rows))

    def draft_seconds(self, rows: int, stages: int) -> float:
        """D_n: mean seconds of a step of `rows` rows drafting with `stages` stages; where none was timed at this
        batch size, the nearest one timed, scaled by the rows (a drafter's forward grows with them); 0 if none."""
        if stages == 0:
            return 0.0
        timed = [r for r, cost in self.draft_cost.items() if cost[stages][0]]
        if not timed:
            return 0.0
        nearest = nearest_size(timed, rows)
        return self.draft_cost[nearest][stages][1] * rows / nearest

    def stage_verify_seconds(self, rows: int, n: int, width: float) -> float:
        """V_n: the mean verify seconds of steps of `rows` rows that ran n stages, each costed at the width of the
        first n stages' nodes it verified; where none was measured, the cost at the mean width. The widths a lookup's
        steps verify are far apart (1 where nothing matched, 16 where a passage repeats), and a verify's cost is
        concave in its width: costed at the mean width, such a stage looks dearer than its steps were."""
        measured = self.stage_verify.get(rows)
        if measured is not None and measured[n][0]:
            return measured[n][1]
        return self.verify_seconds(rows, max(1, round(width)))

    def observe_verify(self, rows: int, width: int, seconds: float) -> None:
        """A verify of `rows` rows, `width` positions wide before padding, took `seconds`."""
        self.verify_costs.observe_step(rows, self.verify_width(width, rows), seconds)

    def observe_draft(self, rows: int, stages: int, seconds: float, moving: float) -> None:
        """A step of `rows` rows drafted with `stages` stages in `seconds`."""
        if seconds > 0:  # a step with no room left to draft says nothing of what drafting costs
            cost = self.draft_cost.setdefault(rows, [[0, 0.0] for _ in range(self.num_stages + 1)])
            fold(cost[stages], seconds, moving=moving)

    def observe_stage_verifies(self, rows: int, widths: list[int], moving: float) -> None:
        """A step of `rows` rows whose first n stages' nodes needed a verify widths[n - 1] wide, n = 1..stages run."""
        verify = self.stage_verify.setdefault(rows, [[0, 0.0] for _ in range(self.num_stages + 1)])
        for n, width in enumerate(widths, start=1):
            fold(verify[n], self.verify_seconds(rows, width), moving=moving)
