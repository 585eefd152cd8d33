"""Drafters propose tokens; the verifier decides. One file per drafter, the interface in `base.py`.

The block-diffusion drafter is `block_diffusion.py`, and `dflash.py` runs drafters in z-lab's published DFlash
format; their training is the `training` package, which no drafter imports. `ngram_store.py` is the table of
what the verifier said next in its training answers, which continues the context match of `PromptLookupDrafter`,
given one; `online_store.py` keeps what the verifier said earlier in the process, for the same lookup.
`composite.py` chains drafters: the default is a lookup whose draft the block drafter fills in.
"""

from drafters.base import Draft, DraftContext, Drafter, DraftError
from drafters.block_diffusion import BlockDiffusionDrafter
from drafters.composite import ChainDrafter
from drafters.dflash import DFlashDrafter
from drafters.model_drafter import ModelDrafter
from drafters.oracle import OracleDrafter
from drafters.prompt_lookup import PromptLookupDrafter

__all__ = [
    "BlockDiffusionDrafter",
    "ChainDrafter",
    "DFlashDrafter",
    "Draft",
    "DraftContext",
    "DraftError",
    "Drafter",
    "ModelDrafter",
    "OracleDrafter",
    "PromptLookupDrafter",
]
