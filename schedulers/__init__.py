"""Draft-length policies: how many drafted tokens are worth a verifier's time."""

from schedulers.base import FixedScheduler, HeuristicScheduler, Scheduler

__all__ = ["FixedScheduler", "HeuristicScheduler", "Scheduler"]
