"""Schedulers by name, for command lines: heuristic, fixed, fixed-K, confidence, confidence-T, cost-aware."""

from __future__ import annotations

import re

from schedulers.base import Scheduler
from schedulers.confidence import ConfidenceScheduler
from schedulers.cost_aware import CostAwareScheduler
from schedulers.fixed import FixedScheduler
from schedulers.heuristic import HeuristicScheduler

NAMES_HELP = "heuristic, fixed (k = block size), fixed-K, confidence, confidence-T (threshold T), cost-aware"


def check_scheduler_name(name: str) -> None:
    """Raise a clear error for a name `make_scheduler` would not understand (call it before loading models)."""
    if name in ("heuristic", "fixed", "confidence", "cost-aware"):
        return
    if match := re.fullmatch(r"fixed-(-?\d+)", name):
        if int(match[1]) < 1:
            raise ValueError(
                f"scheduler {name}: k={match[1]} must be >= 1 (how many drafted tokens each step verifies)"
            )
        return
    if match := re.fullmatch(r"confidence-(-?[\d.]+)", name):
        if not 0 <= float(match[1]) <= 1:
            raise ValueError(f"scheduler {name}: threshold {match[1]} must be a probability in [0, 1]")
        return
    raise ValueError(f"unknown scheduler {name!r}: use {NAMES_HELP}")


def fixed_k(name: str, block_size: int | None) -> int | None:
    """The k a fixed scheduler's name verifies ("fixed": the block size, "fixed-K": K); None for any other name."""
    if name == "fixed":
        return block_size
    return int(name.split("-", 1)[1]) if name.startswith("fixed-") else None


def make_scheduler(name: str, block_size: int) -> Scheduler:
    check_scheduler_name(name)
    if name == "heuristic":
        return HeuristicScheduler()
    if name == "cost-aware":
        return CostAwareScheduler()
    if (k := fixed_k(name, block_size)) is not None:
        return FixedScheduler(k)
    return ConfidenceScheduler(float(name.split("-", 1)[1])) if "-" in name else ConfidenceScheduler()
