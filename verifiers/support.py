"""Whether a model can be served, and why not: every refusal names the model's trait and the fix.

hybrid reproduces `model.generate` only for a model whose forward it can feed as it does: a decoder-only LM, one
token's outputs computed from its own row and the ones before it, keys and values kept in the transformers Cache it
is passed and rolled back by moving a length, positions told by `position_ids`, and, for rows of different lengths,
trees and the static layout, attention through the masks hybrid builds. `check_support` asks all of it once, when a
`Verifier` is built; `check_masks` asks what a prompt's masked tokens need. Most answers are read from the config and
the modules; the rest are told by tiny forwards (`verifiers.probes`).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import get_layer_types_and_kwargs

from verifiers.cache import holed_rows
from verifiers.cache_layers import COMPRESSED, attention_pattern, cache_fingerprint, cache_layer_sources
from verifiers.indexed import indexers
from verifiers.own_state import STATE_FORMATS, state_format
from verifiers.probes import (
    attends_ahead,
    batching_changes_outputs,
    cache_feed_problem,
    padding_changes_outputs,
    records_each_state,
    scores_depend_on_width,
)
from verifiers.state_layers import attention_free, layer_states

# Attention implementations that take the cache's 4D additive masks (`SharedCache.attention_mask`). Others
# (flash_attention_2) build their own causal mask, which is right only when every row has the same length.
MASKED_ATTENTION = ("eager", "sdpa")
# The width `cache_feed_problem` probes for a forward of several tokens: the pending token and two drafts.
SEVERAL_TOKENS = 3


def check_support(
    model,
    role: str = "verifier",
    max_width: int = 1,
    static: bool = False,
    hidden_layers: tuple[int, ...] = (),
    compiled: bool = False,
) -> str | None:
    """Raise, naming the fix, unless `model` can serve as `role` ("verifier" or "drafter") with forwards of up to
    `max_width` tokens, in the static layout where `static` (its step `compiled`, as on a GPU), keeping the hidden
    states of `hidden_layers`.

    Returns why the model cannot take per-row masks (`row_mask_problem`; None if it can): it then decodes one row per
    forward, chains only."""
    check_causal_lm(model, role)
    text = model.config.get_text_config()
    num_states = text.num_hidden_layers + 1
    bad = [i for i in hidden_layers if not -num_states <= i < num_states]
    if bad:
        raise ValueError(f"hidden_layers {bad} out of range for a model with {num_states - 1} layers")
    attention_pattern(text)  # raises for attention kinds the cache cannot serve
    cache_layer_sources(text)  # raises for a looped model whose loops read the cache past Cache.update
    # A verifier fed one token per forward (drafter=None) runs what `generate` runs; anything wider needs a mask.
    several = role != "verifier" or max_width > 1
    refusal = state_refusal(model, role, several, static, compiled)
    if refusal:
        raise ValueError(refusal)
    if compiled and several and indexers(model):
        raise ValueError(
            f"cache_implementation='static' compiles one graph per verify width here, and {type(model).__name__}'s "
            "indexers choose each query's tokens as model.generate's steps do by hooks that run eagerly (past "
            "index_topk tokens of context). Drop cache_implementation (the dynamic path serves this model), or pass "
            "disable_compile=True"
        )
    problem = mask_problem(text)
    if problem and several:
        fix = "pass drafter=None (one token per forward, as model.generate)" if role == "verifier" else ""
        raise ValueError(
            f"{type(model).__name__} cannot be a {role} that scores several tokens per forward: {problem}"
            + (f", or {fix}" if fix else "")
        )
    refusal = cache_feed_refusal(model, several, role)
    if refusal:
        raise ValueError(refusal)
    # Rows of different lengths need per-row masks; a model that cannot take them runs one row per forward.
    problem = row_mask_problem(model)
    if static and problem:
        raise ValueError(
            f"cache_implementation='static' reads the cache through hybrid's own per-row masks, and "
            f"{type(model).__name__} cannot take them: {problem}. Drop cache_implementation "
            "(the dynamic path serves this model)"
        )
    return problem


def check_position_scale(model, masks: list[torch.Tensor | None], lengths: list[int], capacity: int) -> None:
    """Raise where `generate` would scale a query by a count hybrid cannot give per row. Llama 4's layers without
    rotary embedding scale their queries by a step function of the position (`attn_temperature_tuning`, one step
    every `floor_scale` positions), counted from the cache's length: over a batch that is one count for every row,
    padding and masked tokens included. Below the first step every scale is 1, and where the positions of a call
    (as `generate` counts them) stay below it, nothing differs."""
    text = model.config.get_text_config()
    if not getattr(text, "attn_temperature_tuning", False) or not hasattr(text, "floor_scale"):
        return
    width = max(n if mask is None else mask.shape[0] for mask, n in zip(masks, lengths))
    reach = capacity + width - min(lengths)  # the furthest position generate's count can reach in this call
    uneven = len(lengths) > 1 or width != lengths[0]
    if uneven and reach >= text.floor_scale - 1:
        raise ValueError(
            f"{type(model).__name__} scales its queries by position past {text.floor_scale - 1} tokens "
            "(attn_temperature_tuning), counting, as model.generate does, one length for all rows of a batch, padding "
            f"included; this call's positions reach {reach}. Pass one prompt per call without padding, or decode "
            "the batch with model.generate"
        )


def check_masks(model, masks: list[torch.Tensor | None]) -> None:
    """Raise unless `model` can honour every prompt mask (1-D, 0 = masked; None: none) as `generate` does:
    `generate` counts a masked token as a position where the model's forward takes no position_ids
    (`slot_position_problem`), and a masked token after a row's first unmasked one in attention windows that some
    models apply themselves (`masked_window_problem`); and some models' `generate` lets a padded row's output depend
    on its padding (`verifiers.probes.padding_changes_outputs`), or, where a model keeps its state in a structure of
    its own, a row's output on the other rows of its batch (`verifiers.probes.batching_changes_outputs`)."""
    masked = [b for b, mask in enumerate(masks) if mask is not None and not bool(mask.all())]
    problem = slot_position_problem(model) if masked else None
    if problem is not None:
        raise ValueError(
            f"attention_mask masks tokens of row {masked[0]}, and {type(model).__name__} cannot be told "
            f"where a row's tokens sit ({problem}): model.generate counts the masked tokens as positions of that "
            "row, while hybrid places a row's tokens as if it were alone. Pass prompts without padding (one "
            "call per row), or decode them with model.generate"
        )
    if masked and padding_changes_outputs(model):
        raise ValueError(
            f"attention_mask masks tokens of row {masked[0]}, and model.generate's output for a padded row of "
            f"{type(model).__name__} depends on its padding (its logits for a left-padded row differ from "
            "the row's alone), while hybrid decodes a row as if it were alone. Pass prompts without padding (one "
            "call per row), or decode them with model.generate"
        )
    if len(masks) > 1 and state_format(model) is not None and batching_changes_outputs(model):
        raise ValueError(
            f"model.generate's output for a row of a batch of {type(model).__name__} depends on the other rows (its "
            "logits for a row of two differ from the row's alone, as transformers' RWKV one-token step reads the "
            "other rows' states), while hybrid decodes each row as if it were alone. Pass one prompt per call, or "
            "decode the batch with model.generate"
        )
    holed = holed_rows(masks)
    if not holed:
        return
    if keeps_states(model):
        raise ValueError(
            f"attention_mask masks a token of row {holed[0]} after the row's first token, and {type(model).__name__} "
            "keeps recurrent state, into which model.generate folds a masked token as a zero input: mask only leading "
            "(left-padding) tokens, or decode this prompt with model.generate"
        )
    problem = masked_window_problem(model)
    if problem is not None:
        mask = masks[holed[0]]
        first = int(mask.nonzero()[0, 0])
        hole = first + int((mask[first:] == 0).nonzero()[0, 0])
        raise ValueError(
            f"attention_mask masks position {hole} of row {holed[0]}, after the row's first token, and "
            f"{type(model).__name__} cannot count it in its attention as model.generate does "
            f"({problem}): mask only leading (left-padding) tokens, or decode this prompt with model.generate"
        )


def settle_probes(model) -> None:
    """Run now every probe a call may ask of `model` (each keeps its verdict, `verifiers.verdicts.probed`): a loader
    calls it so that no first call pays for them."""
    check_causal_lm(model)
    padding_changes_outputs(model)
    for width in (1, SEVERAL_TOKENS):
        cache_feed_problem(model, width)


def adapted_model(model):
    """`model`, or the causal LM inside a PEFT `PeftModel` whose adapters act within that model's layers (LoRA and
    its kin), where `peft_model.generate` is that model's own `generate`, adapters included. Prompt-learning adapters
    (prefix, prompt and p-tuning) feed tokens or cache of their own around the model, which a verify would not see:
    refused by name. (Read by duck typing: PEFT is not a dependency.)"""
    config = getattr(model, "active_peft_config", None)
    if isinstance(model, PreTrainedModel) or config is None or not callable(getattr(model, "get_base_model", None)):
        return model
    if getattr(config, "is_prompt_learning", False):
        raise TypeError(
            f"{type(model).__name__} carries a prompt-learning adapter ({getattr(config, 'peft_type', '?')}), whose "
            "virtual tokens a verify of the causal LM would not see: decode it with its own generate, or use an "
            "adapter that acts within the model's layers (LoRA)"
        )
    return model.get_base_model()


def check_causal_lm(model, role: str = "verifier") -> None:
    """Raise a clear error unless `model` is a decoder-only Hugging Face LM that can generate."""
    if isinstance(getattr(model, "_orig_mod", None), PreTrainedModel):  # torch.compile's wrapper
        raise TypeError(
            f"{role} is a torch.compile wrapper ({type(model).__name__}): pass the model itself (its _orig_mod); "
            "hybrid compiles its own decoding step, as model.generate does, with cache_implementation='static' "
            "(and compile_config to choose how)"
        )
    if not isinstance(model, PreTrainedModel) or not isinstance(model, GenerationMixin):
        raise TypeError(
            f"{role} must be a Hugging Face causal LM (a PreTrainedModel with generate), got {type(model).__name__}: "
            "load it with AutoModelForCausalLM.from_pretrained(...)"
        )
    if model.config.is_encoder_decoder or not model.can_generate():
        raise TypeError(
            f"{type(model).__name__} is not a decoder-only causal LM: hybrid verifies with an "
            "AutoModelForCausalLM (encoder-decoder and encoder-only models are not supported)"
        )
    if attends_ahead(model):
        if getattr(model.config.get_text_config(), "is_decoder", None) is False:
            raise TypeError(
                f"{type(model).__name__} attends to the tokens after each position (its config has "
                "is_decoder=False), so no forward of several tokens scores them as model.generate decodes them one "
                "by one: load it with is_decoder=True"
            )
        raise TypeError(
            f"{type(model).__name__}'s output at a position depends on the tokens after it in the same forward "
            "(attention that looks ahead, or layers that mix a forward's tokens, as torch.ao's dynamic "
            "quantization does by scaling them all by their common range, or bitsandbytes' LLM.int8 by taking "
            "outlier columns wherever any token has them), so no forward of several tokens scores them as "
            "model.generate decodes them one by one: use a causal LM whose layers compute each token from its own "
            "row (quantize weights only, as 4-bit bitsandbytes does, or activations per token), or decode with "
            "model.generate"
        )
    if scores_depend_on_width(model):
        raise TypeError(
            f"{type(model).__name__}'s scores for a token depend on how many tokens its forward feeds, past the "
            "rounding of the dtype it computes in (as some int8 products of activations quantized on the fly do, "
            "choosing kernels by shape), so no verify of several tokens reproduces model.generate's one-token "
            "steps: quantize weights only, or decode with model.generate"
        )


# Models that keep recurrent state outside transformers' Cache layers (in a state list or a cache class of their own):
# the model types transformers' own generate keeps out of its default cache (`_supports_default_dynamic_cache`).
# RWKV's and xLSTM's are served by snapshot and replay (`verifiers.own_state.STATE_FORMATS`); the others, with what
# they keep it in.
_OWN_STATE_TYPES = {
    # Keys and values grow with the sequence beside the lightning-attention state: a snapshot would copy them all
    # before every verify, and hybrid's own cache cannot stand in for the one cache class the forward takes.
    "minimax": "a MiniMaxCache, the only cache its forward takes, holding its attention keys and values too",
}
# Models whose forward of several tokens on top of a cache restarts their recurrence as a prefill would, in
# transformers' own code (Zamba's Mamba mixer and RecurrentGemma's recurrent block): one token at a time is right.
_RESTARTING_TYPES = {
    "zamba": "its Mamba layers run a forward of several tokens as a prefill, without the cached state",
    "recurrent_gemma": "its recurrent blocks run a forward of several tokens as a prefill, restarting the convolution",
}


# Models whose attention adds a relative position bias it sizes from the cache's length and offset (Inkling's
# `get_relative_distance` and hidden-state-conditioned bias): right for one row read to its end, not for rows of other
# lengths or the static layout's full capacity.
_CACHE_SIZED_BIAS = ("inkling",)
# Models whose indexer takes the queries' positions as the last of a position history kept in the cache (Qwen4-Exp's)
_HISTORY_POSITIONED_INDEXER = ("qwen4_exp",)


def keeps_states(model) -> bool:
    """Whether `model` keeps recurrent or convolution state (linear attention, Mamba, short convolution, RWKV...)."""
    text = model.config.get_text_config()
    return any(states for states, _ in layer_states(text)) or text.model_type in (
        *STATE_FORMATS,
        *_OWN_STATE_TYPES,
        *_RESTARTING_TYPES,
    )


def state_refusal(model, role: str, several: bool, static: bool, compiled: bool) -> str | None:
    """Why `model`'s recurrent or convolution state cannot be served so (None if it can, or keeps none). hybrid keeps
    the state of transformers' Cache layers per row and rolls a verify back to any prefix
    (`verifiers.state_layers`)."""
    if not keeps_states(model):
        return None
    name, kind = type(model).__name__, model.config.get_text_config().model_type
    if kind in _OWN_STATE_TYPES:
        return (
            f"{name} keeps its recurrent state in a structure of its own ({_OWN_STATE_TYPES[kind]}), not in "
            "transformers' Cache layers, so hybrid cannot keep it per row or roll it back: decode it with "
            "model.generate"
        )
    if kind in _RESTARTING_TYPES and several:
        return (
            f"{name} cannot verify drafted tokens: {_RESTARTING_TYPES[kind]}, so a verify would not continue the "
            "cached sequence. Pass drafter=None (one token per forward, as model.generate decodes), or decode with "
            "model.generate"
        )
    if static and kind in STATE_FORMATS:
        return (
            f"cache_implementation='static' lays out slots of keys and values, and {name} keeps its recurrent state "
            "in a structure of its own, which hybrid copies before a verify and replays after it "
            "(model.generate ignores cache_implementation for it). Drop cache_implementation (the dynamic path "
            "serves this model)"
        )
    if several and kind not in STATE_FORMATS and not records_each_state(model):
        return (
            f"{name} cannot verify drafted tokens: its recurrent or convolution layers do not hand the cache the state "
            "after each token of a forward (transformers' recurrent_states_to_keep), so a partly accepted verify "
            "could not be rolled back. Pass drafter=None (one token per forward, as model.generate decodes), or "
            "decode with model.generate"
        )
    if compiled:
        return (
            f"cache_implementation='static' compiles one graph per verify width here, and {name}'s recurrent layers "
            "record the state after each verified token in tensors of their own, which a CUDA graph would not own. "
            "Drop cache_implementation (the dynamic path serves this model), or pass disable_compile=True"
        )
    return None


def mask_problem(text_config) -> str | None:
    """Why the model's attention fails on any forward that takes a mask (None if it does not): then only unmasked
    forwards run, a prefill and one token at a time, as `model.generate` runs it at batch 1.

    Multi-head latent attention expands its cached latent to num_attention_heads heads and then repeats them
    num_attention_heads // num_key_value_heads times more, which fits the queries only when the two head counts are
    equal (as in every released checkpoint); without a mask, SDPA's grouped-query kernel takes the heads as they are."""
    # Read with getattr: BLT's config keeps its head counts in sub-configs, none at the top; Dots3's vary by layer.
    for layer in getattr(text_config, "per_layer_config", None) or [text_config]:
        problem = _latent_heads_problem(layer)
        if problem:
            return problem
    return None


def _latent_heads_problem(layer_config) -> str | None:
    heads = getattr(layer_config, "num_attention_heads", None)
    kv_heads = getattr(layer_config, "num_key_value_heads", None)
    if getattr(layer_config, "kv_lora_rank", None) and heads and kv_heads and kv_heads != heads:
        return (
            f"its config has num_key_value_heads={kv_heads} but its latent attention (kv_lora_rank) expands keys and "
            f"values to num_attention_heads={heads} heads, which transformers' attention repeats "
            f"{heads // kv_heads}x more on every forward with a mask (a verify of drafted tokens, rows of different "
            f"lengths): set num_key_value_heads={heads}"
        )
    return None


def row_mask_problem(model) -> str | None:
    """Why `model` cannot take the per-row 4-D masks the cache builds (None if it can).

    Rows of different lengths and the static layout put a query somewhere other than the last slots the cache
    returns, so the model must attend through the mask it is given and add nothing position-dependent of its own.
    """
    text = model.config.get_text_config()
    problem = mask_problem(text)
    if problem:
        return problem
    implementation = model.config._attn_implementation
    if implementation not in MASKED_ATTENTION:
        return f"attn_implementation={implementation!r} builds its own causal mask (load it with attn_implementation='sdpa')"
    if uses_alibi(text):
        return "its ALiBi position bias is built from a 2-D padding mask, which cannot say where each row's queries sit"
    if set(COMPRESSED) & set(get_layer_types_and_kwargs(text)[0]):
        return (
            "its compressors count the windows they have closed once for all rows of a forward, which cannot say "
            "where each row's tokens end"
        )
    if text.model_type.startswith(_HISTORY_POSITIONED_INDEXER):
        return (
            "its indexer reads the fed tokens' rotary positions from the end of the positions it appends to the cache, "
            "which cannot say where each row's queries sit"
        )
    if text.model_type.startswith(_CACHE_SIZED_BIAS):
        return (
            "its relative position bias is sized from the cache's length, which cannot say where each row's queries sit"
        )
    problem = slot_position_problem(model)
    if problem:
        return f"{problem}, which is wrong for rows that end elsewhere and for a token tree's branches"
    for name, _ in own_causal_masks(model):
        return (
            f"its attention ({name}) applies a causal/local mask of its own, indexed from the last cached slot, "
            "which is wrong for rows that end elsewhere"
        )
    return None


def uses_alibi(text_config) -> bool:
    """Whether the model positions tokens by an ALiBi bias: Bloom's always, Falcon's with alibi=True, MPT's with
    attn_config.alibi."""
    attn_config = getattr(text_config, "attn_config", None)
    return (
        text_config.model_type == "bloom"
        or getattr(text_config, "alibi", False)
        or getattr(attn_config, "alibi", False)
    )


def slot_position_problem(model) -> str | None:
    """Why `model` places each fed token at the position after its cache's slots rather than where it is told (None
    if it does not): its forward takes no position_ids (BART-family and TrOCR decoders, RoFormer). `generate` then
    counts a padded row's padding as positions, as `generate` passes position_ids only to a forward that takes them.
    ALiBi models (Bloom, Falcon, MPT) place nothing: their bias is relative, and `row_mask_problem` and
    `masked_window_problem` say what they cannot take."""
    if uses_alibi(model.config.get_text_config()):
        return None
    # A state-space model, or one with a state structure of its own (RWKV, xLSTM): no token is placed by position
    if attention_free(model.config.get_text_config()) or state_format(model) is not None:
        return None
    if "position_ids" in inspect.signature(model.forward).parameters:
        return None
    return "its forward takes no position_ids and places fed tokens after its cache's slots"


def own_causal_masks(model) -> list[tuple[str, torch.Tensor]]:
    """(module name, mask) of every attention that applies a causal mask of its own: a 4-D bool buffer `bias`
    (GPT-Neo's, where a local layer's mask is banded)."""
    masks = []
    for name, module in model.named_modules():
        bias = getattr(module, "bias", None)
        if (
            isinstance(bias, torch.Tensor)
            and not isinstance(bias, nn.Parameter)
            and bias.dtype == torch.bool
            and bias.dim() == 4
        ):
            masks.append((name, bias))
    return masks


def masked_window_problem(model) -> str | None:
    """Why `model` cannot measure its attention windows or position bias over masked prompt tokens as `generate`
    does (None if it can): a window or bias the model applies itself counts the cache slots hybrid holds, which
    leave masked tokens out."""
    text = model.config.get_text_config()
    types = attention_pattern(text)[0]
    if getattr(getattr(text, "attn_config", None), "alibi", False):
        # MPT's ALiBi is an arange over the key slots; Bloom's and Falcon's count only unmasked tokens (cumsum).
        return "its ALiBi bias counts key slots, so a masked slot between two tokens changes their distance"
    problem = row_mask_problem(model)
    windowed = {"sliding_attention", "chunked_attention"} & set(types)
    if windowed and problem is not None:
        return f"its {' and '.join(sorted(windowed))} layers cannot take hybrid's masks: {problem}"
    for name, bias in own_causal_masks(model):
        if not bool(bias[..., -1, :].all()):  # a causal mask's last query sees every key; a local one does not
            return f"its attention ({name}) applies a local window of its own, over the slots hybrid's cache holds"
    return None


def cache_feed_refusal(model, several: bool, role: str = "verifier") -> str | None:
    """Why `model` cannot serve as `role` by feeding its cache `several` tokens a forward (a verify, a drafter's
    catch-up) or one (a verifier without drafts, as `generate`), as a refusal naming the fix; None if it can."""
    problem = cache_feed_problem(model, SEVERAL_TOKENS if several else 1)
    if problem is None:
        return None
    if several and role == "verifier" and cache_feed_problem(model, 1) is None:
        return (
            f"{type(model).__name__} cannot verify drafted tokens, which a verify feeds (the pending token and its "
            f"drafts) in one forward on top of the cache: {problem}. Pass drafter=None (one token per forward, as "
            "model.generate decodes), or decode with model.generate"
        )
    return (
        f"{type(model).__name__} cannot be a {role}, whose forward must take each step's new tokens on top of the "
        f"cache of the ones before: {problem}. Decode it with model.generate"
    )


def learned_position_limit(model) -> int | None:
    """Positions the model can embed when it has a learned position table for its text (GPT-2's wpe, OPT's
    embed_positions), else None: rotary and ALiBi models have no table and, like `model.generate`, run past
    max_position_embeddings."""
    context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    tokens = model.get_input_embeddings()
    # An image or audio encoder inside the model (GIT's, Phi-4-multimodal's) has a table of its own patches' or
    # frames' positions, which no text token is placed by.
    towers = [
        name + "."
        for name, module in model.named_modules()
        if name and isinstance(module, PreTrainedModel) and all(m is not tokens for m in module.modules())
    ]
    sizes = []
    for name, module in model.named_modules():
        if name.startswith(tuple(towers)):
            continue
        if isinstance(module, nn.Embedding) and module is not tokens:
            size = module.num_embeddings - getattr(module, "offset", 0)  # OPT keeps two extra rows
            if size == context or "pos" in name.rsplit(".", 1)[-1]:
                sizes.append(size)
    return min(sizes) if sizes else None


def foreign_cache_reason(model, cache) -> str | None:
    """Why `cache` (a transformers Cache) cannot have been built for `model`, or None if its shapes fit."""
    want = cache_fingerprint(model)
    name, shapes = want["architecture"], want["layers"]
    layers = getattr(cache, "layers", [])
    if layers and len(layers) != len(shapes):
        return f"it has {len(layers)} layers, {name} has {len(shapes)}"
    for i, (layer, shape) in enumerate(zip(layers, shapes)):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor) and keys.dim() == 4 and keys.numel():
            held = (keys.shape[1], keys.shape[-1], values.shape[-1])
            if held != shape:
                return f"its layer {i} holds {_heads(*held)}, {name} has {_heads(*shape)}"
    return None


def _heads(heads: int, key_width: int, value_width: int) -> str:
    if key_width == value_width:
        return f"{heads} key/value heads of size {key_width}"
    return f"{heads} key/value heads of key size {key_width} and value size {value_width}"
