"""Schedulers decide how many drafted tokens the verifier scores each step. They never affect correctness."""

from __future__ import annotations

from drafters.base import Draft


def unpadded(m: int, rows: int = 1) -> int:
    return m


class Scheduler:
    """Each step the engine asks `max_draft_length()`, `denoising_steps()` and `drafting_stages(rows)` before
    drafting, `select(draft)` after it, and reports the outcome to `update`. `reset` starts a new `generate` call and
    `finish` ends it. A draft is a chain or a token tree
    (`drafters.Draft`); "tokens" below are its nodes, best first, and a selection is a prefix of them."""

    verify_width = staticmethod(unpadded)  # see `set_verify_width`

    def reset(self, drafter, model=None) -> None:
        """Start a generation: `drafter` proposes (at most `drafter.node_budget` nodes, at most
        `drafter.max_draft_len` deep), `model` verifies."""
        self.max_draft_len = drafter.max_draft_len
        self.max_nodes = drafter.node_budget
        self.max_steps = getattr(drafter, "max_steps", 1)
        self.num_stages = len(drafter.stages)
        self.pass_stages = drafter.pass_stages

    def set_verify_width(self, width) -> None:
        """Told by the engine after `reset`: a verify of m tokens in each of `rows` rows runs a forward
        `width(m, rows)` positions wide. The static-shape path pads to a few widths (`verifiers.verifier
        .static_width`), so drafts up to the padded width cost nothing more to verify; an eager one pads by a
        position where the machine measured that cheaper (`verifiers.verifier.cheaper_width`); otherwise
        width(m, rows) = m. Cost-aware schedulers charge the padded width."""
        self.verify_width = width

    def set_decoding(self, decoding: dict) -> None:
        """Told before `reset`: how the verifier chooses its tokens in the coming call, {} for greedily, else the
        sampling settings that shape the distribution a drafted token must match (temperature, top_k, top_p, ...;
        "acceptance": "rejection" under speculative sampling's rule). Default: ignored."""

    def set_rows(self, steps_left: list[float]) -> None:
        """Told by the engine before each step: the rows about to be decoded, in batch order, each as the steps it is
        expected to need still (tokens it may still emit over its tokens per step so far). Default: ignored."""

    def finish(self, emitted: list[int], seconds: float) -> None:
        """Told by the engine after a call's last step: the tokens each row emitted after its first (which the
        prefill gives), and the seconds its steps took, drafting and verifying. Default: ignored."""

    def max_draft_length(self) -> int:
        """How many tokens (tree nodes) to ask the drafter for. Default: as many as it drafts."""
        return self.max_nodes

    def denoising_steps(self) -> int:
        """How many denoising passes the drafter runs this step (1..its max_steps). Default: all of them."""
        return self.max_steps

    def drafting_stages(self, rows: int) -> int:
        """How many of the drafter's stages (`Drafter.stages`, cheapest first) draft this step for the `rows` rows
        being decoded: 0 drafts nothing. Default: all of them."""
        return self.num_stages

    def select(self, draft: Draft) -> int:
        """How many of the drafted tokens to verify (a prefix of the draft). Default: all of them."""
        return len(draft)

    def update(self, draft: Draft, accepted: list[int], draft_time: float, verify_time: float) -> None:
        """Learn from a step: the verifier scored `draft` and kept its nodes `accepted` (a path from the pending
        token: a chain's first len(accepted)); drafting took `draft_time` seconds and verification `verify_time`."""

    # A batch verifies every row in one forward of width 1 + max(k): padding a row's draft to that
    # width costs nothing extra. The defaults treat rows one by one, each charged its share of the forward.

    def select_batch(self, drafts: list[Draft]) -> list[int]:
        """How many of each row's drafted tokens to verify in this step's batched forward."""
        return [self.select(draft) if len(draft) else 0 for draft in drafts]

    def update_batch(
        self, drafts: list[Draft], accepted: list[list[int]], draft_times: list[float], verify_time: float
    ) -> None:
        """Learn from a batched step: row r verified drafts[r] and kept its nodes accepted[r]; one forward took
        `verify_time`."""
        for draft, kept, draft_time in zip(drafts, accepted, draft_times):
            self.update(draft, kept, draft_time, verify_time / len(drafts))


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

    def reset(self, drafter, model=None) -> None:
        check_k(self.k, drafter.node_budget)
        super().reset(drafter, model)
        if self.steps is not None and self.steps > self.max_steps:
            raise ValueError(
                f"steps={self.steps} but {type(drafter).__name__} runs at most {self.max_steps} "
                "denoising passes (its max_steps)"
            )

    def max_draft_length(self) -> int:
        return self.k

    def denoising_steps(self) -> int:
        return self.max_steps if self.steps is None else self.steps


class HeuristicScheduler(Scheduler):
    """HF assisted generation's rule: +2 after a fully accepted draft, -1 otherwise (never below 1)."""

    def __init__(self, initial: int = 4):
        check_k(initial, initial if isinstance(initial, int) and initial >= 1 else 1)
        self.initial = initial

    def reset(self, drafter, model=None) -> None:
        super().reset(drafter, model)
        self.k = min(self.initial, self.max_nodes)

    def max_draft_length(self) -> int:
        return self.k

    def update(self, draft: Draft, accepted: list[int], draft_time: float, verify_time: float) -> None:
        if len(draft) == 0:
            return  # the drafter had nothing to say: no evidence either way
        whole = len(accepted) == draft.depth()  # the walk reached the end of the draft
        self.k = min(self.k + 2, self.max_nodes) if whole else max(1, self.k - 1)
