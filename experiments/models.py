"""The verifiers the experiment commands load by name: `default`, `tiny`, or a local checkpoint folder.

`tiny` is the tests' random Llama (hybrid.testing) with a byte tokenizer: a whole command runs in seconds.
`ARCH-tiny` is the tests' tiny model of that architecture with that tokenizer (Qwen3.5's Gated DeltaNet, DeepSeek-V3.2's
and GLM-5's indexed attention, DeepSeek-V4's compressed attention, Llama 4's chunked attention); `qwen3_5-random` is a
Qwen3.5-shaped model of about 100M parameters with random weights and the default verifier's tokenizer: what a verify
costs through Gated DeltaNet layers, and the ceiling and floor of a speed-up there.
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


def tiny_loader(arch: str, units: int):
    """A loader of the tests' tiny `arch` model (`units` of its layer pattern) with a byte tokenizer."""

    def load():
        from hybrid.testing import byte_tokenizer, tiny_model

        tokenizer = byte_tokenizer()
        return tiny_model(arch, len(tokenizer), units, seed=0, max_position_embeddings=1024), tokenizer

    load.__doc__ = f"The tests' tiny {arch} with a byte tokenizer."
    return load


def load_qwen3_5_random():
    """Qwen3.5's layer pattern (three Gated DeltaNet layers to one gated full-attention layer) and head ratios at about
    100M parameters, seeded: the same random weights in every process."""
    import torch
    import transformers

    from verifiers.embedded import load_verifier

    _, tokenizer = load_verifier()  # its 49,152-token vocabulary, so the datasets' prompts encode
    config = transformers.Qwen3_5TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=640,
        intermediate_size=2048,
        num_hidden_layers=12,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 3,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = transformers.Qwen3_5ForCausalLM(config).eval()
    return model, tokenizer


def load_pretrained(path: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


MODELS = {
    "default": load_default_model,
    "tiny": load_tiny_model,
    # Two Gated DeltaNet layers between full-attention layers; indexed, compressed and chunked attention
    "qwen3_5-tiny": tiny_loader("qwen3_5", 2),
    **{f"{arch}-tiny": tiny_loader(arch, 2) for arch in ("deepseek_v32", "glm_moe_dsa", "deepseek_v4", "llama4")},
    "qwen3_5-random": load_qwen3_5_random,
}
MODEL_HELP = (
    "default (SmolLM2-135M-Instruct), tiny (random, for tests), qwen3_5-tiny, deepseek_v32-tiny, glm_moe_dsa-tiny, "
    "deepseek_v4-tiny, llama4-tiny (random, for tests), qwen3_5-random (random, 100M, Qwen3.5-shaped) or a local "
    "checkpoint folder"
)


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
