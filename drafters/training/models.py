"""The drafters being trained: how a run's model starts, its forward over a batch, and its export.

The block-diffusion drafter starts from `--init-from`'s checkpoint or from fresh weights with a draft vocabulary
and feature statistics taken from the training answers; the AR baseline (drafters.ar_baseline loads it) is a
1-layer Llama with the verifier's frozen embedding and the block drafter's trainable budget; the DFlash drafter
(`--arch dflash`) is drafters.training.dflash's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from drafters.ar_baseline import FROZEN, WEIGHTS_NAME, with_verifier_embedding
from drafters.block_diffusion import (
    BlockDiffusionConfig,
    BlockDiffusionModel,
    check_fingerprint,
    load_model,
    save_model,
    verifier_fingerprint,
    verifier_geometry,
)
from drafters.dflash import DFlashModel
from drafters.dflash import save_model as save_dflash
from drafters.training.dflash import dflash_forward
from drafters.training.distill import FeatureStore

# -- the block-diffusion drafter ----------------------------------------------------------------------


def draft_vocabulary(store: FeatureStore, sequences: list[int], size: int) -> tuple[torch.Tensor, float]:
    """The `size` tokens the verifier predicts most often in the answers of `sequences`, and their coverage."""
    counts = np.zeros(int(store.top_ids.max()) + 1 if len(store) else 1, dtype=np.int64)
    for i in sequences:
        s = store.sequence(i)
        np.add.at(counts, s["greedy"][s["prompt_len"] :], 1)
    order = np.argsort(-counts, kind="stable")[:size]
    return torch.from_numpy(np.sort(order)).long(), float(counts[order].sum() / max(1, counts.sum()))


def feature_statistics(store, train_ids, seed: int, rows: int = 20_000) -> tuple[torch.Tensor, torch.Tensor]:
    """Robust per-dim centre and scale of the verifier features (median, half the 16-84 percentile range)."""
    rng = np.random.default_rng(seed)
    sample = np.concatenate(
        [
            np.asarray(store.sequence(int(i))["hidden"], dtype=np.float32)
            for i in rng.choice(train_ids, size=min(len(train_ids), 64), replace=False)
        ]
    )
    sample = sample[rng.choice(len(sample), size=min(rows, len(sample)), replace=False)]
    low, mid, high = np.percentile(sample, [16, 50, 84], axis=0)
    return torch.from_numpy(mid).float(), torch.from_numpy(np.maximum((high - low) / 2, 1e-3)).float()


def initial_block_model(args, verifier, store: FeatureStore, train_ids: list[int]) -> BlockDiffusionModel:
    """The block model training starts from: `--init-from`'s checkpoint, or fresh weights with a draft vocabulary
    and feature statistics taken from the training answers. (The AR baseline takes its trainable budget from it.)"""
    start = args.init_from and args.arch == "block"
    if start:
        model = load_model(args.init_from).float()
        check_fingerprint(model.config.verifier, verifier_fingerprint(verifier))
        config = model.config
        if args.masked_input is not None:  # what masked positions read changes; the weights stay
            config.masked_input = args.masked_input
    else:
        config = BlockDiffusionConfig.for_verifier(
            verifier,
            num_layers=args.layers,
            block_size=args.block_size,
            draft_vocab_size=args.draft_vocab,
            masked_input=args.masked_input or "nearest_known",
        )
    if tuple(store.layers) != tuple(config.target_layers):
        raise ValueError(f"features hold layers {store.layers}, the drafter needs {config.target_layers}: rebuild them")
    if start:
        return model
    vocab, coverage = draft_vocabulary(store, train_ids, args.draft_vocab)
    print(f"draft vocabulary: {len(vocab)} tokens cover {coverage:.1%} of the verifier's greedy answer tokens")
    config.draft_vocab_size = len(vocab)
    torch.manual_seed(args.seed)
    model = BlockDiffusionModel(config)
    model.draft_vocab.copy_(vocab)
    embedding_std = float(verifier.get_input_embeddings().weight.detach().std())
    model.mask_embedding.data.normal_(std=embedding_std)
    model.feature_gate.data.fill_(embedding_std)  # fused features have unit RMS: start them at the embeddings' scale
    shift, scale = feature_statistics(store, train_ids, args.seed)
    model.feature_shift.copy_(shift)
    model.feature_scale.copy_(scale)
    return model


def block_forward(model: BlockDiffusionModel | DFlashModel, embed, head, batch) -> torch.Tensor:
    """Draft-vocabulary logits [S, A, B-1, V'] for a batch from `block_batch` (a DFlash drafter's vocabulary is the
    whole of the verifier's)."""
    if isinstance(model, DFlashModel):
        return dflash_forward(model, embed, head, batch)
    hidden, anchors, tokens, known = batch["hidden"], batch["anchors"], batch["tokens"], batch["known"]
    S, A, B = tokens.shape
    width, device = hidden.shape[1], tokens.device
    with torch.no_grad():
        embeds, context_embeds = embed(tokens), embed(batch["ids"])
    features = model.features(hidden, context_embeds)
    context = model.context(features, torch.arange(width, device=device)[None].expand(S, width))
    last = features.gather(1, (anchors - 1).clamp(min=0)[..., None].expand(S, A, features.shape[-1]))  # [S, A, hidden]
    embeds = model.block_inputs(embeds, known, last)
    block_positions = (anchors[..., None] + torch.arange(B, device=device)).reshape(S, A * B)
    # Query (anchor j, position i) may see context positions < anchor j and all of block j.
    sees_context = torch.arange(width, device=device)[None, None, :] < anchors[:, :, None]  # [S, A, width]
    sees_context = sees_context[:, :, None, :].expand(S, A, B, width).reshape(S, A * B, width)
    block_id = torch.arange(A, device=device).repeat_interleave(B)
    sees_block = (block_id[:, None] == block_id[None, :])[None].expand(S, -1, -1)
    mask = torch.cat([sees_context, sees_block], dim=-1)[:, None]
    out = model(embeds.reshape(S, A * B, -1), block_positions, context, mask)
    out = out.reshape(S, A, B, -1)[:, :, 1:]
    return out @ head.T


class StepLogits(torch.nn.Module):
    """A step's forward as one module (`block_forward`, or `ar_forward` for `arch` "ar"), so that DDP, which syncs
    gradients only through its wrapper's forward, wraps the whole of it. The verifier's frozen embedding and head are
    kept outside the module tree: DDP neither broadcasts nor watches them."""

    def __init__(self, arch: str, model, embed, head: torch.Tensor):
        super().__init__()
        self.arch, self.model = arch, model
        self.frozen = (embed, head)  # a tuple, so not registered as a submodule

    def forward(self, batch: dict) -> torch.Tensor:
        embed, head = self.frozen
        if self.arch == "ar":
            return ar_forward(self.model, head, batch)
        return block_forward(self.model, embed, head, batch)


# -- the AR baseline ----------------------------------------------------------------------------------


def make_ar_model(verifier, trainable_budget: int):
    """A 1-layer Llama with the verifier's embedding/head (frozen) and ~`trainable_budget` trainable parameters."""
    from transformers import LlamaConfig, LlamaForCausalLM

    text, shape = verifier.config.get_text_config(), verifier_geometry(verifier)
    h, heads, kv, hd = shape["hidden_size"], shape["num_heads"], shape["num_kv_heads"], shape["head_dim"]
    attention = h * heads * hd * 2 + h * kv * hd * 2
    intermediate = max(1, round((trainable_budget - attention - 3 * h) / (3 * h)))
    config = LlamaConfig(
        vocab_size=verifier.get_input_embeddings().weight.shape[0],
        hidden_size=h,
        intermediate_size=intermediate,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=hd,
        rms_norm_eps=shape["norm_eps"],
        rope_parameters=shape["rope_parameters"],
        max_position_embeddings=shape["max_position_embeddings"],
        tie_word_embeddings=True,
        bos_token_id=getattr(text, "bos_token_id", None),
        eos_token_id=getattr(text, "eos_token_id", None),
        pad_token_id=getattr(text, "pad_token_id", None),
    )
    return with_verifier_embedding(LlamaForCausalLM(config), verifier)


def ar_forward(model, head, batch) -> torch.Tensor:
    """Draft-vocabulary logits [S, width, V'] at every position of a batch from `ar_batch`."""
    out = model.model(input_ids=batch["ids"], attention_mask=batch["mask"]).last_hidden_state
    return out @ head.T


def save_ar_model(model, path: str | Path, dtype=None) -> None:
    """config.json + the trained weights (without the verifier's embedding and head), cast to `dtype` if given."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(path)
    state = {
        k: (v.to(dtype) if dtype else v).detach().cpu().contiguous()
        for k, v in model.state_dict().items()
        if k not in FROZEN
    }
    save_file(state, str(path / WEIGHTS_NAME))


# -- both ---------------------------------------------------------------------------------------------


def final_norm(verifier) -> torch.nn.Module | None:
    """The verifier's last norm before its head (Llama's and Qwen's `model.norm`, GPT-2's `transformer.ln_f`, OPT's
    `decoder.final_layer_norm`), or None: a drafter's output norm starts from it, so the frozen head reads it at once."""
    base = verifier.base_model
    for owner in (base, getattr(base, "decoder", None)):
        for name in ("norm", "ln_f", "final_layer_norm", "final_layernorm", "norm_f"):
            module = getattr(owner, name, None) if owner is not None else None
            if isinstance(module, torch.nn.Module) and getattr(module, "weight", None) is not None:
                return module
    return None


def trainable(model) -> list[torch.nn.Parameter]:
    """The parameters training updates (the verifier's embedding and head stay frozen)."""
    return [p for p in model.parameters() if p.requires_grad]


def export(arch: str, model, out: Path) -> None:
    """The drafter's weights, stored in bfloat16 (half the size; loading casts them to the model's dtype)."""
    if arch == "block":
        save_model(model, out, dtype=torch.bfloat16)
    elif arch == "dflash":  # the DFlash folder, bfloat16 as published
        save_dflash(model, out, dtype=torch.bfloat16)
    else:
        save_ar_model(model, out, dtype=torch.bfloat16)
