"""What one `generate` call did, step by step. Every figure derives from the per-step lists."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, TypeVar

import torch

T = TypeVar("T")


class Stopwatch:
    """Wall-clock laps: `lap()` returns the seconds since the last lap (or the start), `total()` since the start."""

    def __init__(self):
        self.start = self.last = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        seconds, self.last = now - self.last, now
        return seconds

    def total(self) -> float:
        return time.perf_counter() - self.start


def timed(call: Callable[[], T], device: torch.device | str | None = None) -> tuple[T, float]:
    """(call(), its wall-clock seconds). The commands that compare decoders time every one through this, around
    the whole `generate` call (argument checks, cache set-up, decoding), so no method's set-up is left off its
    clock. On CUDA the clock stops when the GPUs have finished the call's work, not when the host has queued it."""
    on_cuda = device is not None and torch.device(device).type == "cuda"
    _synchronize(on_cuda)
    start = time.perf_counter()
    result = call()
    _synchronize(on_cuda)
    return result, time.perf_counter() - start


def _synchronize(on_cuda: bool) -> None:
    for index in range(torch.cuda.device_count() if on_cuda else 0):  # every GPU: a device_map spreads the layers
        torch.cuda.synchronize(index)


@dataclass
class GenerationStats:
    """Per verifier forward ("step"); step 0 is the prefill, which drafts nothing and emits one token.

    drafted:  tokens (tree nodes) the verifier scored beyond the pending one.
    accepted: how many of them the acceptance rule kept (one path of a tree).
    emitted:  tokens appended by the step: accepted + 1 (the verifier's own correction or bonus
              token), fewer only on the last step when EOS or a stopping criterion cut it short.
    passes:   per drafting step (not the prefill), the denoising passes the scheduler chose for it where the
              stages it ran included one that takes several (a block model; it drafts where the others left
              room), else 0.
    Times are seconds of wall clock: drafting, verification (forward + acceptance), the prefill, and
    the whole call.
    """

    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    emitted: list[int] = field(default_factory=list)
    passes: list[int] = field(default_factory=list)
    prefill_time: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0
    schedule_time: float = 0.0
    total_time: float = 0.0

    def record(self, drafted: int, accepted: int, emitted: int) -> None:
        self.drafted.append(drafted)
        self.accepted.append(accepted)
        self.emitted.append(emitted)

    @property
    def verifier_forwards(self) -> int:
        return len(self.emitted)

    @property
    def new_tokens(self) -> int:
        return sum(self.emitted)

    @property
    def tau(self) -> float:
        """Mean tokens emitted per verifier forward (1.0 for plain AR decoding)."""
        return self.new_tokens / max(self.verifier_forwards, 1)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.total_time if self.total_time > 0 else float("nan")

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted over the whole call (nan when nothing was drafted)."""
        drafted = sum(self.drafted)
        return sum(self.accepted) / drafted if drafted else float("nan")

    @property
    def mean_passes(self) -> float:
        """Mean denoising passes over the steps that ran a multi-pass stage (nan where none did)."""
        ran = [p for p in self.passes if p]
        return sum(ran) / len(ran) if ran else float("nan")

    @classmethod
    def combined(cls, parts: list[GenerationStats]) -> GenerationStats:
        """The stats of several calls (e.g. the rows of a batch) as one: steps concatenated, times summed."""
        total = cls()
        for part in parts:
            total.drafted += part.drafted
            total.accepted += part.accepted
            total.emitted += part.emitted
            total.passes += part.passes
            for name in ("prefill_time", "draft_time", "verify_time", "schedule_time", "total_time"):
                setattr(total, name, getattr(total, name) + getattr(part, name))
        return total

    def summary(self) -> str:
        return (
            f"{self.new_tokens} tokens in {self.verifier_forwards} verifier forwards: tau {self.tau:.2f}, "
            f"{self.tokens_per_second:.1f} tok/s (draft {self.draft_time:.2f}s, verify {self.verify_time:.2f}s, "
            f"total {self.total_time:.2f}s)"
        )
