"""The trained drafters the experiments compare, loaded once per process and reused across runs."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from drafters import BlockDiffusionDrafter, ChainDrafter, Drafter, ModelDrafter, PromptLookupDrafter
from drafters.ar_baseline import load_ar_model
from drafters.ngram_store import NgramStore
from drafters.training.train import DEFAULT_WORK_DIR
from hybrid.default import (
    DRAFTER_DIR,
    DRAFTER_LOOKUP_MAX_NGRAM,
    DRAFTER_LOOKUP_NGRAM,
    DRAFTER_LOOKUP_TOKENS,
    DRAFTER_NGRAM_DIR,
    DRAFTER_PREFER_STORE,
    default_drafter,
    shipped_block_size,
)

AR_DIR = DEFAULT_WORK_DIR / "ar-drafter"
# What `python -m drafters.training.train` writes by default: a block drafter trained (or fine-tuned) here.
TRAINED_BLOCK_DIR = DEFAULT_WORK_DIR / "block-drafter"
MAX_DRAFTED = shipped_block_size() - 1  # the shipped drafter's block minus its anchor
LONG_LOOKUP_TOKENS = DRAFTER_LOOKUP_TOKENS  # what lookup may propose past the block with `long_lookup` (16)


@lru_cache(maxsize=None)
def block(
    model,
    drafted: int,
    lookup: bool = False,
    steps: int = 1,
    path: Path = DRAFTER_DIR,
    long_lookup: bool = False,
    store: bool = False,
    max_nodes: int | None = None,
) -> Drafter:
    """The shipped block-diffusion drafter proposing up to `drafted` tokens (block = anchor + drafted), with
    `steps` denoising passes. With `lookup`, a context match (n-grams 1..3) gives the block's first positions; with
    `long_lookup`, the block stays the trained one and a match may propose up to `drafted` tokens past it. With
    `store`, the shipped n-gram store continues the lookup (or, without one, stands in for it). With `max_nodes`,
    the block model proposes token trees of that many nodes over its whole trained block."""
    block_size = min(drafted, MAX_DRAFTED) + 1 if long_lookup else drafted + 1
    block_drafter = BlockDiffusionDrafter.from_pretrained(
        path, model, block_size=block_size if max_nodes is None else None, steps=steps, max_nodes=max_nodes
    )
    if not (lookup or long_lookup or store):
        return block_drafter
    match = PromptLookupDrafter(
        min_ngram=DRAFTER_LOOKUP_NGRAM if lookup or long_lookup else 0,
        max_ngram=3,
        max_draft_len=drafted if long_lookup else block_drafter.max_draft_len,
        ngram_store=ngram_store() if store else None,
        verifier=model,
    )
    return ChainDrafter([match, block_drafter])


@lru_cache(maxsize=None)
def default(
    model,
    drafted: int = DRAFTER_LOOKUP_TOKENS,
    block_dir: Path = DRAFTER_DIR,
    steps: int | None = None,
    branch: int | None = None,
    refill_below: float | None = None,
) -> ChainDrafter:
    """`hybrid.load_default()`'s drafter (the block model, the longest context match up to 32 tokens and the store),
    proposing up to `drafted` tokens (16 by default); with `block_dir`, another block checkpoint in its place, with
    `steps`, another most denoising passes, with `branch` or `refill_below`, another of those (`drafters.ChainDrafter`)."""
    if not (Path(block_dir) / "drafter_config.json").is_file():
        raise FileNotFoundError(
            f"no block drafter in {block_dir}: train one with `python -m drafters.training.train --out {block_dir}`"
        )
    return default_drafter(
        model,
        ngram_store=ngram_store(),
        lookup_tokens=drafted,
        block_size=min(drafted, MAX_DRAFTED) + 1,
        block_dir=block_dir,
        **({} if steps is None else {"steps": steps}),
        **({} if branch is None else {"branch": branch}),
        **({} if refill_below is None else {"refill_below": refill_below}),
    )


@lru_cache(maxsize=None)
def default_with(model, max_nodes: int | None, drafted: int = DRAFTER_LOOKUP_TOKENS) -> ChainDrafter:
    """The default drafter with its block model proposing trees of `max_nodes` nodes (None: chains) and its lookup
    up to `drafted` tokens."""
    return default_drafter(model, ngram_store=ngram_store(), lookup_tokens=drafted, max_nodes=max_nodes)


def match_store(drafted: int) -> PromptLookupDrafter:
    """The default's lookup without its model: the longest context match, the store, and the store's preference."""
    return PromptLookupDrafter(
        max_ngram=DRAFTER_LOOKUP_MAX_NGRAM,
        max_draft_len=drafted,
        ngram_store=ngram_store(),
        prefer_store=DRAFTER_PREFER_STORE,
    )


@lru_cache(maxsize=None)
def ngram_store() -> NgramStore:
    """The shipped n-gram store of the verifier's training answers (loaded once)."""
    return NgramStore.from_pretrained(DRAFTER_NGRAM_DIR)


@lru_cache(maxsize=None)
def ar(model, drafted: int, path: Path = AR_DIR) -> ModelDrafter:
    """The 1-layer AR baseline (same data, pipeline and trainable budget as the block drafter)."""
    return ModelDrafter(load_ar_model(path, model), max_draft_len=drafted)
