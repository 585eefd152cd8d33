"""Losslessness checks anyone can run against their own verifier and drafter (see tests/ for use with hypothesis).

The contract (README, "Losslessness"):
* Greedy: `hybrid.generate` returns `model.generate`'s tokens. Verifying k+1 positions in one forward
  does not reproduce the last bits of one-token decoding, so where the verifier's two best processed
  scores are within `near_tie_eps(dtype)` (1e-4 in float32; two rounding steps of the top score in bfloat16 and
  float16) the two runs may take different branches. `check_greedy_lossless`
  allows a divergence only at such a near tie, and reports when it did.
* Sampling (the default "match" rule), batch 1: after the same `torch.manual_seed`, `hybrid.generate` returns
  `model.generate`'s tokens. Each token is one `torch.multinomial` draw on the verifier's processed probabilities p,
  as in `generate`: the argmax of p / E over one exponential variate E per token. Those probabilities come from a
  wider forward and differ in the last bits, so a draw whose race was that close may go to another token.
  `check_sampled_identical` allows a divergence only there: the two distributions within their rounding
  (`SAMPLE_EPS` in float32, `near_tie_eps` of the computing dtype in half precision or under autocast), and each
  run's token the winner of the replayed draw's race under its own distribution.
* Sampling with acceptance="rejection", and every row of a batch: each emitted token is distributed exactly as
  the verifier's processed distribution p (chi-square tests).

Drafters to hold against them: `AdversarialDrafter` (garbage, repeats, EOS runs) and `RandomTreeDrafter` (token
trees of random shapes around a guide's path); `tiny_model` builds verifiers of many architectures.
"""

from __future__ import annotations

import copy
import itertools
import math
from dataclasses import dataclass

import torch
import transformers
from transformers import DynamicCache
from transformers.cache_utils import LinearAttentionCacheLayerMixin

import hybrid
from drafters import Draft, DraftContext, Drafter
from verifiers.own_state import StateForwards, state_format
from verifiers.positions import rotary_state_kept

NEAR_TIE_EPS = 1e-4  # absolute gap between the top-2 processed scores of a float32 verifier


def near_tie_eps(dtype: torch.dtype, top_score: float) -> float:
    """The gap below which two top scores count as tied for a verifier computing in `dtype`: `NEAR_TIE_EPS` in
    float32; in bfloat16 / float16, two rounding steps of the top score (2 * finfo.eps * |score|), since a wider
    forward rounds each logit differently by about one step (0.0156 at |score| ~ 2-4 in bfloat16)."""
    if dtype == torch.float32 or not dtype.is_floating_point:
        return NEAR_TIE_EPS
    return max(NEAR_TIE_EPS, 2 * torch.finfo(dtype).eps * max(1.0, abs(top_score)))


def compute_dtype(model) -> torch.dtype:
    """The dtype `model` computes its scores in: autocast's where autocast is on for its device (both `generate`
    and hybrid then run PyTorch's autocast products), else its own."""
    device = model.device.type
    if device in ("cpu", "cuda") and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return model.dtype


GREEDY_CHECKS = {"checked": 0, "near_ties": 0}  # how often the near-tie exception was needed, this process
SAMPLE_EPS = 1e-4  # largest difference between the two runs' probabilities where a boundary draw may differ
SAMPLING_CHECKS = {"checked": 0, "boundary_draws": 0}


# Tiny random causal LMs of many architectures, the subjects of the property tests: each stresses something the
# engine must get right (rotary vs learned vs ALiBi positions, sliding windows, local attention inside the model,
# a model whose config says use_cache=False, caches whose keys and values differ in width, per-layer head sizes).
def _llama_like(config_cls, model_cls, **extra):
    """A tiny config of `config_cls`; `extra` adds fields or overrides these."""

    def build(vocab_size, num_layers, window):
        sizes = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
        return config_cls(vocab_size=vocab_size, num_hidden_layers=num_layers, **(sizes | extra)), model_cls

    return build


def _gpt_neo(vocab_size, num_layers, window):
    kinds = [["global", "local"], 1] if num_layers == 2 else [["local"], num_layers]
    return transformers.GPTNeoConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        num_layers=num_layers,
        num_heads=4,
        intermediate_size=64,
        attention_types=[kinds],
        window_size=window or 7,
    ), transformers.GPTNeoForCausalLM


def _mistral(vocab_size, num_layers, window):
    return _llama_like(transformers.MistralConfig, transformers.MistralForCausalLM, sliding_window=window)(
        vocab_size, num_layers, window
    )


def _mla(config_cls, model_cls, **extra):
    """Multi-head latent attention (DeepSeek-V2): the cache holds a compressed latent as keys and the shared rotary
    key as values, one head each, of different widths; keys and values are expanded to every head after the cache.
    Released checkpoints have num_key_value_heads == num_attention_heads, as here."""
    latent = dict(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4)
    return _llama_like(config_cls, model_cls, **latent, v_head_dim=12, **extra)


# A small k, so that the indexer chooses (past k tokens) and its ties at 0 are broken as `generate` breaks them.
INDEX_TOPK = 5
_INDEXER = dict(index_topk=INDEX_TOPK, index_n_heads=2, index_head_dim=8)


def _llama4(vocab_size, num_layers, window):
    """Llama 4's text model: chunked attention on its rotary layers, full attention with a temperature by position on
    the others (chunks of `window`, 4 by default, so that verifies cross chunk boundaries; the temperature's first
    step at 8192 positions, as released)."""
    layers = max(num_layers, 2)
    config = transformers.Llama4TextConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        intermediate_size_mlp=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_hidden_layers=layers,
        num_local_experts=2,
        no_rope_layers=([1, 0] * layers)[:layers],
        attention_chunk_size=window or 4,
    )
    return config, transformers.Llama4ForCausalLM


def _deepseek_v4(vocab_size, num_layers, window):
    """DeepSeek-V4: a sliding window (of `window`, 6 by default) beside compressed entries, one every 8 tokens
    (heavily compressed) or 4 with an indexer choosing 2 of them (compressed sparse), and hash-routed experts."""
    layers = max(num_layers, 2)
    kinds = ["heavily_compressed_attention", "compressed_sparse_attention"]
    config = transformers.DeepseekV4Config(
        vocab_size=vocab_size,
        hidden_size=32,
        moe_intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        q_lora_rank=16,
        num_experts_per_tok=2,
        n_routed_experts=4,
        layer_types=(kinds * layers)[:layers],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        sliding_window=window or 6,
        index_topk=2,
        index_n_heads=2,
        index_head_dim=8,
    )
    return config, transformers.DeepseekV4ForCausalLM


def _bert_decoder(vocab_size, num_layers, window):
    """BERT's LM head loaded as a decoder: causal only through is_decoder=True, its masks built the older way."""
    return transformers.BertConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        intermediate_size=64,
        is_decoder=True,
    ), transformers.BertLMHeadModel


def _bart_decoder(vocab_size, num_layers, window):
    """BART's decoder as a causal LM: its forward takes no position_ids, so each fed token sits after the cache's
    slots (trees verify as chains, masked prompt tokens are refused). `generate` sizes its cache by encoder_layers."""
    return transformers.BartConfig(
        vocab_size=vocab_size,
        d_model=32,
        decoder_layers=num_layers,
        encoder_layers=num_layers,
        decoder_attention_heads=4,
        encoder_attention_heads=4,
        decoder_ffn_dim=64,
        encoder_ffn_dim=64,
        init_std=0.3,
    ), transformers.BartForCausalLM


# A small mixture of experts for the MLA models that have one (one dense layer first, as released).
_MOE = {"moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1}


def _gemma4(vocab_size, num_layers, window):
    """Gemma 4 (text): full-attention layers have their own head size (a per-layer config attribute, which the global
    config refuses to answer) and the last layer is always full attention."""
    return transformers.Gemma4UnifiedTextConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        global_head_dim=16,
        sliding_window=window or 4,
        layer_types=["sliding_attention"] * (num_layers - 1) + ["full_attention"],
    ), transformers.Gemma4UnifiedForCausalLM


def _gemma3n(vocab_size, num_layers, window):
    """Gemma 3n (text): its last `num_layers` layers read the keys and values of the last earlier layer of their kind
    (KV sharing: they store nothing), on top of AltUp, Laurel, per-layer inputs and activation sparsity."""
    return transformers.Gemma3nTextConfig(
        vocab_size=vocab_size,
        vocab_size_per_layer_input=vocab_size,
        hidden_size=32,
        hidden_size_per_layer_input=8,
        intermediate_size=64,
        num_hidden_layers=2 * num_layers + 1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=window or 4,
        num_kv_shared_layers=num_layers,
        laurel_rank=4,
        altup_num_inputs=2,
        activation_sparsity_pattern=[0.95] + [0.0] * (2 * num_layers),
        layer_types=(["sliding_attention", "full_attention"] * (num_layers + 1))[: 2 * num_layers + 1],
    ), transformers.Gemma3nForCausalLM


def _moshi(vocab_size, num_layers, window):
    """Moshi's text model: its config declares a sliding window that its own masks ignore, while `generate`'s cache
    keeps only the window: full attention over the prompt, windowed after it."""
    return transformers.MoshiConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        ffn_dim=64,
        sliding_window=window or 4,
    ), transformers.MoshiForCausalLM


ARCHITECTURES = {
    "llama": _llama_like(transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": _llama_like(transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": _llama_like(transformers.Qwen3Config, transformers.Qwen3ForCausalLM, head_dim=8),
    "mistral": _mistral,  # with a sliding window: rollback must undo it
    "gpt2": lambda vocab_size, num_layers, window: (
        transformers.GPT2Config(
            vocab_size=vocab_size, n_embd=32, n_layer=num_layers, n_head=4, bos_token_id=None, eos_token_id=None
        ),
        transformers.GPT2LMHeadModel,
    ),  # learned positions
    "opt": lambda vocab_size, num_layers, window: (
        transformers.OPTConfig(
            vocab_size=vocab_size,
            hidden_size=32,
            num_hidden_layers=num_layers,
            num_attention_heads=4,
            ffn_dim=64,
            word_embed_proj_dim=32,
        ),
        transformers.OPTForCausalLM,
    ),  # learned positions with an offset
    "gpt_neo": _gpt_neo,  # local attention applied inside the model
    "bloom": lambda vocab_size, num_layers, window: (
        transformers.BloomConfig(vocab_size=vocab_size, hidden_size=32, n_layer=num_layers, n_head=4),
        transformers.BloomForCausalLM,
    ),  # ALiBi
    "falcon": lambda vocab_size, num_layers, window: (
        transformers.FalconConfig(
            vocab_size=vocab_size,
            hidden_size=32,
            num_hidden_layers=num_layers,
            num_attention_heads=4,
            alibi=True,
            new_decoder_architecture=False,
            multi_query=True,
        ),
        transformers.FalconForCausalLM,
    ),  # ALiBi
    "mpt": lambda vocab_size, num_layers, window: (
        transformers.MptConfig(vocab_size=vocab_size, d_model=32, n_layers=num_layers, n_heads=4, expansion_ratio=2),
        transformers.MptForCausalLM,
    ),  # ALiBi; its config says use_cache=False
    "deepseek_v2": _mla(
        transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM, first_k_dense_replace=1, **_MOE
    ),
    "deepseek_v3": _mla(
        transformers.DeepseekV3Config,
        transformers.DeepseekV3ForCausalLM,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        **_MOE,
    ),
    "minicpm3": _mla(transformers.MiniCPM3Config, transformers.MiniCPM3ForCausalLM),
    "deepseek_v32": _mla(  # indexed attention: a lightning indexer picks each query's top-k tokens
        transformers.DeepseekV32Config,
        transformers.DeepseekV32ForCausalLM,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        **_MOE,
        **_INDEXER,
    ),
    "glm_moe_dsa": _mla(  # GLM-5: indexed attention, a later layer reusing an earlier one's choice
        transformers.GlmMoeDsaConfig,
        transformers.GlmMoeDsaForCausalLM,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        **_MOE,
        **_INDEXER,
    ),
    "llama4": _llama4,  # chunked attention
    "deepseek_v4": _deepseek_v4,  # compressed attention beside a sliding window
    "glm4_moe_lite": _mla(
        transformers.Glm4MoeLiteConfig,
        transformers.Glm4MoeLiteForCausalLM,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        **_MOE,
    ),
    "gemma4": _gemma4,  # per-layer head sizes; sliding layers
    "gemma3n": _gemma3n,  # KV sharing: layers that read another layer's keys and values
    "bert": _bert_decoder,  # causal through is_decoder=True
    "bart": _bart_decoder,  # no position_ids: tokens placed by cache slot
    "moshi": _moshi,  # a window its own masks ignore
}
# Llama-like architectures: what the block-diffusion drafter (RoPE, RMSNorm, SwiGLU geometry) can be built for.
LLAMA_LIKE = ("llama", "qwen2", "qwen3", "mistral")


# Tiny causal LMs that keep state besides (or instead of) keys and values: recurrent, linear-attention and convolution
# state ("state layers"), which a rollback cannot cut back by position. Qwen3.5, Qwen3-Next and Jamba get
# 2 * num_layers layers, a state layer then an attention layer, so that every size has both (their default layer
# patterns would make the first layers all state layers); each Falcon-H1 layer is both. `layer_census` (and
# `state_layer_count`, `attention_layer_count`) says what a built model holds.

# Gated DeltaNet's heads (Qwen3.5, Qwen3-Next): more value heads than key heads, as released.
_GATED_DELTANET = dict(
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
)


def _gated_deltanet_hybrid(vocab_size: int, num_layers: int) -> dict:
    """Qwen3.5's and Qwen3-Next's sizes: a Gated DeltaNet layer (a conv and a recurrent state) before each
    full-attention layer."""
    return dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2 * num_layers,
        layer_types=["linear_attention", "full_attention"] * num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        **_GATED_DELTANET,
    )


def _qwen3_5(vocab_size, num_layers, window):
    """Qwen3.5 (text): Gated DeltaNet layers between full-attention layers."""
    return transformers.Qwen3_5TextConfig(
        **_gated_deltanet_hybrid(vocab_size, num_layers)
    ), transformers.Qwen3_5ForCausalLM


def _qwen3_next(vocab_size, num_layers, window):
    """Qwen3-Next: Qwen3.5's layer pattern, each layer's MLP a small mixture of experts with a shared expert."""
    return transformers.Qwen3NextConfig(
        **_gated_deltanet_hybrid(vocab_size, num_layers),
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    ), transformers.Qwen3NextForCausalLM


def _jamba(vocab_size, num_layers, window):
    """Jamba: Mamba layers (conv and SSM state) with an attention layer every second layer; the layers after a
    Mamba layer (the attention ones) have a small mixture of experts."""
    return transformers.JambaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2 * num_layers,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=4,
        num_experts_per_tok=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        mamba_d_state=4,
        mamba_d_conv=4,
        mamba_expand=2,
    ), transformers.JambaForCausalLM


def _falcon_h1(vocab_size, num_layers, window):
    """Falcon-H1: every layer runs Mamba-2 (conv and SSM state) and attention side by side ("hybrid" cache layers);
    mamba_n_heads * mamba_d_head = mamba_expand * hidden_size, chunks of 8 tokens."""
    return transformers.FalconH1Config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        mamba_d_ssm=None,  # mamba_expand * hidden_size
        mamba_expand=2,
        mamba_n_heads=8,
        mamba_d_head=8,
        mamba_n_groups=1,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_chunk_size=8,
    ), transformers.FalconH1ForCausalLM


def _mamba2(vocab_size, num_layers, window):
    """Mamba-2: num_heads * head_dim = expand * hidden_size; chunks of 8 tokens, so longer prompts cross chunks."""
    return transformers.Mamba2Config(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=num_layers,
        num_heads=8,
        head_dim=8,
        state_size=16,
        n_groups=1,
        conv_kernel=4,
        chunk_size=8,
        expand=2,
    ), transformers.Mamba2ForCausalLM


def _mamba(vocab_size, num_layers, window):
    """Mamba (1): a selective SSM and a causal conv in each layer."""
    return transformers.MambaConfig(
        vocab_size=vocab_size, hidden_size=32, num_hidden_layers=num_layers, state_size=8, expand=2, conv_kernel=4
    ), transformers.MambaForCausalLM


def _rwkv(vocab_size, num_layers, window):
    """RWKV (4): its state (five tensors, one slice per layer) lives outside the Cache API, in the output's `state`.
    One layer more than asked: its weight init divides by num_hidden_layers - 1."""
    return transformers.RwkvConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        attention_hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=num_layers + 1,
    ), transformers.RwkvForCausalLM


def _xlstm(vocab_size, num_layers, window):
    """xLSTM (mLSTM blocks): its state lives in an xLSTMCache. Its query, key and value widths round up to multiples of
    64, so it is 64 wide (as the survey's tiny xLSTM)."""
    return transformers.xLSTMConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        embedding_dim=64,
        num_hidden_layers=num_layers,
        num_blocks=num_layers,
        num_heads=4,
        qk_dim_factor=1.0,
    ), transformers.xLSTMForCausalLM


STATE_ARCHITECTURES = {
    "qwen3_5": _qwen3_5,  # Gated DeltaNet + full attention
    "qwen3_next": _qwen3_next,  # Gated DeltaNet + full attention, MoE
    "jamba": _jamba,  # Mamba + attention, MoE
    "falcon_h1": _falcon_h1,  # Mamba-2 beside attention in every layer
    "mamba2": _mamba2,
    "mamba": _mamba,
    "rwkv": _rwkv,  # state outside the Cache API
    "xlstm": _xlstm,  # state in its own xLSTMCache
}
# The ones that also have attention layers.
HYBRID_STATE = ("qwen3_5", "qwen3_next", "jamba", "falcon_h1")
# The property strategies draw these as any other verifier (RWKV's state is kept by snapshot and replay,
# `verifiers.own_state`; its batches are refused, as `generate` mixes their rows).
ARCHITECTURES |= {
    name: STATE_ARCHITECTURES[name]
    for name in ("qwen3_5", "qwen3_next", "jamba", "falcon_h1", "mamba2", "mamba", "rwkv")
}


def tiny_model(
    arch: str,
    vocab_size: int,
    num_layers: int,
    seed: int,
    sliding_window: int | None = None,
    max_position_embeddings: int = 128,
):
    """A random causal LM small enough for hundreds of examples a minute (`sliding_window`: the window of Mistral,
    Gemma 4 and Moshi, or GPT-Neo's local window). `arch` names an `ARCHITECTURES` or a `STATE_ARCHITECTURES` entry.

    initializer_range 0.3 makes logits spread out, so top-2 near ties are as rare as in real models.
    """
    config, model_cls = (ARCHITECTURES | STATE_ARCHITECTURES)[arch](vocab_size, num_layers, sliding_window)
    config.max_position_embeddings = max_position_embeddings
    config.initializer_range = 0.3
    config.tie_word_embeddings = False
    config.bos_token_id = config.eos_token_id = config.pad_token_id = None
    with torch.random.fork_rng():  # the same weights for the same seed, without touching the caller's RNG
        torch.manual_seed(seed)
        return model_cls(config).eval()


@dataclass
class LayerCensus:
    """The layers that one short forward filled in a model's cache: `state` layers (recurrent, linear-attention or
    convolution state) and `attention` layers (keys and values); a hybrid layer counts as both."""

    state: int
    attention: int


def _own_state_models() -> tuple[type, ...]:
    """The model classes whose state lives outside `DynamicCache`: RWKV (the output's `state`), xLSTM (an
    xLSTMCache) and MiniMax (a MiniMaxCache, which refuses any other)."""
    return (transformers.RwkvPreTrainedModel, transformers.xLSTMPreTrainedModel, transformers.MiniMaxPreTrainedModel)


def layer_census(model, num_tokens: int = 5, seed: int = 0) -> LayerCensus:
    """Count the state and attention layers of `model` by running one forward of `num_tokens` random tokens with a
    cache, and counting the layers that the forward filled, so that a tiny config provably contains what it is meant
    to test (a config's declared layer pattern may not be what its model builds, or may be silently overridden).

    Models that keep their state in the Cache API run with `cache=DynamicCache(config=model.config)`: a state layer is
    a `LinearAttentionCacheLayerMixin` with an initialised conv or recurrent state, an attention layer a key/value
    layer that holds keys. Others run with their own cache (`use_cache=True`): RWKV's `state` (a layer counts where
    its slice changed from the initial state), xLSTM's `rnn_state` (where it is no longer zero), MiniMax's
    `linear_cache` (a tensor per lightning-attention layer). State kept on the modules themselves (RecurrentGemma's
    recurrent blocks: `conv1d_state`, `recurrent_states`) counts once per outermost module that holds a tensor
    attribute named `*_state` or `*_states`."""
    from transformers.cache_utils import CacheLayerMixin, LinearAttentionCacheLayerMixin

    vocab = model.get_input_embeddings().num_embeddings
    generator = torch.Generator("cpu").manual_seed(seed)
    ids = torch.randint(0, vocab, (1, num_tokens), generator=generator, device="cpu").to(model.device)
    with torch.inference_mode():
        if isinstance(model, _own_state_models()):
            out, cache = model(ids, use_cache=True), None
        else:
            cache = DynamicCache(config=model.config)
            out = model(ids, cache=cache, use_cache=True)
    if cache is None:
        cache = getattr(out, "cache", None)
    state = attention = 0
    for layer in getattr(cache, "layers", []):  # the Cache API (and MiniMax's key/value layers)
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            flags = (layer.is_conv_states_initialized, layer.is_recurrent_states_initialized, layer.has_previous_state)
            state += any(any(flag.values()) for flag in flags)
        if isinstance(layer, CacheLayerMixin) and getattr(layer, "keys", None) is not None and layer.keys.numel():
            attention += 1
    state += sum(isinstance(tensor, torch.Tensor) for tensor in getattr(cache, "linear_cache", []))  # MiniMax
    rnn_state = getattr(cache, "rnn_state", None)  # xLSTM: {layer: its state tensors}, zeros until a forward
    for layer_state in (rnn_state or {}).values():
        state += any(bool(tensor.any()) for tensor in layer_state)
    rwkv = getattr(out, "state", None)
    if isinstance(rwkv, (list, tuple)) and rwkv:
        # Five tensors [batch, width, layers]: the last inputs of the two token shifts, the WKV numerator and
        # denominator (all initially 0) and its running maximum (initially -1e38)
        initial = [0.0, 0.0, 0.0, 0.0, -1e38]
        for i in range(rwkv[0].shape[-1]):
            state += any(bool((s[..., i] != init).any()) for s, init in zip(rwkv, initial))
    state += _module_held_states(model)
    return LayerCensus(state=state, attention=attention)


def _module_held_states(model) -> int:
    """The outermost modules of `model` holding a tensor in an attribute named `*_state` or `*_states` (not a
    parameter or buffer: state a module keeps between forwards, as RecurrentGemma's recurrent blocks do)."""
    holders = []
    for name, module in model.named_modules():
        held = any(
            isinstance(value, torch.Tensor) and key.endswith(("_state", "_states"))
            for key, value in vars(module).items()
        )
        if held and not any(name.startswith(outer + ".") for outer in holders):
            holders.append(name)
    return len(holders)


def state_layer_count(model, num_tokens: int = 5) -> int:
    """How many layers of `model` keep recurrent, linear-attention or convolution state (see `layer_census`)."""
    return layer_census(model, num_tokens).state


def attention_layer_count(model, num_tokens: int = 5) -> int:
    """How many layers of `model` keep attention keys and values (see `layer_census`)."""
    return layer_census(model, num_tokens).attention


# Drafters that try to break the engine: a drafter can never make it emit a token the verifier would not.
def smoothed_point_masses(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """An honest proposal distribution for drafted `tokens` [n]: 0.9 on each token, the rest spread evenly [n, vocab]."""
    probs = torch.full((len(tokens), vocab_size), 0.1 / vocab_size)
    probs[torch.arange(len(tokens)), tokens] += 0.9
    return probs


class AdversarialDrafter(Drafter):
    """A third-party drafter that proposes garbage, repeats, EOS runs and random lengths (always valid shapes)."""

    max_draft_len = 12

    def __init__(self, vocab_size: int, eos_token_id: int | None, seed: int):
        self.vocab_size, self.eos = vocab_size, eos_token_id
        self.rng = torch.Generator(torch.get_default_device()).manual_seed(
            seed
        )  # not reset per call: each call sees new garbage

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        n = int(torch.randint(0, max_tokens + 1, (), generator=self.rng))
        mode = int(torch.randint(0, 4, (), generator=self.rng))
        last = int(ctx.input_ids[0, -1])
        if mode == 0:
            tokens = torch.randint(0, self.vocab_size, (n,), generator=self.rng)
        elif mode == 1:
            tokens = torch.full((n,), last)
        elif mode == 2 and self.eos is not None:
            tokens = torch.full((n,), self.eos)
        else:  # echo the sequence backwards: plausible-looking but wrong
            tokens = ctx.input_ids[0].flip(0)[:n].clone()
        if not ctx.do_sample:
            return Draft(tokens)
        return Draft(tokens, smoothed_point_masses(tokens, self.vocab_size))


class RandomTreeDrafter(Drafter):
    """A token-tree drafter of random shapes: a deep chain, a wide fan, duplicate siblings, EOS inside branches,
    random garbage, and the verifier's own greedy path (from `guide`, a drafter) with random siblings around each
    of its nodes, so that walks go deep and take children that are not the first."""

    max_draft_len = 8
    max_nodes = 24

    def __init__(self, vocab_size: int, eos_token_id: int | None, seed: int, guide: Drafter | None = None):
        self.vocab_size, self.eos, self.guide = vocab_size, eos_token_id, guide
        self.rng = torch.Generator().manual_seed(seed)

    def reset(self, ctx: DraftContext) -> None:
        if self.guide is not None:
            self.guide.reset(ctx)

    def fork(self) -> RandomTreeDrafter:
        twin = copy.copy(self)
        twin.guide = None if self.guide is None else self.guide.fork()
        return twin

    def _int(self, high: int) -> int:
        return int(torch.randint(0, high, (), generator=self.rng))

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        tokens: list[int] = []
        parents: list[int] = []

        def add(token: int, parent: int) -> int:
            if len(tokens) < max_tokens:
                tokens.append(token)
                parents.append(parent)
            return len(tokens) - 1

        shape = self._int(6)
        random_token = lambda: self._int(self.vocab_size)  # noqa: E731
        if shape == 0:  # a deep chain
            parent = -1
            for _ in range(self._int(max_tokens + 1)):
                parent = add(random_token(), parent)
        elif shape == 1:  # a wide fan under the pending token
            for _ in range(self._int(max_tokens + 1)):
                add(random_token(), -1)
        elif shape == 2:  # duplicate siblings, each with children
            token = random_token()
            for _ in range(3):
                node = add(token, -1)
                add(random_token(), node)
        elif shape == 3:  # random parents, EOS inside branches
            for i in range(self._int(max_tokens + 1)):
                eos = self.eos is not None and self._int(3) == 0
                add(self.eos if eos else random_token(), self._int(i + 1) - 1)
        else:  # the guide's path, random siblings before or after each of its nodes
            path = [] if self.guide is None else self.guide.propose(ctx, self.max_draft_len).tokens.tolist()
            parent = -1
            for token in path:
                if self._int(2):
                    add(random_token(), parent)
                node = add(token, parent)
                if self._int(2):
                    add(random_token(), parent)
                if node != len(tokens) - 1 and tokens[node] != token:
                    break  # the budget ran out
                parent = node
        return Draft(torch.tensor(tokens, dtype=torch.long), parents=torch.tensor(parents, dtype=torch.long))


def byte_tokenizer(chat_template: bool = True):
    """A tokenizer of one token per byte (256 ids, no merges, no special tokens), built offline, with a two-role chat
    template (`<user>...\\n<assistant>`) or none: what the tests' tiny verifiers are saved with."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    byte_level = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    byte_level.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=byte_level)
    if chat_template:
        tokenizer.chat_template = (
            "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}"
        )
    return tokenizer


@dataclass
class GreedyReport:
    reference: torch.Tensor  # model.generate's sequence
    output: torch.Tensor  # hybrid.generate's sequence
    stats: hybrid.GenerationStats
    near_tie_at: int | None  # index of the new token where a near tie let the runs diverge, else None


def _reference(model, input_ids: torch.Tensor, **kwargs):
    """`model.generate`'s output, leaving the model's rotary state where it was (dynamic NTK RoPE keeps some): the
    hybrid call it is compared with starts where `generate` did."""
    with rotary_state_kept(model):
        return model.generate(input_ids, **kwargs)


def _top2_gap(scores: torch.Tensor, dtype: torch.dtype) -> tuple[float, float]:
    """The gap between the two best of `scores` [vocab], and the gap below which `dtype`'s rounding may swap them."""
    top2 = scores.topk(2).values
    return float(top2[0] - top2[1]), near_tie_eps(dtype, float(top2[0]))


def check_greedy_lossless(
    model, input_ids: torch.Tensor, drafter, scheduler=None, hybrid_kwargs: dict | None = None, **kwargs
) -> GreedyReport:
    """Assert `hybrid.generate` == `model.generate` under greedy decoding (up to the near-tie contract).

    `kwargs` go to both calls; `hybrid_kwargs` to hybrid's only (e.g. `cache_implementation="static"`)."""
    kwargs = {**kwargs, "do_sample": False}
    ref = _reference(model, input_ids, return_dict_in_generate=True, output_scores=True, **kwargs)
    out, stats = hybrid.generate(
        model, input_ids, drafter=drafter, scheduler=scheduler, return_stats=True, **kwargs, **(hybrid_kwargs or {})
    )
    prompt_len = input_ids.shape[1]
    expected, got = ref.sequences[0, prompt_len:], out[0, prompt_len:]
    check_stats_consistent(stats, got.shape[0])
    GREEDY_CHECKS["checked"] += 1
    if torch.equal(expected, got):
        return GreedyReport(ref.sequences, out, stats, None)
    n = min(expected.shape[0], got.shape[0])
    mismatch = (expected[:n] != got[:n]).nonzero()
    if mismatch.numel() == 0:  # one is a strict prefix of the other: a stop decision differed
        raise AssertionError(
            f"hybrid stopped after {got.shape[0]} new tokens, model.generate after {expected.shape[0]}; "
            f"common prefix {expected[:n].tolist()}"
        )
    j = int(mismatch[0])
    dtype = compute_dtype(model)
    gap, eps = _top2_gap(ref.scores[j][0], dtype)
    if gap >= eps:
        raise AssertionError(
            f"greedy output differs at new token {j}: model.generate chose {int(expected[j])}, hybrid chose "
            f"{int(got[j])}; top-2 score gap {gap:.3g} >= {eps:.3g} (not a near tie in {dtype})\n"
            f"expected {expected.tolist()}\n     got {got.tolist()}"
        )
    GREEDY_CHECKS["near_ties"] += 1
    return GreedyReport(ref.sequences, out, stats, j)


def check_batch_greedy_lossless(
    model, input_ids: torch.Tensor, drafter, scheduler=None, hybrid_kwargs: dict | None = None, **kwargs
) -> list[int]:
    """Assert a batch's greedy `hybrid.generate` == `model.generate` on the same batch (`kwargs`: its
    attention_mask, stopping settings, ...), row by row, up to the near-tie contract. Rows are compared whole: where
    `generate` pads a stopped row and where it lets the row run on to the batch's end. Returns the rows whose near
    tie let the runs diverge; after one, the batch's end may move, and rows are compared on their common length."""
    kwargs = {**kwargs, "do_sample": False}
    ref = _reference(model, input_ids, return_dict_in_generate=True, output_scores=True, **kwargs)
    out = hybrid.generate(model, input_ids, drafter=drafter, scheduler=scheduler, **kwargs, **(hybrid_kwargs or {}))
    prompt_len = input_ids.shape[1]
    expected, got = ref.sequences[:, prompt_len:], out[:, prompt_len:]
    GREEDY_CHECKS["checked"] += 1
    if torch.equal(expected, got):
        return []
    n = min(expected.shape[1], got.shape[1])
    dtype = compute_dtype(model)
    near_ties = []
    for r in range(expected.shape[0]):
        mismatch = (expected[r, :n] != got[r, :n]).nonzero()
        if mismatch.numel() == 0:
            continue
        j = int(mismatch[0])
        gap, eps = _top2_gap(ref.scores[j][r], dtype)
        if gap >= eps:
            raise AssertionError(
                f"greedy output of row {r} differs at new token {j}: model.generate chose {int(expected[r, j])}, "
                f"hybrid chose {int(got[r, j])}; top-2 score gap {gap:.3g} >= {eps:.3g} (not a near tie in {dtype})"
                f"\nexpected {expected.tolist()}\n     got {got.tolist()}"
            )
        near_ties.append(r)
    if not near_ties:  # every row agrees as far as both go: the batch ended elsewhere
        raise AssertionError(
            f"the batch ended after {got.shape[1]} new tokens in hybrid, after {expected.shape[1]} in model.generate"
            f"\nexpected {expected.tolist()}\n     got {got.tolist()}"
        )
    GREEDY_CHECKS["near_ties"] += 1
    return near_ties


def check_sampled_identical(
    model, input_ids: torch.Tensor, drafter, seed: int, scheduler=None, hybrid_kwargs: dict | None = None, **kwargs
) -> int | None:
    """Assert `hybrid.generate` == `model.generate` under sampling after the same `torch.manual_seed(seed)`, up to
    the boundary-draw contract. Returns the index of the new token where a boundary draw diverged, else None."""
    kwargs = {**kwargs, "do_sample": True, "return_dict_in_generate": True, "output_scores": True}
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        ref = _reference(model, input_ids, **kwargs)
        torch.manual_seed(seed)
        out = hybrid.generate(model, input_ids, drafter=drafter, scheduler=scheduler, **kwargs, **(hybrid_kwargs or {}))
    prompt_len = input_ids.shape[1]
    expected, got = ref.sequences[0, prompt_len:], out.sequences[0, prompt_len:]
    SAMPLING_CHECKS["checked"] += 1
    if torch.equal(expected, got):
        return None
    n = min(expected.shape[0], got.shape[0])
    mismatch = (expected[:n] != got[:n]).nonzero()
    assert mismatch.numel(), f"hybrid stopped after {got.shape[0]} new tokens, model.generate after {expected.shape[0]}"
    j = int(mismatch[0])
    p_ref, p_out = torch.softmax(ref.scores[j][0], -1), torch.softmax(out.scores[j][0], -1)
    gap = float((p_ref - p_out).abs().max())
    # A probability moves by at most its score's rounding: 1e-4 in float32, more in half precision or autocast.
    eps = max(SAMPLE_EPS, near_tie_eps(compute_dtype(model), float(ref.scores[j][0].max())))
    variates = _draw_variates([torch.softmax(scores[0], -1) for scores in ref.scores[:j]], seed, p_ref)
    won_ref, won_out = int(torch.argmax(p_ref / variates)), int(torch.argmax(p_out / variates))
    if won_ref != int(expected[j]):
        raise AssertionError(
            f"replaying model.generate's draws (seed {seed}) gives token {won_ref} at new token {j}, not its "
            f"{int(expected[j])}: this torch.multinomial draws otherwise, and the boundary cannot be judged"
        )
    if gap >= eps or won_out != int(got[j]):
        raise AssertionError(
            f"sampled output differs at new token {j} (seed {seed}): model.generate drew {int(expected[j])}, hybrid "
            f"{int(got[j])}; their distributions differ by {gap:.3g} (rounding: < {eps:.3g}), and under the same draw "
            f"hybrid's distribution gives {won_out} (not a boundary draw)\nexpected {expected.tolist()}\n"
            f"     got {got.tolist()}"
        )
    SAMPLING_CHECKS["boundary_draws"] += 1
    return j


def _draw_variates(earlier: list[torch.Tensor], seed: int, probs: torch.Tensor) -> torch.Tensor:
    """The exponential variates E [vocab] of the draw after `earlier` (each draw's probabilities) following
    `torch.manual_seed(seed)`. `torch.multinomial(p, 1)` draws argmax(p / E), one E ~ Exp(1) a token, so the token
    of a draw follows from E and its distribution: a divergence that the two runs' distributions explain under the
    same E is a boundary draw, and one they do not is not, whichever tokens they are."""
    with torch.random.fork_rng(devices=[probs.device.index or 0] if probs.device.type == "cuda" else []):
        torch.manual_seed(seed)
        for p in earlier:
            torch.multinomial(p[None], 1)
        return torch.empty_like(probs[None]).exponential_(1)[0]


def check_stats_consistent(stats: hybrid.GenerationStats, new_tokens: int) -> None:
    """Every statistic derives from the steps: emitted = accepted + 1, except a stop-truncated last step."""
    steps = list(zip(stats.drafted, stats.accepted, stats.emitted))
    assert stats.new_tokens == new_tokens == sum(stats.emitted), (stats.new_tokens, new_tokens)
    assert stats.verifier_forwards == len(steps) >= 1
    assert steps[0] == (0, 0, 1), "the prefill drafts nothing and emits one token"
    for i, (drafted, accepted, emitted) in enumerate(steps):
        assert 0 <= accepted <= drafted, (i, drafted, accepted)
        if i < len(steps) - 1:
            assert emitted == accepted + 1, (i, accepted, emitted)
        else:
            assert 1 <= emitted <= accepted + 1, (i, accepted, emitted)
    assert math.isclose(stats.tau, new_tokens / len(steps))


def check_cache_matches_prefill(
    model, sequences: torch.Tensor, cache, atol: float = 1e-4, prompt_length: int | None = None
) -> None:
    """The cache left by a generation equals a fresh prefill of the sequence minus its newest token; with
    `prompt_length`, the cache `generate` builds: a prefill of the prompt, then one token per forward (which is
    another cache for a model whose own mask ignores the window its config declares, as Moshi's does). A model with
    a state structure of its own (RWKV, xLSTM) left that structure, compared state by state."""
    if state_format(model) is not None:
        _check_own_state_matches(model, sequences, cache, atol, prompt_length)
        return
    fresh = DynamicCache(config=model.config)
    prefill = sequences.shape[1] - 1 if prompt_length is None else prompt_length
    with torch.inference_mode():
        model(sequences[:, :prefill], cache=fresh, use_cache=True)
        for t in range(prefill, sequences.shape[1] - 1):
            model(sequences[:, t : t + 1], cache=fresh, use_cache=True)
    assert cache.get_seq_length() == fresh.get_seq_length() == sequences.shape[1] - 1
    for i, (mine, theirs) in enumerate(zip(cache.layers, fresh.layers)):
        if isinstance(theirs, LinearAttentionCacheLayerMixin):  # recurrent / conv states: the one-token kernel's
            _check_states_match(i, mine, theirs, atol)
        if getattr(theirs, "keys", None) is None:  # a layer that stores nothing (KV sharing: it reads another's)
            continue
        for name, a, b in _layer_tensors(mine, theirs):
            assert a.shape == b.shape, f"layer {i} {name}: {tuple(a.shape)} vs fresh prefill {tuple(b.shape)}"
            # Within `atol` of their largest magnitude, as the states below: behind a recurrent layer, a verify's
            # batched products round otherwise than one-token steps, and the recurrence carries it on
            err = float((a - b).abs().max() / b.abs().max().clamp(min=1)) if a.numel() else 0.0
            assert err <= atol, f"layer {i} {name} differs from a fresh prefill by {err:.3g} of its largest magnitude"


def _layer_tensors(mine, theirs):
    """(name, mine, theirs) for each tensor two cache layers hold: keys and values, an indexer's keys (indexed
    attention), and DeepSeek-V4's compressor buffers, entries and window halves."""
    yield from (("keys", mine.keys, theirs.keys), ("values", mine.values, theirs.values))
    if getattr(theirs, "indexer_keys", None) is not None:
        yield "indexer_keys", mine.indexer_keys, theirs.indexer_keys
    for store in ("buffer_kv", "buffer_gate", "compressed_kv", "overlap_kv", "overlap_gate"):
        for name, b in getattr(theirs, store, {}).items():
            a = getattr(mine, store)[name]
            assert (a is None) == (b is None), f"{store}[{name!r}]: {a is None=} but the fresh cache's {b is None=}"
            if b is not None:
                yield f"{store}[{name!r}]", a, b
    for name, count in getattr(theirs, "entry_count", {}).items():
        assert mine.entry_count[name] == count, f"entry_count[{name!r}] {mine.entry_count[name]} vs {count}"


def _check_own_state_matches(model, sequences: torch.Tensor, state, atol: float, prompt_length: int | None) -> None:
    """`state` (the model's own structure) equals that of a fresh prefill, then one token per forward, within `atol`
    of each tensor's largest magnitude; entries no token has set (RWKV's running maximum starts at -1e38) are
    skipped."""
    forwards = StateForwards(model)
    prefill = sequences.shape[1] - 1 if prompt_length is None else prompt_length
    with torch.inference_mode():
        forwards(sequences[:, :prefill])
        for t in range(prefill, sequences.shape[1] - 1):
            forwards(sequences[:, t : t + 1])
    tensors = forwards.format.tensors
    for i, (a, b) in enumerate(zip(tensors(state), tensors(forwards.state), strict=True)):
        assert a.shape == b.shape, f"state tensor {i}: {tuple(a.shape)} vs fresh {tuple(b.shape)}"
        set_ = b.abs() < 1e30
        a, b = a[set_].float(), b[set_].float()
        err = float((a - b).abs().max() / b.abs().max().clamp(min=1)) if b.numel() else 0.0
        assert err <= atol, f"state tensor {i} differs from a fresh decode by {err:.3g}"


def _check_states_match(i: int, mine, theirs, atol: float) -> None:
    """Layer i's recurrent and convolution states equal a fresh decode's, within `atol` of their largest magnitude
    (a verify's convolution runs over a wider window, which may round otherwise)."""
    for name in ("conv_states", "recurrent_states"):
        for state, (a, b) in enumerate(zip(getattr(mine, name).values(), getattr(theirs, name).values())):
            assert (a is None) == (b is None), f"layer {i} {name}[{state}]: held by one cache only"
            if a is None:
                continue
            assert a.shape == b.shape, f"layer {i} {name}[{state}]: {tuple(a.shape)} vs fresh {tuple(b.shape)}"
            err = float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1))
            assert err <= atol, f"layer {i} {name}[{state}] differs from a fresh decode by {err:.3g}"


def sequence_distribution(model, input_ids: torch.Tensor, num_tokens: int, **kwargs) -> dict[tuple[int, ...], float]:
    """Exact probability of every continuation of `num_tokens` tokens under `model.generate` sampling.

    Enumerates the vocabulary (only for tiny vocabularies); p at each position goes through the
    same processors and warpers `generate` builds from `kwargs`.
    """
    config, _ = model._prepare_generation_config(None, do_sample=True, max_new_tokens=num_tokens, **kwargs)
    model._prepare_special_tokens(config, False, device=input_ids.device, batch_size=1)
    config = model._prepare_generated_length(config, False, True, "input_ids", input_ids.shape[1], input_ids)
    processors = model._get_logits_processor(config, input_ids.shape[1], input_ids, device=input_ids.device)
    vocab = model.get_output_embeddings().weight.shape[0]
    dist = {}
    with torch.inference_mode():
        for continuation in itertools.product(range(vocab), repeat=num_tokens):
            seq = torch.cat([input_ids, input_ids.new_tensor([continuation])], dim=1)
            logits = model(seq).logits[0, input_ids.shape[1] - 1 : -1].float()
            prob = 1.0
            for i, token in enumerate(continuation):
                scores = processors(seq[:, : input_ids.shape[1] + i], logits[i][None])[0]
                prob *= float(torch.softmax(scores, -1)[token])
            dist[continuation] = prob
    return dist


def chi_square_statistic(counts: dict, probs: dict, min_expected: float = 5.0) -> tuple[float, int]:
    """Pearson's chi-square of observed `counts` against `probs`, pooling cells expected below `min_expected`.

    Returns (statistic, degrees of freedom).
    """
    n = sum(counts.values())
    cells = sorted(probs, key=probs.get)
    observed, expected, pool_o, pool_e = [], [], 0.0, 0.0
    for cell in cells:
        pool_o += counts.get(cell, 0)
        pool_e += probs[cell] * n
        if pool_e >= min_expected:
            observed.append(pool_o)
            expected.append(pool_e)
            pool_o = pool_e = 0.0
    if pool_e > 0 or pool_o > 0:  # leftovers join the last cell
        observed[-1] += pool_o
        expected[-1] += pool_e
    unexpected = sum(c for cell, c in counts.items() if cell not in probs)
    if unexpected:
        return math.inf, max(len(observed) - 1, 1)
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    return stat, len(observed) - 1


def chi_square_critical(df: int, alpha: float) -> float:
    """Upper `alpha` quantile of chi-square(df), Wilson-Hilferty approximation (no SciPy needed)."""
    z = _normal_quantile(1 - alpha)
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _normal_quantile(p: float) -> float:
    lo, hi = -10.0, 10.0
    for _ in range(100):  # bisection on the normal CDF
        mid = (lo + hi) / 2
        if 0.5 * (1 + math.erf(mid / math.sqrt(2))) < p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
