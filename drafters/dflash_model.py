"""The DFlash draft model (Chen et al. 2026, "DFlash: Block Diffusion for Flash Speculative Decoding"): its layers,
RoPE, attention and masks, defined once for hybrid's drafter and for the folders hybrid exports.

hybrid copies this file, as `dflash.py`, into every DFlash folder it writes (config.json's `auto_map` names it), so the
folder loads with the reference repository's documented call, `AutoModel.from_pretrained(folder,
trust_remote_code=True)` (z-lab/dflash README), without that repository: the same architecture, weight names and
config fields as z-lab/dflash `dflash/model.py`, written for hybrid, read the way vLLM and SGLang serve the folder.
`drafters.dflash` builds its drafter on the same `DFlashNetwork`.

The drafter has no embedding and no LM head: the caller embeds the block `[anchor, mask x (B - 1)]` with the target's
embedding and scores the output with the target's head. Its context is `hidden_norm(fc(concat))` of the target's
states at `dflash_config.target_layer_ids`: entry k is transformers' `hidden_states[k + 1]`, the output of decoder
layer k (for the last layer transformers returns it after the final norm, vLLM before it: docs/design.md of hybrid,
"The DFlash format"). Each layer attends over [context ; block] keys: full-attention layers
non-causally, `sliding_attention` layers causally within `sliding_window` (as vLLM and SGLang serve them);
`is_causal` or `dflash_config.causal` sets the causality of every layer.

This file imports only torch and transformers: it runs wherever the folder is copied.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3PreTrainedModel,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    rotate_half,
)


def dflash_value(config, name: str, default=None):
    """A DFlash field from `dflash_config`, else the top level (published configs keep `block_size` at either)."""
    value = (getattr(config, "dflash_config", None) or {}).get(name)
    return getattr(config, name, default) if value is None else value


def layer_kind(config, index: int) -> tuple[bool, int | None]:
    """(causal, window) of drafter layer `index`, resolved as vLLM resolves it: `is_causal`, then
    `dflash_config.causal`, else causal exactly on `sliding_attention` layers (Qwen3.6's drafters), which see
    `sliding_window` keys."""
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    sliding = layer_types[index] == "sliding_attention"
    window = config.sliding_window if sliding else None
    if sliding and not window:
        raise ValueError(
            f"layer {index} is sliding_attention but the config has no sliding_window: set sliding_window (and "
            "use_sliding_window: true, without which Qwen3Config drops it)"
        )
    forced = getattr(config, "is_causal", None)
    if forced is None:
        forced = (getattr(config, "dflash_config", None) or {}).get("causal")
    return (sliding if forced is None else bool(forced)), window


def attention_rule(causal: bool, window: int | None, query_positions: torch.Tensor, key_positions: torch.Tensor):
    """Boolean mask [S, 1, q, k] (True: may attend) of a layer of kind (causal, window) for queries at
    `query_positions` [S, q] and keys at `key_positions` [S, k]; None where every key is visible. A window w keeps
    keys less than w positions away (the query's own included)."""
    if not causal and not window:
        return None
    distance = query_positions[:, :, None] - key_positions[:, None, :]
    rule = distance >= 0 if causal else torch.ones_like(distance, dtype=torch.bool)
    if window:
        rule = rule & (distance < window) & (distance > -window)
    return rule[:, None]


def layer_masks(kinds, query_positions, key_positions, visible=None) -> list[torch.Tensor | None]:
    """Per layer of `kinds` ((causal, window) each), its boolean attention mask [S, 1, q, k] (None: every key): the
    layer's `attention_rule` and `visible` [S, 1, q, k], the keys a query may see in any layer (None: all). One
    tensor per distinct kind."""
    masks = {}
    for kind in set(kinds):
        rule = attention_rule(*kind, query_positions, key_positions)
        masks[kind] = rule if visible is None else visible if rule is None else visible & rule
    return [masks[kind] for kind in kinds]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x [S, heads, n, d] with cos/sin [S, n, d] (the rotate-half convention of Qwen3 and Llama)."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


class DFlashAttention(nn.Module):
    """Qwen3 attention (q/k RMSNorm per head, GQA) whose keys and values are [the context's ; the block's]."""

    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx  # its slot in a transformers Cache
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Normed, rotated keys and values [S, kv_heads, n, d] of inputs x [S, n, hidden]."""
        shape = (*x.shape[:-1], self.num_kv_heads, self.head_dim)
        k = self.k_norm(self.k_proj(x).view(shape)).transpose(1, 2)
        return apply_rope(k, cos, sin), self.v_proj(x).view(shape).transpose(1, 2)

    def forward(self, x, context_k, context_v, cos, sin, mask, cache=None):
        """The block's attention output [S, q, hidden] for block inputs x [S, q, hidden] at RoPE cos/sin [S, q, d],
        over the context's keys/values [S, kv_heads, n, d] and the block's own; with a transformers `cache`, those
        are appended to the keys/values it holds, and the queries see all of them."""
        q = self.q_norm(self.q_proj(x).view(*x.shape[:-1], self.num_heads, self.head_dim)).transpose(1, 2)
        k, v = self.keys_values(x, cos, sin)
        k, v = torch.cat([context_k, k], dim=2), torch.cat([context_v, v], dim=2)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        out = F.scaled_dot_product_attention(apply_rope(q, cos, sin), k, v, attn_mask=mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).flatten(2))


class DFlashLayer(nn.Module):
    """A pre-norm Qwen3 decoder layer (attention, then a SwiGLU MLP) over [context ; block] keys."""

    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, context_k, context_v, cos, sin, mask, cache=None):
        x = x + self.self_attn(self.input_layernorm(x), context_k, context_v, cos, sin, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashNetwork:
    """The DFlash network, mixed into a torch module: its weights, named as the format names them (`layers.i.*`,
    `fc`, `hidden_norm`, `norm`), and its two passes: the context's keys/values, then the block's hidden states."""

    def add_network(self, config: Qwen3Config, num_context_layers: int) -> None:
        """Add the modules of a drafter of `config` whose context concatenates `num_context_layers` target states."""
        target_hidden = getattr(config, "target_hidden_size", None) or config.hidden_size
        self.layers = nn.ModuleList(DFlashLayer(config, i) for i in range(config.num_hidden_layers))
        self.fc = nn.Linear(num_context_layers * target_hidden, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)  # every rope_type transformers knows (yarn, llama3, ...)
        self.kinds = [layer_kind(config, i) for i in range(config.num_hidden_layers)]

    def context(self, target_hidden: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (keys, values) [S, kv_heads, n, d] of the target's concatenated states [S, n, ids * hidden] at
        `positions` [S, n]: a context token's depend on its own states and position only."""
        features = self.hidden_norm(self.fc(target_hidden.to(self.fc.weight.dtype)))
        cos, sin = self.rotary_emb(features, positions)
        return [layer.self_attn.keys_values(features, cos, sin) for layer in self.layers]

    def block_hidden(self, block_embeds, block_positions, context, masks, cache=None) -> torch.Tensor:
        """Final hidden states [S, q, hidden] of block inputs [S, q, hidden] at `block_positions` [S, q]; `context`
        from `context()`, `masks` from `layer_masks` (one per layer), `cache` a transformers Cache or None."""
        cos, sin = self.rotary_emb(block_embeds, block_positions)
        x = block_embeds
        for layer, (k, v), mask in zip(self.layers, context, masks):
            x = layer(x, k, v, cos, sin, mask, cache)
        return self.norm(x)


class DFlashDraftModel(DFlashNetwork, Qwen3PreTrainedModel):
    """The DFlash drafter as the reference call loads it: `layers.i.*` (Qwen3 decoder layers), `fc` and
    `hidden_norm` (context fusion), `norm`."""

    config_class = Qwen3Config
    _no_split_modules = ["DFlashLayer"]
    _can_record_outputs = {}

    def __init__(self, config: Qwen3Config):
        super().__init__(config)
        ids = dflash_value(config, "target_layer_ids")
        if not ids:
            raise ValueError("config.json has no dflash_config.target_layer_ids: the drafter cannot know its context")
        self.target_layer_ids = [int(i) for i in ids]
        self.mask_token_id = dflash_value(config, "mask_token_id")
        self.block_size = int(dflash_value(config, "block_size", 16))
        self.add_network(config, len(self.target_layer_ids))
        self.post_init()

    def forward(
        self,
        position_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        noise_embedding: torch.Tensor | None = None,
        target_hidden: torch.Tensor | None = None,
        past_key_values=None,
        use_cache: bool = False,
        **kwargs,
    ) -> torch.Tensor:
        """Final hidden states [B, q, hidden] of the block `noise_embedding` [B, q, hidden].

        Args:
            position_ids: [B, n + q] positions of the new context tokens, then of the block.
            attention_mask: optional boolean [B, 1, q, keys] (True: may attend), combined with each layer's rule.
            target_hidden: [B, n, len(target_layer_ids) * target hidden] the target's states of the new context.
            past_key_values: a transformers Cache holding the keys/values of the context before (positions
                0..cached - 1); the new context and the block are appended to it (crop the block off after).
        """
        if position_ids.dim() == 1:
            position_ids = position_ids[None]
        hidden_states = noise_embedding.to(self.fc.weight.dtype)
        n, q_len = target_hidden.shape[1], hidden_states.shape[1]
        cached = 0 if past_key_values is None else past_key_values.get_seq_length()
        if position_ids.shape[1] != n + q_len:
            raise ValueError(
                f"position_ids covers {position_ids.shape[1]} tokens, target_hidden and noise_embedding "
                f"{n} + {q_len}: give the positions of the new context, then of the block"
            )
        context = self.context(target_hidden, position_ids[:, :n])
        earlier = torch.arange(cached, device=position_ids.device).expand(position_ids.shape[0], -1)
        key_pos, query_pos = torch.cat([earlier, position_ids], dim=1), position_ids[:, -q_len:]
        visible = None if attention_mask is None else attention_mask.bool()
        masks = layer_masks(self.kinds, query_pos, key_pos, visible)
        return self.block_hidden(hidden_states, query_pos, context, masks, past_key_values if use_cache else None)

    @torch.inference_mode()
    def spec_generate(
        self,
        target: nn.Module,
        input_ids: torch.LongTensor,
        max_new_tokens: int,
        stop_token_ids: list[int] | None = None,
        temperature: float = 0.0,
    ) -> torch.LongTensor:
        """Speculative decoding of one prompt [1, n] with `target` (a Qwen3, Llama or Qwen3.5 causal LM, whose
        linear-attention layers are rolled back to the accepted prefix's recorded state): draft a block,
        verify it in one target forward, keep the longest agreeing prefix and the target's next token. Greedy at
        temperature 0 (the output is the target's greedy output); otherwise the target's samples decide."""
        self.eval()
        if input_ids.shape[0] != 1:
            raise ValueError(f"spec_generate decodes one prompt at a time, got a batch of {input_ids.shape[0]}")
        layers = target.config.get_text_config().num_hidden_layers
        bad = [i for i in self.target_layer_ids if not 0 <= i < layers]
        if bad:
            raise ValueError(f"target_layer_ids {bad} out of range for a target of {layers} layers: wrong target")
        return self._decode(target, input_ids, max_new_tokens, set(stop_token_ids or ()), temperature)

    def context_of(self, hidden_states) -> torch.Tensor:
        """The target's states the context reads: `hidden_states[k + 1]` per target layer id k, concatenated."""
        return torch.cat([hidden_states[i + 1] for i in self.target_layer_ids], dim=-1)

    def _decode(self, target, input_ids, max_new_tokens, stop, temperature):
        embed, head = target.get_input_embeddings(), target.get_output_embeddings()
        target_cache, draft_cache = target_cache_for(target), DynamicCache()
        # transformers 5 names the cache argument `cache`, 4.x `past_key_values`.
        cache = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"
        out = target(input_ids, use_cache=True, output_hidden_states=True, **{cache: target_cache})
        # A verify feeds the whole block: linear-attention layers (Qwen3.5's Gated DeltaNet, Mamba) then keep their
        # state before and after each of its first size - 1 tokens (and sliding-window layers their evicted keys), so
        # that `crop(-n)` restores the state after the anchor and the accepted tokens.
        recording = hasattr(target_cache, "activate_past_recording")
        if recording:
            target_cache.activate_past_recording(recurrent_states_to_keep=self.block_size)
        tokens = torch.cat([input_ids, choose(out.logits[:, -1:], temperature)], dim=1)
        context = self.context_of(out.hidden_states)
        prompt_len, size = input_ids.shape[1], self.block_size
        while tokens.shape[1] - prompt_len < max_new_tokens and not stop & set(tokens[0, prompt_len:].tolist()):
            start = tokens.shape[1] - 1  # the anchor: the last token, whose target states are not known yet
            block = torch.full((1, size), self.mask_token_id, dtype=torch.long, device=tokens.device)
            block[0, 0] = tokens[0, -1]
            positions = torch.arange(draft_cache.get_seq_length(), start + size, device=tokens.device)[None]
            hidden = self(
                positions,
                noise_embedding=embed(block),
                target_hidden=context,
                past_key_values=draft_cache,
                use_cache=True,
            )
            draft_cache.crop(-size)  # keep the context's keys/values only
            block[0, 1:] = head(hidden[:, 1:].to(head.weight.dtype)).argmax(-1)[0]
            out = target(block, use_cache=True, output_hidden_states=True, **{cache: target_cache})
            verified = choose(out.logits, temperature)[0]
            accepted = int((block[0, 1:] == verified[:-1]).long().cumprod(0).sum())
            tokens = torch.cat([tokens, block[:, 1 : 1 + accepted], verified[None, accepted : accepted + 1]], dim=1)
            rejected = size - accepted - 1
            if rejected or recording:  # keep the anchor and the accepted tokens (crop(0) trims the recorded states)
                target_cache.crop(-rejected)
            context = self.context_of(out.hidden_states)[:, : accepted + 1]
        new = tokens[0, prompt_len : prompt_len + max_new_tokens].tolist()
        for i, token in enumerate(new):
            if token in stop:
                new = new[: i + 1]
                break
        return torch.cat([input_ids, torch.tensor([new], dtype=torch.long, device=input_ids.device)], dim=1)


def target_cache_for(target) -> DynamicCache:
    """An empty cache of `target`'s layer types (linear-attention, sliding-window and full-attention layers), as its
    `generate` builds; a bare one on transformers versions whose DynamicCache takes no config."""
    if "config" in inspect.signature(DynamicCache.__init__).parameters:
        return DynamicCache(config=target.config)
    return DynamicCache()


def choose(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Tokens [B, n] from logits [B, n, V]: argmax at temperature 0, else a draw from softmax(logits / temperature)."""
    if temperature < 1e-5:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs.flatten(0, 1), 1).view(logits.shape[:2])
