"""The named drafters every experiment command compares. A new drafter plugs in with one DRAFTERS entry.

experiments.acceptance sweeps them by these names (`--drafters lookup,default`); experiments.bench races them
as `hybrid-NAME` next to plain `model.generate` and HF's assisted generation (`oracle` keeps its bare name).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from drafters import Drafter, OracleDrafter, PromptLookupDrafter
from experiments import trained_drafters
from experiments.trained_drafters import LONG_LOOKUP_TOKENS, MAX_DRAFTED


@dataclass(frozen=True)
class DrafterEntry:
    """How to build a drafter for one run: make(block_size, reference, model) where `reference` is the plain
    greedy `model.generate` output for the prompt ([1, prompt + new]; only an oracle reads it) and `model`
    the verifier (drafters conditioned on it need it)."""

    make: Callable[[int, torch.Tensor, object], Drafter]
    default_block_size: int
    max_block_size: int | None = None  # the most it can propose per step (a block model's trained size); None: any
    trained: bool = False  # trained on (or built from) the default verifier's answers: it fits no other


def block_entry(make: Callable[[object, int], Drafter]) -> DrafterEntry:
    """A drafter built around the shipped block model, proposing at most the trained block (minus its anchor)."""
    return DrafterEntry(
        lambda block, reference, model: make(model, block), MAX_DRAFTED, max_block_size=MAX_DRAFTED, trained=True
    )


def long_lookup_entry(make: Callable[[object, int], Drafter]) -> DrafterEntry:
    """A drafter whose context match may propose up to 16 tokens, past the block model's block."""
    return DrafterEntry(lambda block, reference, model: make(model, block), LONG_LOOKUP_TOKENS, trained=True)


DRAFTERS: dict[str, DrafterEntry | None] = {
    "none": None,  # plain decoding through the engine: tau 1, the engine's own overhead
    "lookup": DrafterEntry(lambda block, reference, model: PromptLookupDrafter(max_draft_len=block), 10),
    # Prompt lookup continued by the shipped n-gram store of the verifier's training answers: no model.
    "lookup-store": DrafterEntry(
        lambda block, reference, model: PromptLookupDrafter(
            max_draft_len=block, ngram_store=trained_drafters.ngram_store()
        ),
        10,
        trained=True,
    ),
    # The verifier's own greedy text at zero cost: the ceiling of speculative decoding on this machine.
    "oracle": DrafterEntry(lambda block, reference, model: OracleDrafter(reference, max_draft_len=block), 16),
    # The shipped block-diffusion drafter (block size here = drafted tokens; the block adds the anchor).
    "block": block_entry(lambda model, block: trained_drafters.block(model, block)),
    "block-lookup": block_entry(lambda model, block: trained_drafters.block(model, block, lookup=True)),
    "block-lookup-store": block_entry(
        lambda model, block: trained_drafters.block(model, block, lookup=True, store=True)
    ),
    # Two denoising passes (the confident leading run fixed after the first, the rest re-predicted).
    "block-lookup-2steps": block_entry(lambda model, block: trained_drafters.block(model, block, lookup=True, steps=2)),
    # The trained block, with lookup matches proposed up to the block size asked for (16 by default), past the block.
    "block-long-lookup": long_lookup_entry(lambda model, block: trained_drafters.block(model, block, long_lookup=True)),
    "block-long-lookup-store": long_lookup_entry(
        lambda model, block: trained_drafters.block(model, block, long_lookup=True, store=True)
    ),
    # The default drafter (`hybrid.load_default()`): the above with the longest context match up to 32 tokens,
    # and the store preferred over a one-token match; and the same lookup without the model.
    "default": long_lookup_entry(trained_drafters.default),
    "match-store": long_lookup_entry(lambda model, block: trained_drafters.match_store(block)),
    # The default with one denoising pass (none re-predicts), and with the block drafter trained here instead of the
    # shipped one (`python -m drafters.training.train` writes it to ~/.cache/hybrid/drafter/block-drafter).
    "default-1pass": long_lookup_entry(lambda model, block: trained_drafters.default(model, block, steps=1)),
    # The default with the block model's own first 2 tokens verified beside the lookup's draft, and with none.
    "default-branch2": long_lookup_entry(lambda model, block: trained_drafters.default(model, block, branch=2)),
    "default-no-branch": long_lookup_entry(lambda model, block: trained_drafters.default(model, block, branch=0)),
    # The default with the block model redrafting the lookup's draft from its first store token of share < 0.3.
    "default-refill": long_lookup_entry(lambda model, block: trained_drafters.default(model, block, refill_below=0.3)),
    "default-trained": long_lookup_entry(
        lambda model, block: trained_drafters.default(model, block, trained_drafters.TRAINED_BLOCK_DIR)
    ),
    "default-trained-3passes": long_lookup_entry(
        lambda model, block: trained_drafters.default(model, block, trained_drafters.TRAINED_BLOCK_DIR, 3)
    ),
    # Token trees: the block model's best paths under a node budget (block size here = the budget), alone and in
    # the default drafter (lookup and store first, the block model's tree below them); "default-chain" is the
    # default with the block model proposing chains.
    "block-tree": DrafterEntry(
        lambda block, reference, model: trained_drafters.block(model, MAX_DRAFTED, max_nodes=block), 32, trained=True
    ),
    "default-tree": DrafterEntry(
        lambda block, reference, model: trained_drafters.default_with(model, block), 32, trained=True
    ),
    "default-chain": long_lookup_entry(lambda model, block: trained_drafters.default_with(model, None, block)),
    # The 1-layer AR baseline of the same trainable budget (`python -m drafters.training.train --arch ar`).
    "ar": DrafterEntry(lambda block, reference, model: trained_drafters.ar(model, block), MAX_DRAFTED, trained=True),
}


def check_drafter_names(names: list[str]) -> None:
    unknown = [name for name in names if name not in DRAFTERS]
    if unknown:
        raise ValueError(f"unknown drafter {unknown[0]!r}: choose from {sorted(DRAFTERS)}")


def check_fits_model(model: str, names: list[str], drafter_of: Callable[[str], str | None] = lambda name: name) -> None:
    """Trained drafters fit only the default verifier: fail before anything loads. `drafter_of` maps each name
    to its DRAFTERS name (a bench method to its drafter)."""
    entries = {name: DRAFTERS.get(drafter_of(name) or "none") for name in names}
    trained = sorted(name for name, entry in entries.items() if entry is not None and entry.trained)
    if model != "default" and trained:
        raise ValueError(f"{trained} are trained for the default verifier: drop them or use --model default")


def make_drafter(name: str, block_size: int | None, reference: torch.Tensor, model) -> Drafter | None:
    """Drafter `name` proposing up to `block_size` tokens (None: its default); None for `none`."""
    entry = DRAFTERS[name]
    if entry is None:
        return None
    return entry.make(entry.default_block_size if block_size is None else block_size, reference, model)


# experiments.bench's methods: the two ways to decode without hybrid, then every drafter through hybrid.
BASELINE_METHODS = ("plain", "hf-lookup")
METHODS = BASELINE_METHODS + tuple(f"hybrid-{name}" for name in DRAFTERS if name != "oracle") + ("oracle",)


def method_drafter(method: str) -> str | None:
    """The DRAFTERS name a bench method decodes with (`hybrid-default` -> `default`); None for the baselines."""
    if method in BASELINE_METHODS:
        return None
    return method if method == "oracle" else method.removeprefix("hybrid-")
