"""The trained drafters the experiments compare, loaded once per process and reused across runs."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from drafters import BlockDiffusionDrafter, ModelDrafter
from drafters.train import DEFAULT_WORK_DIR
from hybrid.default import DRAFTER_DIR, DRAFTER_LOOKUP_NGRAM, shipped_block_size

AR_DIR = DEFAULT_WORK_DIR / "ar-drafter"
MAX_DRAFTED = shipped_block_size() - 1  # the shipped drafter's block minus its anchor


@lru_cache(maxsize=None)
def block(model, drafted: int, lookup: bool = False, path: Path = DRAFTER_DIR) -> BlockDiffusionDrafter:
    """The shipped block-diffusion drafter proposing up to `drafted` tokens (block = anchor + drafted)."""
    return BlockDiffusionDrafter.from_pretrained(path, model, block_size=drafted + 1,
                                                 lookup_ngram=DRAFTER_LOOKUP_NGRAM if lookup else 0)


@lru_cache(maxsize=None)
def ar(model, drafted: int, path: Path = AR_DIR) -> ModelDrafter:
    """The 1-layer AR baseline (same data, pipeline and trainable budget as the block drafter)."""
    from transformers import AutoModelForCausalLM

    if not (path / "config.json").exists():
        raise FileNotFoundError(f"no AR baseline drafter in {path}: train it with `python -m drafters.train --arch ar`")
    return ModelDrafter(AutoModelForCausalLM.from_pretrained(path).eval(), max_draft_len=drafted)
