"""The embedded default: SmolLM2-135M-Instruct (loaded by `verifiers.embedded`) and the shipped drafter for it."""

from __future__ import annotations

from pathlib import Path

import torch

from schedulers.cost_aware import default_scheduler
from verifiers.cost_table import prepare_kernels
from verifiers.embedded import load_verifier
from verifiers.support import settle_probes

# The shipped block-diffusion drafter for this verifier: rebuilt by `python -m drafters.training.train`.
DRAFTER_DIR = Path(__file__).resolve().parent.parent / "drafters" / "checkpoints" / "smollm2-135m-block"
# Any context match (n >= 1) fills the block's first positions, unless it is a single token and the store is
# confident (DRAFTER_PREFER_STORE below).
DRAFTER_LOOKUP_NGRAM = 1
# The longest context match wins, up to 32 tokens: of several short matches, the one that agrees longest is usually
# the passage being repeated (held-out tau with the store, 15 tokens: 4.155 up to 3, 4.321 up to 8, 4.434 up to 32;
# README, "Longer matches").
DRAFTER_LOOKUP_MAX_NGRAM = 32
# What the verifier said next after each n-gram of its own training answers, continuing the lookup match (or
# standing in for it): rebuilt by `python -m drafters.training.ngram_build` (README, "The n-gram store").
DRAFTER_NGRAM_DIR = DRAFTER_DIR.parent / "smollm2-135m-ngram"
# Lookup (context match + store) may propose up to 16 tokens, past the block of 7: the verifier's answers repeat
# long spans, and the scheduler verifies only what pays (README, "Trained drafters").
DRAFTER_LOOKUP_TOKENS = 16
# A one-token context match gives way to the store's continuation when the store's first share is >= 0.5 (a one-token
# match's first token is accepted about a quarter of the time; held-out tau 4.434 -> 4.550).
DRAFTER_PREFER_STORE = 0.5
# The block model proposes token trees of up to this many nodes (None: chains), at most DRAFTER_BRANCHING children
# per node; the scheduler verifies the best prefix of them.
DRAFTER_TREE_NODES = None
DRAFTER_BRANCHING = 4
# The most denoising passes a block may take; the scheduler chooses 1..DRAFTER_STEPS each step, by measured tokens
# per second (a pass fixes the confident leading run, DRAFTER_THRESHOLD, and re-predicts the rest reading it).
DRAFTER_STEPS = 4
DRAFTER_THRESHOLD = 0.9
# The block model's own first tokens verified beside the lookup's draft, as a second path of a token tree
# (`drafters.ChainDrafter`'s branch; 0: none).
DRAFTER_BRANCH = 0
# The block model redrafts the lookup's draft from before its first store token of share < DRAFTER_REFILL_BELOW, where
# that leaves it room in the block (`drafters.ChainDrafter`'s refill_below; 0: never).
DRAFTER_REFILL_BELOW = 0.0


def shipped_block_size() -> int:
    """Positions per block (anchor included) the shipped drafter was trained with, read from its config."""
    import json

    return json.loads((DRAFTER_DIR / "drafter_config.json").read_text())["block_size"]


def load_default(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, device_map=None):
    """(verifier, tokenizer, drafter): SmolLM2-135M-Instruct and the shipped drafter (context lookup and the
    n-gram store, then the block-diffusion model, on the device of the verifier's last layer when `device_map`
    spreads the verifier).

    float32 is the default because on CPUs it is faster than bfloat16 for this model. The default scheduler's
    one-time verify-cost probe (about 25 s on a 2-core CPU, then cached on disk) runs here, not inside the first
    generate call, and so does what the kernels it chose need made first (`verifiers.cost_table.prepare_kernels`)
    and every probe of the model a call may ask (`verifiers.support.settle_probes`; kept on disk too).
    """
    model, tokenizer = load_verifier(device, dtype, device_map)
    drafter = default_drafter(model, tokenizer)
    default_scheduler(drafter, model).start(drafter, model=model)
    prepare_kernels(model)
    settle_probes(model)
    return model, tokenizer, drafter


def default_drafter(
    model,
    tokenizer=None,
    ngram_store=DRAFTER_NGRAM_DIR,
    lookup_tokens: int = DRAFTER_LOOKUP_TOKENS,
    block_size: int | None = None,
    max_nodes: int | None = DRAFTER_TREE_NODES,
    block_dir=DRAFTER_DIR,
    steps: int = DRAFTER_STEPS,
    branch: int = DRAFTER_BRANCH,
    refill_below: float = DRAFTER_REFILL_BELOW,
):
    """The shipped drafter for the default verifier `model`: the lookup settings above (a context match continued by
    the n-gram store, up to `lookup_tokens`), and where the lookup falls short of the block, the shipped block model
    (`block_size`: its trained size if None; another checkpoint for this verifier with `block_dir`) fills the block
    in, with up to `steps` denoising passes, and with `branch` > 0 its own first `branch` tokens are verified beside the
    lookup's; with `refill_below` > 0 it redrafts the lookup's draft from its first store token of a lower share. The
    experiments pass a loaded `ngram_store`."""
    from drafters import BlockDiffusionDrafter, ChainDrafter, PromptLookupDrafter

    lookup = PromptLookupDrafter(
        max_ngram=DRAFTER_LOOKUP_MAX_NGRAM,
        min_ngram=DRAFTER_LOOKUP_NGRAM,
        max_draft_len=lookup_tokens,
        ngram_store=ngram_store,
        prefer_store=DRAFTER_PREFER_STORE,
        verifier=model,
    )
    block = BlockDiffusionDrafter.from_pretrained(
        block_dir,
        model,
        tokenizer=tokenizer,
        block_size=block_size,
        max_nodes=max_nodes,
        branching=DRAFTER_BRANCHING,
        steps=steps,
        threshold=DRAFTER_THRESHOLD,
    )
    return ChainDrafter([lookup, block], branch=branch, refill_below=refill_below)
