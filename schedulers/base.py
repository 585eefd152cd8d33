"""The scheduler contract: what the engine asks a scheduler each step, and the checks of its answers.

A scheduler decides what the drafter is asked for and how many drafted tokens the verifier scores; it never
affects correctness. For each `generate` call the engine calls `start`, then at every step `plan` (before
drafting), `choose` (after it) and `observe` (after verifying), then `finish`.
"""

from __future__ import annotations

from dataclasses import dataclass

from drafters.base import Draft


def unpadded(m: int, rows: int = 1) -> int:
    return m


@dataclass(frozen=True)
class StepPlan:
    """What one step asks of the drafter."""

    max_nodes: int  # the most nodes (tokens) a row's draft may hold; the engine caps it at the drafter's node_budget
    denoising_steps: int  # passes a multi-pass drafter runs, 1..its max_steps
    drafting_stages: int  # how many of the drafter's stages (`Drafter.stages`, cheapest first) run; 0 drafts nothing


class Scheduler:
    """Verifies everything the drafter proposes. A draft is a chain or a token tree (`drafters.Draft`); "tokens"
    below are its nodes, best first, and what a row verifies is a prefix of them.

    A subclass overrides what it decides: `plan_step` (what to ask the drafter for) and `select` (how many of each
    row's nodes to verify), whose answers `plan` and `choose` check; `observe` to learn from each step; `start`
    (calling this one's) and `finish` for what it keeps per call."""

    # ------------------------------------------------------------------ the engine's calls

    def start(self, drafter, *, model=None, decoding: dict | None = None, verify_width=unpadded) -> None:
        """A `generate` call begins: `drafter` proposes (at most `drafter.node_budget` nodes, at most
        `drafter.max_draft_len` deep), `model` verifies.

        decoding: how the verifier chooses its tokens in this call, {} greedily, else the sampling settings that
        shape the distribution a drafted token must match (temperature, top_k, top_p, ...; "acceptance": "rejection"
        under speculative sampling's rule).
        verify_width: a verify of m tokens in each of `rows` rows runs a forward `verify_width(m, rows)` positions
        wide. The static-shape path pads to a few widths (`verifiers.verifier.static_width`), so drafts up to the
        padded width cost nothing more to verify; an eager one pads by a position where the machine measured that
        cheaper (`verifiers.verifier.cheaper_width`); otherwise it is m. Cost-aware schedulers charge the padded
        width."""
        self.decoding = dict(decoding or {})
        self.verify_width = verify_width
        self.max_draft_len = drafter.max_draft_len
        self.max_nodes = drafter.node_budget
        self.max_steps = getattr(drafter, "max_steps", 1)
        self.num_stages = len(drafter.stages)
        self.pass_stages = drafter.pass_stages
        self.drafter_name = type(drafter).__name__  # for the checks' errors (the drafter itself may hold the model)

    def plan(self, steps_left: list[float]) -> StepPlan:
        """Before drafting: what to ask the drafter for. `steps_left`: the rows about to be decoded, in batch order,
        each as the steps it is expected to need still (tokens it may still emit over its tokens per step so far)."""
        plan = self.plan_step(steps_left)
        name = type(self).__name__
        if not 1 <= plan.denoising_steps <= self.max_steps:
            raise ValueError(f"{name}.denoising_steps returned {plan.denoising_steps}; expected 1..{self.max_steps}")
        if not 0 <= plan.drafting_stages <= self.num_stages:
            raise ValueError(
                f"{name}.drafting_stages returned {plan.drafting_stages}; expected 0..{self.num_stages} "
                f"(how many of {self.drafter_name}'s stages to run)"
            )
        return plan

    def choose(self, drafts: list[Draft]) -> list[int]:
        """After drafting: how many of each row's drafted nodes to verify in this step's forward."""
        ks = self.select(drafts)
        for k, draft in zip(ks, drafts):
            if not 0 <= k <= len(draft):
                raise ValueError(f"{type(self).__name__}.select returned {k}; expected 0..{len(draft)}")
        return ks

    def observe(
        self, drafts: list[Draft], accepted: list[list[int]], draft_times: list[float], verify_time: float
    ) -> None:
        """After verifying, learn from the step: row r verified drafts[r] (cut to what `choose` said) and kept its
        nodes accepted[r] (a path from the pending token: a chain's first len(accepted[r])); drafting row r took
        draft_times[r] seconds and the one forward that verified every row `verify_time`. A batch verifies every
        row at the widest row's width, 1 + max(k): padding a shorter row's draft to it costs nothing more.
        Default: nothing."""

    def finish(self, emitted: list[int], seconds: float) -> None:
        """After the call's last step: the tokens each row emitted after its first (which the prefill gives), and the
        seconds its steps took, drafting and verifying. Default: nothing."""

    # ------------------------------------------------------------------ hooks

    def plan_step(self, steps_left: list[float]) -> StepPlan:
        """What `plan` returns once checked. Default: everything the drafter offers."""
        return StepPlan(self.max_nodes, self.max_steps, self.num_stages)

    def select(self, drafts: list[Draft]) -> list[int]:
        """What `choose` returns once checked: per row, 0..len(its draft). Default: all of each."""
        return [len(draft) for draft in drafts]
