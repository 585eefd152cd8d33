"""Schedulers decide how many drafted tokens the verifier scores each step. They never affect correctness."""

from __future__ import annotations

from drafters.base import Draft


class Scheduler:
    """Each step the engine asks `max_draft_length()` before drafting, `select(draft)` after it, and
    reports the outcome to `update`. `reset` starts a new `generate` call."""

    def reset(self, max_draft_len: int) -> None:
        """Start a generation with a drafter that proposes at most `max_draft_len` tokens."""
        self.max_draft_len = max_draft_len

    def max_draft_length(self) -> int:
        """How many tokens to ask the drafter for."""
        raise NotImplementedError

    def select(self, draft: Draft) -> int:
        """How many of the drafted tokens to verify (a prefix of the draft). Default: all of them."""
        return len(draft)

    def update(self, drafted: int, accepted: int) -> None:
        """Learn from a step: `drafted` tokens were verified and the first `accepted` were kept."""


def check_k(k: int, max_draft_len: int) -> None:
    if not isinstance(k, int) or not 1 <= k <= max_draft_len:
        raise ValueError(f"draft length k={k!r} must be an int in 1..{max_draft_len} (the drafter's max_draft_len)")


class FixedScheduler(Scheduler):
    """Always ask for `k` tokens."""

    def __init__(self, k: int):
        check_k(k, k if isinstance(k, int) and k >= 1 else 1)
        self.k = k

    def reset(self, max_draft_len: int) -> None:
        check_k(self.k, max_draft_len)
        super().reset(max_draft_len)

    def max_draft_length(self) -> int:
        return self.k


class HeuristicScheduler(Scheduler):
    """HF assisted generation's rule: +2 after a fully accepted draft, -1 otherwise (never below 1)."""

    def __init__(self, initial: int = 4):
        check_k(initial, initial if isinstance(initial, int) and initial >= 1 else 1)
        self.initial = initial

    def reset(self, max_draft_len: int) -> None:
        super().reset(max_draft_len)
        self.k = min(self.initial, max_draft_len)

    def max_draft_length(self) -> int:
        return self.k

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return  # the drafter had nothing to say: no evidence either way
        self.k = min(self.k + 2, self.max_draft_len) if accepted == drafted else max(1, self.k - 1)
