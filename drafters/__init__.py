"""Drafters propose tokens; the verifier decides. One file per drafter, the interface in `base.py`.

The block-diffusion drafter is `block_diffusion.py`; its training is the `training` package, which no
drafter imports. `ngram_store.py` is the table of what the verifier said next in its training answers, which
continues the lookup match of the block drafter (and of `PromptLookupDrafter`, given one).
"""

from drafters.base import Draft, DraftContext, Drafter, DraftError
from drafters.block_diffusion import BlockDiffusionDrafter
from drafters.model_drafter import ModelDrafter
from drafters.oracle import OracleDrafter
from drafters.prompt_lookup import PromptLookupDrafter

__all__ = ["BlockDiffusionDrafter", "Draft", "DraftContext", "DraftError", "Drafter", "ModelDrafter", "OracleDrafter",
           "PromptLookupDrafter"]
