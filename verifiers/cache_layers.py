"""What a model's config says about the layers of its cache: each layer's attention kind and the sliding window (what
the masks must express), which model layer each cache layer holds, which layers store nothing, and the heads and
widths each holds (the cache's fingerprint)."""

from __future__ import annotations

from transformers.cache_utils import get_layer_types_and_kwargs

from verifiers.own_state import STATE_FORMATS
from verifiers.state_layers import layer_states

# Attention the cache's masks express: indexed attention (DeepSeek-V3.2's) masks as full attention, its indexer picking
# among what the mask shows (`verifiers.indexed`); chunked attention (Llama 4's) sees its own chunk.
LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "indexed_attention")
STATE_ONLY = ("linear_attention", "conv")  # layers that keep recurrent or convolution state and no keys/values
# Layers that attend as another kind besides what else they keep: a hybrid layer's recurrent state, or DeepSeek-V4's
# compressed entries beside its sliding window (`verifiers.compressed`).
HYBRID_ATTENTION = {
    "hybrid": "full_attention",
    "hybrid_sliding": "sliding_attention",
    "compressed_sparse_attention": "sliding_attention",
    "heavily_compressed_attention": "sliding_attention",
}
COMPRESSED = ("compressed_sparse_attention", "heavily_compressed_attention")


def attention_pattern(text_config) -> tuple[list[str], int | None, int | None]:
    """Each layer's attention kind, read as transformers reads it for its own caches (`layer_types`, else each
    layer's `sliding_window` / `attention_chunk_size`), the sliding window and the attention chunk; raises for what
    the cache's masks (`SharedCache.attention_mask`) cannot express."""
    name = type(text_config).__name__
    raw, kwargs = get_layer_types_and_kwargs(text_config)
    # A layer that stores nothing ("dummy": one that reads another layer's keys and values, Gemma 3n's and Gemma 4's
    # KV sharing, or one without attention) is masked as its config names it.
    declared = getattr(text_config, "layer_types", None) or []
    types = [
        (declared[i] if i < len(declared) and declared[i] in LAYER_TYPES else "full_attention")
        if kind == "dummy"
        else kind
        for i, kind in enumerate(raw)
    ]
    # Recurrent / convolution layers keep states (`verifiers.state_layers`), not slots: the masks skip them. A hybrid
    # layer attends as its name says besides.
    types = [HYBRID_ATTENTION.get(kind, kind) for kind in types]
    odd = sorted(set(types) - set(LAYER_TYPES) - set(STATE_ONLY))
    if odd:
        raise ValueError(
            f"{name} has {odd} layers: hybrid's cache serves full, sliding-window, chunked and indexed attention, "
            "and recurrent, linear-attention and convolution layers"
        )
    windows = {
        kw["config"].sliding_window if kind in COMPRESSED else kw.get("sliding_window")
        for kind, kw in zip(raw, kwargs)
        if kind in ("sliding_attention", "hybrid_sliding", *COMPRESSED)
    }
    if None in windows:
        raise ValueError(f"{name} has sliding-attention layers but no sliding_window size")
    if len(windows) > 1:
        raise ValueError(f"{name} has sliding layers of different windows {sorted(windows)}: hybrid's masks take one")
    chunks = {kw.get("sliding_window") for kind, kw in zip(raw, kwargs) if kind == "chunked_attention"}
    if None in chunks or len(chunks) > 1:
        raise ValueError(
            f"{name} has chunked-attention layers of chunk sizes {sorted(chunks, key=str)}: hybrid's masks take one"
        )
    return list(types), next(iter(windows), None), next(iter(chunks), None)


def storing_layers(cache, text_config) -> list:
    """The layers of `cache` a forward stores keys and values in: all but those transformers marks as storing none
    (KV-shared and attention-free layers)."""
    types, _ = get_layer_types_and_kwargs(text_config)
    return [layer for i, layer in enumerate(cache.layers) if i >= len(types) or types[i] != "dummy"]


def cache_layer_sources(text_config) -> list[int]:
    """The model layer whose keys/values each layer of its cache holds: one cache layer per model layer, then for a
    looped model (Dory, `recurrent_kv_cache_mode="per_loop"`) one per recurrent layer and loop after the first, in
    the order the model appends them to a cache that has one layer per model layer."""
    layers = list(range(text_config.num_hidden_layers))
    if getattr(text_config, "loop_num_passes", 1) > 1:  # Inkling2-Loop's passes over a span of its layers
        raise ValueError(
            f"{type(text_config).__name__} runs layers {text_config.loop_layer_index_start}.."
            f"{text_config.loop_layer_index_end - 1} {text_config.loop_num_passes} times, each pass with cache layers "
            "and a position bias of its own that hybrid's cache does not lay out: decode it with model.generate"
        )
    loops = getattr(text_config, "n_recurrent_loops", 1)
    if loops == 1 or not text_config.n_recurrent_layers:
        return layers
    name = type(text_config).__name__
    if text_config.recurrent_kv_cache_mode != "per_loop":
        raise ValueError(
            f"{name} has recurrent_kv_cache_mode={text_config.recurrent_kv_cache_mode!r}: its earlier loops read each "
            "layer's cached tensors directly, not through Cache.update, so they would read all of hybrid's preallocated "
            "slots. hybrid serves recurrent_kv_cache_mode='per_loop' (each loop caches its own keys/values); use "
            "model.generate for this model"
        )
    recurrent = layers[text_config.n_input_layers : text_config.n_input_layers + text_config.n_recurrent_layers]
    return layers + recurrent * (loops - 1)


def cache_fingerprint(model) -> dict:
    """What a cache's shapes depend on: a cache built for a model with another fingerprint cannot serve it.

    "layers" holds (heads, key width, value width) per cache layer, read from each layer's own config (head sizes may
    differ by layer, as in Gemma 4). Multi-head latent attention (DeepSeek-V2 and its kin, `kv_lora_rank`) caches
    one head: the compressed latent as keys, the shared rotary key as values."""
    text = model.config.get_text_config()
    if text.model_type in STATE_FORMATS:  # a state structure of its own (RWKV, xLSTM): no layer holds slots
        return {"architecture": type(model).__name__, "layers": [(0, 0, 0)] * text.num_hidden_layers}
    states = layer_states(text)
    layers = []
    for source in cache_layer_sources(text):
        layer = text.per_layer_config[source]
        if source < len(states) and not states[source][1]:  # recurrent / convolution states only: no slots
            layers.append((0, 0, 0))
            continue
        if getattr(layer, "kv_lora_rank", None):
            layers.append((1, layer.kv_lora_rank, layer.qk_rope_head_dim))
            continue
        heads = getattr(layer, "num_key_value_heads", None) or layer.num_attention_heads
        head_dim = getattr(layer, "head_dim", None) or layer.hidden_size // layer.num_attention_heads
        layers.append((heads, head_dim, head_dim))
    return {"architecture": type(model).__name__, "layers": layers}
