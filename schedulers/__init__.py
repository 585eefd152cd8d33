"""Draft-length policies: how many drafted tokens are worth a verifier's time."""

from schedulers.base import Scheduler, StepPlan
from schedulers.calibration import AcceptanceModel
from schedulers.confidence import ConfidenceScheduler
from schedulers.cost_aware import CostAwareScheduler
from schedulers.cost_model import VerifyCostModel
from schedulers.fixed import FixedScheduler
from schedulers.heuristic import HeuristicScheduler

__all__ = [
    "AcceptanceModel",
    "ConfidenceScheduler",
    "CostAwareScheduler",
    "FixedScheduler",
    "HeuristicScheduler",
    "Scheduler",
    "StepPlan",
    "VerifyCostModel",
]
