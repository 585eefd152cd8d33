"""The arithmetic the cost-aware scheduler's estimates share: running means kept per batch size, the nearest batch
size measured, and a step's expected tokens per second."""

from __future__ import annotations


def fold(stats: list, *values: float, moving: float) -> None:
    """stats = [steps, mean, ...]: one more step's values, in a mean for the first 1 / moving steps, then a moving one
    (moving = 0: a plain mean)."""
    stats[0] += 1
    weight = max(1 / stats[0], moving)
    for i, value in enumerate(values, start=1):
        stats[i] += weight * (value - stats[i])


def nearest_size(sizes, rows: int) -> int:
    """The batch size among `sizes` nearest `rows`, the smaller of two as near."""
    return min(sizes, key=lambda r: (abs(r - rows), r))


def rate(option: tuple[float, float]) -> float:
    """Tokens per second of a step expected to emit `tokens` in `seconds` (an option: (tokens, seconds))."""
    tokens, seconds = option
    return tokens / seconds if seconds > 0 else float("inf")
