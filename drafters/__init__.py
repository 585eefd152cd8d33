"""Drafters propose tokens; the verifier decides. One file per drafter, the interface in `base.py`."""

from drafters.base import Draft, DraftContext, Drafter, DraftError
from drafters.model_drafter import ModelDrafter
from drafters.oracle import OracleDrafter
from drafters.prompt_lookup import PromptLookupDrafter

__all__ = ["Draft", "DraftContext", "DraftError", "Drafter", "ModelDrafter", "OracleDrafter", "PromptLookupDrafter"]
