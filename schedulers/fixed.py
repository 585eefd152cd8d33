"""The fixed baseline: the same draft length at every step."""

from __future__ import annotations

from schedulers.base import Scheduler, StepPlan


def check_k(k: int, max_nodes: int) -> None:
    if not isinstance(k, int) or not 1 <= k <= max_nodes:
        raise ValueError(f"draft length k={k!r} must be an int in 1..{max_nodes} (the drafter's node_budget)")


class FixedScheduler(Scheduler):
    """Always ask for `k` tokens, drafted with `steps` denoising passes (None: the drafter's own number)."""

    def __init__(self, k: int, steps: int | None = None):
        check_k(k, k if isinstance(k, int) and k >= 1 else 1)
        if steps is not None and (not isinstance(steps, int) or steps < 1):
            raise ValueError(f"steps={steps!r} must be a positive int (denoising passes per draft)")
        self.k, self.steps = k, steps

    def start(self, drafter, **call) -> None:
        check_k(self.k, drafter.node_budget)
        super().start(drafter, **call)
        if self.steps is not None and self.steps > self.max_steps:
            raise ValueError(
                f"steps={self.steps} but {type(drafter).__name__} runs at most {self.max_steps} "
                "denoising passes (its max_steps)"
            )

    def plan_step(self, steps_left: list[float]) -> StepPlan:
        return StepPlan(self.k, self.max_steps if self.steps is None else self.steps, self.num_stages)
