"""The trained drafters the experiments compare, loaded once per process and reused across runs."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from drafters import BlockDiffusionDrafter, ModelDrafter
from drafters.ar_baseline import load_ar_model
from drafters.train import DEFAULT_WORK_DIR
from hybrid.default import DRAFTER_DIR, DRAFTER_LOOKUP_NGRAM, shipped_block_size

AR_DIR = DEFAULT_WORK_DIR / "ar-drafter"
MAX_DRAFTED = shipped_block_size() - 1  # the shipped drafter's block minus its anchor
LONG_LOOKUP_TOKENS = 15  # what a lookup match may propose past the block with `long_lookup`


@lru_cache(maxsize=None)
def block(model, drafted: int, lookup: bool = False, steps: int = 1, path: Path = DRAFTER_DIR,
          long_lookup: bool = False) -> BlockDiffusionDrafter:
    """The shipped block-diffusion drafter proposing up to `drafted` tokens (block = anchor + drafted), with
    `steps` denoising passes. With `long_lookup`, the block stays the trained one and a lookup match may propose
    up to `drafted` tokens past it."""
    return BlockDiffusionDrafter.from_pretrained(
        path, model, block_size=min(drafted, MAX_DRAFTED) + 1 if long_lookup else drafted + 1, steps=steps,
        lookup_ngram=DRAFTER_LOOKUP_NGRAM if lookup or long_lookup else 0, lookup_tokens=drafted if long_lookup else None,
    )  # fmt: skip


@lru_cache(maxsize=None)
def ar(model, drafted: int, path: Path = AR_DIR) -> ModelDrafter:
    """The 1-layer AR baseline (same data, pipeline and trainable budget as the block drafter)."""
    return ModelDrafter(load_ar_model(path, model), max_draft_len=drafted)
