"""Draft-length policies: how many drafted tokens are worth a verifier's time."""

from schedulers.adaptive import ConfidenceScheduler, CostAwareScheduler
from schedulers.base import FixedScheduler, HeuristicScheduler, Scheduler
from schedulers.calibration import AcceptanceModel
from schedulers.cost_model import VerifyCostModel

__all__ = [
    "AcceptanceModel",
    "ConfidenceScheduler",
    "CostAwareScheduler",
    "FixedScheduler",
    "HeuristicScheduler",
    "Scheduler",
    "VerifyCostModel",
]
