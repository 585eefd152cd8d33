"""`--arch dflash`: a drafter in exactly z-lab's DFlash architecture, trained with our data, anchors and loss.

The model is `drafters.dflash.DFlashModel` (its export is the DFlash folder vLLM and SGLang load): the block
`[anchor, mask x (B - 1)]` embedded by the verifier, the context `hidden_norm(fc(verifier states))`, Qwen3 layers,
the verifier's full-vocabulary head. None of the block drafter's extras (feature standardisation, the draft
vocabulary, per-position mask embeddings, context token embeddings, the fused feature added to every input), so
training both on the same features measures what they are worth.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import Qwen3Config

from drafters.block_diffusion import spread_layers, verifier_fingerprint, verifier_geometry
from drafters.dflash import DFlashModel
from drafters.dflash_model import layer_masks
from drafters.training.distill import FeatureStore


def least_used_token(store: FeatureStore, vocab_size: int) -> int:
    """The token the training sequences contain least often (the lowest id among ties): the mask token, whose frozen
    verifier embedding then stands for a masked position with the least confusion with a real one."""
    counts = np.bincount(np.asarray(store.ids, dtype=np.int64), minlength=vocab_size)[:vocab_size]
    return int(np.argmin(counts))


def dflash_layers(verifier) -> tuple[int, ...]:
    """The hidden_states indices a DFlash drafter for `verifier` reads: the block drafter's spread, topped at the
    output of the layer before the last. transformers' hidden_states[num_layers] is the final-normed output, while
    vLLM feeds a DFlash drafter the last layer's un-normed state and SGLang captures nothing for it (docs/design.md,
    "What the last layer means"), so a drafter trained on it would be served other features than it learnt from."""
    layers = verifier_geometry(verifier)["num_layers"]
    if layers < 2:
        raise ValueError(
            f"a DFlash drafter reads the output of a layer before the verifier's last, and this verifier has {layers}: "
            "train the block drafter (--arch block) for it"
        )
    return spread_layers(layers, top=layers - 1)


def dflash_config(
    verifier, hidden_layers: tuple[int, ...], num_layers: int, block_size: int, mask_token_id: int
) -> Qwen3Config:
    """The DFlash config of a drafter for `verifier` reading its `hidden_layers` (hidden_states indices, 1..layers - 1,
    see `dflash_layers`): the verifier's width, heads and RoPE, full attention in every drafter layer, and the
    verifier's fingerprint (`verifier_fingerprint`, which hybrid checks at load; the servers ignore it)."""
    shape = verifier_geometry(verifier)
    if min(hidden_layers) < 1 or max(hidden_layers) >= shape["num_layers"]:
        raise ValueError(
            f"DFlash reads decoder layer outputs before the last (hidden_states 1..{shape['num_layers'] - 1}), not "
            f"{sorted(hidden_layers)}: the last one is final-normed in transformers and not in vLLM or SGLang "
            "(drafters.training.dflash.dflash_layers chooses them)"
        )
    return Qwen3Config(
        vocab_size=verifier.get_input_embeddings().weight.shape[0],
        hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"],
        num_hidden_layers=num_layers,
        num_attention_heads=shape["num_heads"],
        num_key_value_heads=shape["num_kv_heads"],
        head_dim=shape["head_dim"],
        rms_norm_eps=shape["norm_eps"],
        rope_parameters=shape["rope_parameters"],
        max_position_embeddings=shape["max_position_embeddings"],
        layer_types=["full_attention"] * num_layers,
        tie_word_embeddings=False,
        block_size=block_size,
        num_target_layers=shape["num_layers"],
        dflash_config={"target_layer_ids": [i - 1 for i in hidden_layers], "mask_token_id": mask_token_id},
        verifier_fingerprint=verifier_fingerprint(verifier),
    )


def initial_dflash_model(args, verifier, store: FeatureStore) -> DFlashModel:
    """Fresh weights (seeded) for a DFlash drafter reading the layers the features hold."""
    vocab = verifier.get_input_embeddings().weight.shape[0]
    mask = least_used_token(store, vocab) if args.mask_token_id is None else args.mask_token_id
    print(f"mask token: {mask}")
    config = dflash_config(verifier, tuple(store.layers), args.layers, args.block_size, mask)
    torch.manual_seed(args.seed)
    model = DFlashModel(config)
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, std=0.02)
    return model


def dflash_forward(model: DFlashModel, embed, head, batch) -> torch.Tensor:
    """Full-vocabulary logits [S, A, B-1, V] of a `block_batch`: every anchor's block at once, each seeing the context
    before its anchor and its own block only (drafters.training.batches), under each layer's own rule."""
    hidden, anchors, tokens, known = batch["hidden"], batch["anchors"], batch["tokens"], batch["known"]
    S, A, B = tokens.shape
    width, device = hidden.shape[1], tokens.device
    context = model.context(hidden, torch.arange(width, device=device)[None].expand(S, width))
    inputs = torch.where(known, tokens, torch.full_like(tokens, model.mask_token_id))
    with torch.no_grad():
        embeds = model.embed(embed.weight, inputs).reshape(S, A * B, -1)
    query_positions = (anchors[..., None] + torch.arange(B, device=device)).reshape(S, A * B)
    key_positions = torch.cat([torch.arange(width, device=device)[None].expand(S, width), query_positions], dim=1)
    sees_context = torch.arange(width, device=device)[None, None, :] < anchors[:, :, None]  # [S, A, width]
    sees_context = sees_context[:, :, None, :].expand(S, A, B, width).reshape(S, A * B, width)
    block_id = torch.arange(A, device=device).repeat_interleave(B)
    sees_block = (block_id[:, None] == block_id[None, :])[None].expand(S, -1, -1)
    visible = torch.cat([sees_context, sees_block], dim=-1)[:, None]  # [S, 1, A * B, keys]: one mask for all heads
    masks = layer_masks(model.kinds, query_positions, key_positions, visible)
    out = model(embeds, query_positions, context, masks).reshape(S, A, B, -1)[:, :, 1:]
    return model.finish_logits(out @ head.T.to(out.dtype))
