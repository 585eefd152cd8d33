"""`hybrid.drafter_for(model)`: the best drafter hybrid has for a verifier, whichever it is.

Every verifier gets context lookup and an online store of its own outputs (`drafters.online_store`), which learns
what it says while the process runs. The embedded verifier (SmolLM2-135M-Instruct, recognised by its fingerprint)
also gets the shipped n-gram store and block-diffusion model; any verifier gets the block-diffusion or DFlash drafter
trained for it when its folder is given. `python -m hybrid generate/serve/export-served --drafter DIR` build theirs
here.
"""

from __future__ import annotations

import json
from pathlib import Path

from drafters import BlockDiffusionDrafter, ChainDrafter, DFlashDrafter, Drafter, PromptLookupDrafter
from drafters.block_diffusion import CONFIG_NAME as BLOCK_CONFIG
from drafters.block_diffusion import verifier_fingerprint
from drafters.dflash import CONFIG_NAME as DFLASH_CONFIG
from drafters.dflash import read_config
from drafters.dflash_model import dflash_value
from drafters.ngram_store import CONFIG_NAME as NGRAM_CONFIG
from drafters.online_store import OnlineStore
from hybrid.default import (
    DRAFTER_DIR,
    DRAFTER_LOOKUP_MAX_NGRAM,
    DRAFTER_LOOKUP_NGRAM,
    DRAFTER_LOOKUP_TOKENS,
    DRAFTER_NGRAM_DIR,
    DRAFTER_PREFER_STORE,
)


def drafter_for(model, path: str | Path | None = None, tokenizer=None) -> Drafter:
    """The drafter for the verifier `model`: context lookup (the default's settings) with a fresh online store of this
    verifier's outputs, plus for the embedded verifier the shipped n-gram store, plus the trained drafter of folder
    `path` (a block-diffusion checkpoint or a DFlash drafter; for the embedded verifier, the shipped block model when
    `path` is None), which fills in what the lookup leaves of its block (`drafters.ChainDrafter`).

    A folder trained for another verifier is refused, naming the verifier it was trained for and the one given.
    Keep the drafter for later calls: its online store is what it has learnt.
    """
    fingerprint = verifier_fingerprint(model)
    embedded = fingerprint == shipped_fingerprint()
    online = OnlineStore(verifier=model)
    lookup = PromptLookupDrafter(
        max_ngram=DRAFTER_LOOKUP_MAX_NGRAM,
        min_ngram=DRAFTER_LOOKUP_NGRAM,
        max_draft_len=DRAFTER_LOOKUP_TOKENS,
        ngram_store=DRAFTER_NGRAM_DIR if embedded else None,
        prefer_store=DRAFTER_PREFER_STORE if embedded else None,
        online_store=online,
        verifier=model,
    )
    if path is None and embedded:
        path = DRAFTER_DIR
    if path is None:
        return lookup
    return ChainDrafter([lookup, trained_drafter(path, model, tokenizer, fingerprint)])


def shipped_fingerprint() -> dict:
    """The fingerprint of the verifier the shipped n-gram store and block model were built for (the embedded one)."""
    return json.loads((DRAFTER_NGRAM_DIR / NGRAM_CONFIG).read_text())["verifier"]


def trained_drafter(path: str | Path, model, tokenizer=None, fingerprint: dict | None = None) -> Drafter:
    """The drafter of folder `path` for `model`: a block-diffusion checkpoint (drafter_config.json) or a DFlash drafter
    (config.json with dflash_config), checked first against the verifier it was trained for."""
    path = Path(path)
    fingerprint = verifier_fingerprint(model) if fingerprint is None else fingerprint
    if (path / BLOCK_CONFIG).is_file():
        trained_for = json.loads((path / BLOCK_CONFIG).read_text()).get("verifier") or {}
        check_trained_for(path, trained_for, fingerprint)
        return BlockDiffusionDrafter.from_pretrained(path, model, tokenizer=tokenizer)
    if (path / DFLASH_CONFIG).is_file() and "dflash_config" in json.loads((path / DFLASH_CONFIG).read_text()):
        config = read_config(path)
        # A folder hybrid trained names its verifier; a published one does not: what it was trained for is the shape it
        # reads.
        trained_for = getattr(config, "verifier_fingerprint", None) or {
            "hidden_size": getattr(config, "target_hidden_size", None) or config.hidden_size,
            "vocab_size": config.vocab_size,
            "num_layers": dflash_value(config, "num_target_layers"),
        }
        check_trained_for(path, {k: v for k, v in trained_for.items() if v is not None}, fingerprint)
        return DFlashDrafter.from_pretrained(path, model, tokenizer=tokenizer)
    raise ValueError(
        f"drafter folder {path} holds neither {BLOCK_CONFIG} (a block-diffusion drafter, `python -m "
        f"drafters.training.train`) nor a {DFLASH_CONFIG} with dflash_config (a DFlash drafter): pass one of those"
    )


def check_trained_for(path: Path, trained_for: dict, fingerprint: dict) -> None:
    """Raise ValueError unless the verifier fields a drafter folder records (`trained_for`) are `fingerprint`'s."""
    if any(fingerprint.get(key) != value for key, value in trained_for.items()):
        given = {key: fingerprint.get(key) for key in trained_for} if "architecture" not in trained_for else fingerprint
        raise ValueError(
            f"drafter {path} was trained for {describe(trained_for)}, but the verifier given is {describe(given)}: "
            "pass the drafter trained for this verifier, or train one with `python -m drafters.training.train`"
        )


def describe(fingerprint: dict) -> str:
    """A verifier fingerprint in words: 'LlamaForCausalLM (hidden size 576, 30 layers, vocabulary 49152, ...)'."""
    words = {"hidden_size": "hidden size", "num_layers": "layers", "vocab_size": "vocabulary"}
    parts = [
        f"{value} layers" if key == "num_layers" else f"{words.get(key, key)} {value}"
        for key, value in fingerprint.items()
        if key != "architecture"
    ]
    name = fingerprint.get("architecture", "a verifier")
    return f"{name} ({', '.join(parts)})"
