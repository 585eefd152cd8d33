"""The 1-layer autoregressive baseline the block-diffusion drafter is compared with.

Same pipeline, data and trainable-parameter budget as the block drafter (drafters.train --arch ar); it
reuses the verifier's embedding (tied to its head), so a checkpoint holds only the trained layer and
norm, like the block drafter's: the embedding comes back from the verifier at load time.
"""

from __future__ import annotations

from pathlib import Path


FROZEN = ("model.embed_tokens.weight", "lm_head.weight")
WEIGHTS_NAME = "model.safetensors"


def make_ar_model(verifier, trainable_budget: int):
    """A 1-layer Llama with the verifier's embedding/head (frozen) and ~`trainable_budget` trainable parameters."""
    from transformers import LlamaConfig, LlamaForCausalLM

    text = verifier.config.get_text_config()
    h = text.hidden_size
    heads, kv, hd = text.num_attention_heads, text.num_key_value_heads, text.head_dim
    attention = h * heads * hd * 2 + h * kv * hd * 2
    intermediate = max(1, round((trainable_budget - attention - 3 * h) / (3 * h)))
    config = LlamaConfig(vocab_size=text.vocab_size, hidden_size=h, intermediate_size=intermediate, num_hidden_layers=1,
                         num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd, rms_norm_eps=text.rms_norm_eps,
                         rope_parameters=dict(text.rope_parameters), max_position_embeddings=text.max_position_embeddings,
                         tie_word_embeddings=True, bos_token_id=text.bos_token_id, eos_token_id=text.eos_token_id,
                         pad_token_id=text.pad_token_id)
    return _with_verifier_embedding(LlamaForCausalLM(config), verifier)


def _with_verifier_embedding(model, verifier):
    model.model.embed_tokens.weight.data.copy_(verifier.get_input_embeddings().weight.data)
    model.model.embed_tokens.weight.requires_grad_(False)
    model.generation_config = verifier.generation_config
    return model


def save_ar_model(model, path: str | Path, dtype=None) -> None:
    """config.json + the trained weights (without the verifier's embedding and head), cast to `dtype` if given."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(path)
    state = {k: (v.to(dtype) if dtype else v).detach().cpu().contiguous()
             for k, v in model.state_dict().items() if k not in FROZEN}
    save_file(state, str(path / WEIGHTS_NAME))


def load_ar_model(path: str | Path, verifier):
    """The baseline saved by `save_ar_model`, with `verifier`'s embedding put back."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    if not (path / "config.json").is_file() or not (path / WEIGHTS_NAME).is_file():
        raise FileNotFoundError(f"no AR baseline drafter in {path}: train it with `python -m drafters.train --arch ar`")
    config = LlamaConfig.from_pretrained(path)
    if config.vocab_size != verifier.get_input_embeddings().weight.shape[0]:
        raise ValueError(f"{path} was trained for a vocabulary of {config.vocab_size} tokens, the verifier has "
                         f"{verifier.get_input_embeddings().weight.shape[0]}: retrain it for this verifier")
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(load_file(str(path / WEIGHTS_NAME)), strict=False)
    if unexpected or set(missing) - set(FROZEN):
        raise ValueError(f"{path / WEIGHTS_NAME} does not match its config (missing {sorted(set(missing) - set(FROZEN))}, "
                         f"unexpected {sorted(unexpected)}): retrain or re-save it")
    return _with_verifier_embedding(model, verifier).to(verifier.device).eval()

