"""The verifiers the experiment commands load by name: `default`, `tiny`, or a local checkpoint folder.

`tiny` is the tests' random Llama (hybrid.testing) with a byte tokenizer: a whole command runs in seconds.
"""

from __future__ import annotations

from pathlib import Path

import hybrid
from drafters import Drafter, PromptLookupDrafter


def load_default_model():
    model, tokenizer, _ = hybrid.load_default()
    return model, tokenizer


def load_tiny_model():
    from hybrid.testing import byte_tokenizer, tiny_model

    tokenizer = byte_tokenizer()
    # One token per byte, and the same weights in every process (the seed is fixed).
    model = tiny_model("llama", len(tokenizer), 2, seed=0, max_position_embeddings=1024)
    return model, tokenizer


def load_pretrained(path: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


MODELS = {"default": load_default_model, "tiny": load_tiny_model}
MODEL_HELP = "default (SmolLM2-135M-Instruct), tiny (random, for tests) or a local checkpoint folder"


def check_model_name(name: str) -> None:
    """Raise ValueError unless `name` is a MODELS name or a folder with a config.json (checked before loading)."""
    if name not in MODELS and not (Path(name) / "config.json").is_file():
        raise ValueError(f"--model {name!r}: use {' or '.join(MODELS)}, or a local checkpoint folder with config.json")


def load_model(name: str):
    """(model, tokenizer) for a MODELS name or a local checkpoint folder."""
    return MODELS[name]() if name in MODELS else load_pretrained(name)


def load_with_drafter(name: str, device: str) -> tuple[object, object, Drafter]:
    """(model, tokenizer, drafter) on `device`: the default verifier with its shipped drafter, any other with
    prompt lookup (no trained drafter fits it)."""
    if name == "default":
        return hybrid.load_default(device)
    model, tokenizer = load_model(name)
    return model.to(device), tokenizer, PromptLookupDrafter()
