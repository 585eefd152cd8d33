"""The 1-layer autoregressive baseline the block-diffusion drafter is compared with, loaded for drafting.

Same pipeline, data and trainable-parameter budget as the block drafter (`python -m drafters.training.train
--arch ar`; drafters.training.models builds and saves it); it reuses the verifier's embedding (tied to its head),
so a checkpoint holds only the trained layer and norm, like the block drafter's: the embedding comes back from
the verifier at load time.
"""

from __future__ import annotations

from pathlib import Path

FROZEN = ("model.embed_tokens.weight", "lm_head.weight")
WEIGHTS_NAME = "model.safetensors"


def with_verifier_embedding(model, verifier):
    """`model` with `verifier`'s embedding (frozen; tied to the head) and generation config."""
    model.model.embed_tokens.weight.data.copy_(verifier.get_input_embeddings().weight.data)
    model.model.embed_tokens.weight.requires_grad_(False)
    model.generation_config = verifier.generation_config
    return model


def load_ar_model(path: str | Path, verifier):
    """The baseline saved by `drafters.training.models.save_ar_model`, with `verifier`'s embedding put back."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    if not (path / "config.json").is_file() or not (path / WEIGHTS_NAME).is_file():
        raise FileNotFoundError(
            f"no AR baseline drafter in {path}: train it with `python -m drafters.training.train --arch ar`"
        )
    config = LlamaConfig.from_pretrained(path)
    if config.vocab_size != verifier.get_input_embeddings().weight.shape[0]:
        raise ValueError(
            f"{path} was trained for a vocabulary of {config.vocab_size} tokens, the verifier has "
            f"{verifier.get_input_embeddings().weight.shape[0]}: retrain it for this verifier"
        )
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(load_file(str(path / WEIGHTS_NAME)), strict=False)
    if unexpected or set(missing) - set(FROZEN):
        raise ValueError(
            f"{path / WEIGHTS_NAME} does not match its config (missing {sorted(set(missing) - set(FROZEN))}, "
            f"unexpected {sorted(unexpected)}): retrain or re-save it"
        )
    return with_verifier_embedding(model, verifier).to(verifier.device).eval()
