"""What `hybrid.generate` takes, checked: each argument `generate` honours is validated, each it cannot honour is
refused by name with the fix, and one at its "off" value is accepted, as `generate` accepts it.

`hybrid.generate` calls these before anything runs, so the engine receives arguments it can trust.
"""

from __future__ import annotations

import math
import numbers
import warnings

import torch
from transformers import Cache, GenerationConfig
from transformers.generation.configuration_utils import BaseWatermarkingConfig, GenerationMode

from drafters.base import Drafter
from hybrid.acceptance import ACCEPTANCE_RULES
from verifiers.positions import crossing_problem
from verifiers.support import foreign_cache_reason
from verifiers.verifier import Verifier

# `generate` arguments outside GenerationConfig that this engine honours.
CALL_ARGS = (
    "attention_mask",
    "logits_processor",
    "stopping_criteria",
    "prefix_allowed_tokens_fn",
    "streamer",
    "tokenizer",
)

# GenerationConfig fields that select a decoding method or output this engine does not implement,
# with the value that means "off" and what to do instead.
_UNSUPPORTED_CONFIG = {
    "num_beams": (1, "beam search is not speculative; use num_beams=1"),
    "num_return_sequences": (1, "one sequence per prompt; call generate again for more samples"),
    "num_beam_groups": (1, "beam search is not supported"),
    "diversity_penalty": (0.0, "beam search is not supported"),
    "length_penalty": (1.0, "length_penalty only applies to beam search"),
    "early_stopping": (False, "early_stopping only applies to beam search"),
    "penalty_alpha": (None, "contrastive search is not supported"),
    "constraints": (None, "constrained beam search is not supported"),
    "force_words_ids": (None, "constrained beam search is not supported"),
    "guidance_scale": (None, "classifier-free guidance is not supported"),
    "output_attentions": (False, "attentions are not returned"),
    "output_hidden_states": (False, "hidden states are not returned (drafters read them through the Verifier)"),
    "prompt_lookup_num_tokens": (None, "pass drafter=drafters.PromptLookupDrafter(max_draft_len=N)"),
    "use_mtp": (False, "pass a drafter instead"),
    "token_healing": (False, "token healing is not supported"),
    "prefill_chunk_size": (None, "chunked prefill is not supported"),
    "dola_layers": (None, "DoLa decoding is not supported"),
    "low_memory": (False, "low_memory only applies to beam search"),
}
# Assisted-generation knobs: hybrid's drafter and scheduler replace them.
_ASSISTANT_ARGS = (
    "num_assistant_tokens",
    "num_assistant_tokens_schedule",
    "assistant_confidence_threshold",
    "assistant_lookbehind",
    "target_lookbehind",
    "assistant_early_exit",
    "max_matching_ngram_size",
    "is_assistant",
    "speculation_type",
)
# `generate` arguments beyond GenerationConfig that this engine does not implement; None means "not asked for".
_UNSUPPORTED_ARGS = (
    "negative_prompt_ids",
    "negative_prompt_attention_mask",
    "custom_generate",
    "inputs_embeds",
    "cache",
    "past_key_values",
    "position_ids",
)
# Switches: False (or None) means "off", as `generate` reads them.
_SWITCHES = ("synced_gpus", "trust_remote_code", "is_assistant")  # False asks for nothing


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_int_tensor(value) -> bool:
    return isinstance(value, torch.Tensor) and not value.is_floating_point() and value.dtype != torch.bool


def _is_token_id(value) -> bool:
    return _is_int(value) or (_is_int_tensor(value) and value.numel() == 1)


def _is_token_ids(value) -> bool:
    return _is_int_tensor(value) or (isinstance(value, (list, tuple)) and all(_is_int(v) for v in value))


def _is_strings(value) -> bool:
    return isinstance(value, str) or (isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value))


def _is_decay(value) -> bool:
    return isinstance(value, (list, tuple)) and len(value) == 2 and _is_int(value[0]) and _is_number(value[1])


# Generation settings by the kind of value they take (None always means "unset"): transformers compares or indexes
# them deep inside `generate`, where a string or a float fails with a TypeError that names neither.
_SETTING_KINDS = {
    "a whole number (int)": (_is_int, ["min_new_tokens", "min_length", "top_k", "no_repeat_ngram_size"]),
    # A maximum is only compared with the sequence's length, so `generate` takes a float too (5.5: 6 new tokens).
    "a length (int or float)": (_is_number, ["max_new_tokens", "max_length"]),
    "a number (float or int)": (
        _is_number,
        ["temperature", "top_p", "min_p", "top_h", "typical_p", "epsilon_cutoff", "eta_cutoff", "repetition_penalty"]
        + ["max_time"],
    ),
    "True or False": (
        lambda value: isinstance(value, bool),
        ["do_sample", "use_cache", "output_scores", "output_logits", "return_dict_in_generate"]
        + ["renormalize_logits", "remove_invalid_values", "disable_compile"],
    ),
    "a token id (int)": (_is_token_id, ["pad_token_id", "bos_token_id", "forced_bos_token_id"]),
    "a token id or a list of token ids (ints)": (
        lambda value: _is_token_id(value) or _is_token_ids(value),
        ["eos_token_id", "forced_eos_token_id"],
    ),
    "a list of token ids (ints)": (_is_token_ids, ["suppress_tokens", "begin_suppress_tokens"]),
    "a string or a list of strings": (_is_strings, ["stop_strings"]),
    "a pair (start index: int, decay factor: float)": (_is_decay, ["exponential_decay_length_penalty"]),
    "a WatermarkingConfig (or its dict)": (
        lambda value: isinstance(value, (dict, BaseWatermarkingConfig)),
        ["watermarking_config"],
    ),
}
# `generate` arguments beyond GenerationConfig that are called: what each must be, and how it is called.
_CALLABLES = {
    "logits_processor": "a LogitsProcessor, called as (input_ids, scores) -> scores",
    "stopping_criteria": "a StoppingCriteria, called as (input_ids, scores) -> a bool tensor [batch]",
}


def check_settings(model, generation_config, kwargs: dict, return_stats, acceptance) -> None:
    """Refuse what the call's own settings ask for that hybrid cannot give: values of the wrong kind, an unknown
    acceptance rule, decoding without the cache. Warn where a model in training mode makes every output differ."""
    if generation_config is not None and not isinstance(generation_config, GenerationConfig):
        raise TypeError(
            f"generation_config must be a transformers.GenerationConfig, got {type(generation_config).__name__}: "
            "pass GenerationConfig(**settings), or the settings themselves as keyword arguments"
        )
    if not isinstance(return_stats, bool):
        raise TypeError(f"return_stats={return_stats!r}: pass True (to also get a GenerationStats) or False")
    check_setting_types(kwargs, generation_config)
    if acceptance not in ACCEPTANCE_RULES:
        raise ValueError(f"acceptance={acceptance!r}: choose one of {ACCEPTANCE_RULES}")
    if model.training:
        warnings.warn(
            f"{type(model).__name__} is in training mode: dropout makes every call's output differ (from "
            "model.generate's too); call model.eval() first",
            stacklevel=3,
        )
    if kwargs.get("use_cache") is False or (generation_config is not None and generation_config.use_cache is False):
        raise ValueError(
            "hybrid.generate does not support use_cache=False: speculative decoding verifies drafts "
            "against the KV cache (the output is the same with it); drop use_cache"
        )


def check_setting_types(kwargs: dict, generation_config: GenerationConfig | None) -> None:
    """Raise, naming the setting, where a generation setting (a keyword or a field of `generation_config`) has a
    value of the wrong kind, e.g. max_new_tokens="5" or do_sample="yes"."""
    for kind, (fits, names) in _SETTING_KINDS.items():
        for name in names:
            for label, value in (
                (name, kwargs.get(name)),
                (f"generation_config.{name}", getattr(generation_config, name, None)),
            ):
                if value is not None and not fits(value):
                    raise TypeError(f"{label}={value!r} ({type(value).__name__}): {name} takes {kind}")


def check_call_args(call: dict) -> None:
    """Raise, naming the argument, where one that `generate` calls cannot be called as it will be."""
    for name, role in _CALLABLES.items():
        entries = call[name]
        if entries is None:
            continue
        if not isinstance(entries, (list, tuple)):
            raise TypeError(
                f"{name} must be a list ({type(entries).__name__} given): pass a {name.title().replace('_', '')}List"
                f" whose entries are each {role}"
            )
        for i, entry in enumerate(entries):
            if not callable(entry):
                raise TypeError(f"{name}[{i}] ({type(entry).__name__}) is not callable: each entry is {role}")
    allowed = call["prefix_allowed_tokens_fn"]
    if allowed is not None and not callable(allowed):
        raise TypeError(
            f"prefix_allowed_tokens_fn ({type(allowed).__name__}) is not callable: pass a function "
            "(batch_id, input_ids) -> the list of token ids allowed next, or None"
        )
    streamer = call["streamer"]
    if streamer is not None:
        missing = [method for method in ("put", "end") if not callable(getattr(streamer, method, None))]
        if missing:
            raise TypeError(
                f"streamer ({type(streamer).__name__}) has no {' or '.join(f'{m}()' for m in missing)}: a streamer is "
                "a transformers BaseStreamer, with put(token_ids) and end(), e.g. TextStreamer(tokenizer)"
            )


def reject_unsupported_kwargs(model, kwargs: dict) -> None:
    """Raise on an argument that asks for what hybrid cannot do. One at its off value (None, or False where the
    argument is a switch) asks for nothing: it is dropped from `kwargs`, as `generate` itself ignores it.
    transformers' custom_generate path passes every `generate` parameter this way."""
    refused = (*_SWITCHES, *_UNSUPPORTED_ARGS, *_ASSISTANT_ARGS)
    for name, value in list(kwargs.items()):
        if (name in refused or name.startswith("assistant")) and (
            value is None or (value is False and name in _SWITCHES)
        ):
            del kwargs[name]
    for name in ("cache", "past_key_values"):
        if isinstance(kwargs.get(name), Cache):
            reason = foreign_cache_reason(model, kwargs[name])
            if reason:
                raise ValueError(
                    f"{name} was built for another model ({reason}); hybrid.generate builds and owns "
                    f"the verifier's cache: drop {name} and pass the whole sequence as input_ids"
                )
            raise ValueError(
                f"hybrid.generate does not continue from a {name}: it builds and owns the verifier's "
                f"cache (prefill included); drop {name} and pass the whole sequence as input_ids"
            )
    assistant = sorted(k for k in kwargs if k in _ASSISTANT_ARGS or k.startswith("assistant"))
    if assistant:
        raise TypeError(
            f"hybrid.generate does not take assisted-generation argument(s) {assistant}: "
            "pass drafter= (what proposes tokens) and scheduler= (how many to verify) instead"
        )
    other = sorted(k for k in kwargs if k in _UNSUPPORTED_ARGS or k in _SWITCHES)
    if other:
        raise TypeError(
            f"hybrid.generate does not support argument(s) {other}: it owns the cache and the inputs are token ids"
        )


def drop_logits_to_keep(model, unknown: dict) -> None:
    """`generate` passes `logits_to_keep` to a model that takes it (1 unless told otherwise) and reads the last
    position's logits: the same tokens for any count (0: all positions). hybrid scores every position it verifies, so
    a count asks for nothing it would change; a tensor of positions, which can leave out the last, is refused."""
    if "logits_to_keep" not in unknown:
        return
    value = unknown["logits_to_keep"]
    if not model._supports_logits_to_keep():
        return  # refused with the other unknown arguments, as `generate` refuses what the model does not take
    if not (_is_int(value) and value >= 0):
        raise TypeError(
            f"logits_to_keep={value!r}: hybrid takes a count of last positions (0: all), which leaves the tokens as "
            "they are; positions given as a tensor make `generate` read the last one kept, not the sequence's: "
            "pass a count or drop it"
        )
    del unknown["logits_to_keep"]


def check_config(config: GenerationConfig) -> None:
    """Refuse a merged generation config that asks for a decoding method, output or cache hybrid does not give."""
    for name, (off, fix) in _UNSUPPORTED_CONFIG.items():
        value = getattr(config, name, off)
        if value is not None and value != off and not (name == "guidance_scale" and value == 1):
            raise ValueError(f"hybrid.generate does not support {name}={value!r}: {fix}")
    if config.cache_implementation not in (None, "dynamic", "static"):  # "dynamic": what generate does unasked
        raise ValueError(
            f"hybrid.generate does not support cache_implementation={config.cache_implementation!r}: "
            "hybrid manages its own cache; pass cache_implementation='static' for its static-shape "
            "path (compiled, CUDA graphs) or leave it unset (or 'dynamic')"
        )
    if config.compile_config is not None and config.cache_implementation != "static":
        raise ValueError(
            "compile_config applies to the static-shape path only, as in model.generate: pass "
            "cache_implementation='static' with it (or drop compile_config)"
        )
    mode = config.get_generation_mode()
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        raise ValueError(f"hybrid.generate supports greedy decoding and sampling, not {mode.value}")
    if config.do_sample and (config.temperature is None or config.temperature <= 0):
        raise ValueError(
            f"temperature={config.temperature} with do_sample=True: temperature must be > 0 "
            "(for deterministic output use do_sample=False)"
        )
    if config.max_new_tokens is not None and config.max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens={config.max_new_tokens}: ask for at least 1 new token")


def _check_mask(mask: torch.Tensor) -> None:
    if not bool((mask[:, -1] == 1).all()):
        raise ValueError(
            "attention_mask ends with padding (right-padded prompt): decoder-only generation needs left "
            "padding; tokenize with padding_side='left'"
        )


def check_prompt(model, input_ids, attention_mask, bos_token_id):
    """The prompt as a LongTensor on the model's device (BOS alone where none is given and `generate` starts from
    it) and its attention mask, each checked for shape, values and left padding."""
    if input_ids is None:
        if bos_token_id is None or attention_mask is not None:
            raise ValueError(
                "input_ids is required: hybrid needs a prompt (or, for unconditional text, no input_ids and a "
                "bos_token_id, which it starts from as generate does)"
            )
        input_ids = torch.full((1, 1), int(bos_token_id), dtype=torch.long, device=model.device)
    if (
        not isinstance(input_ids, torch.Tensor)
        or input_ids.dim() != 2
        or input_ids.dtype not in (torch.long, torch.int)
    ):
        got = (
            f"{tuple(input_ids.shape)} {input_ids.dtype}"
            if isinstance(input_ids, torch.Tensor)
            else type(input_ids).__name__
        )
        raise ValueError(f"input_ids must be a LongTensor [batch, length], got {got}")
    if input_ids.shape[0] == 0:
        raise ValueError("input_ids has no rows: pass at least one prompt")
    if input_ids.shape[1] == 0:
        raise ValueError("empty prompt: input_ids has no tokens; pass at least one (e.g. the BOS token)")
    vocab = model.get_output_embeddings().weight.shape[0]
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab:
        raise ValueError(f"input_ids contains ids outside the model's vocabulary [0, {vocab})")
    input_ids = input_ids.long().to(model.device)
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
            shape = (
                tuple(attention_mask.shape)
                if isinstance(attention_mask, torch.Tensor)
                else type(attention_mask).__name__
            )
            raise ValueError(f"attention_mask {shape} must have the shape of input_ids {tuple(input_ids.shape)}")
        if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
            raise ValueError("attention_mask must contain only 0 (padding) and 1 (token)")
        attention_mask = attention_mask.long().to(model.device)
        _check_mask(attention_mask)
    return input_ids, attention_mask


def check_context(verifier: Verifier, prompt_len: int, max_length: int | float, attention_mask, batch: int) -> None:
    """Refuse a call that would run past a learned position table, where `generate` fails mid-way (IndexError).
    Rotary and ALiBi models have no such end: like `generate`, hybrid goes on past max_position_embeddings. Refuse a
    batch that would reach a switch of a rotary embedding whose frequencies follow the batch's longest row."""
    limit, model = verifier.max_positions, verifier.model
    masked = attention_mask is not None and not bool(attention_mask.all())
    verifier.plan_rereads(prompt_len, math.ceil(max_length), masked, batch)
    if batch > 1 and verifier.rope_switches:
        longest = prompt_len if attention_mask is None else int(attention_mask.sum(-1).max())
        problem = crossing_problem(verifier.rope_switches, longest + math.ceil(max_length) - prompt_len)
        if problem:
            raise ValueError(f"{type(model).__name__} cannot decode this batch: {problem}")
    if limit is not None and math.ceil(max_length) > limit:
        raise ValueError(
            f"prompt of {prompt_len} tokens + new tokens up to a length of {math.ceil(max_length)} run past the "
            f"{limit} positions {type(model).__name__} has learned embeddings for: lower max_new_tokens to at most "
            f"{limit - prompt_len}" + (" and shorten the prompt" if prompt_len >= limit else "")
        )


def check_drafter_type(drafter) -> None:
    if drafter is not None and not isinstance(drafter, Drafter):  # before drafter.hidden_layers is read
        raise TypeError(
            f"drafter must be a drafters.Drafter (or None for plain decoding), got {type(drafter).__name__}"
        )


def check_batch_outputs(batch: int, streamer, config: GenerationConfig) -> None:
    """Refuse outputs that take one sequence where the call has several."""
    if batch > 1 and streamer is not None:
        raise ValueError(f"streamer with batch size {batch}: streamers take one sequence; pass one prompt per call")
    if batch > 1 and config.return_dict_in_generate:
        raise ValueError(
            f"return_dict_in_generate with batch size {batch} is not supported yet: "
            "pass one prompt per call for scores, logits and the cache"
        )


def check_drafter(drafter, verifier: Verifier, tokenizer) -> None:
    """Refuse a drafter that cannot propose for this verifier: another vocabulary or tokenizer, or bad limits."""
    if drafter is None:
        return
    name = type(drafter).__name__
    if drafter.vocab_size is not None and drafter.vocab_size != verifier.vocab_size:
        raise ValueError(
            f"drafter vocabulary {drafter.vocab_size} != verifier vocabulary {verifier.vocab_size}: "
            f"a drafter must share the verifier's tokenizer ({name})"
        )
    if (
        tokenizer is not None
        and drafter.tokenizer is not None
        and drafter.tokenizer.get_vocab() != tokenizer.get_vocab()
    ):
        raise ValueError(
            f"{name}'s tokenizer differs from the tokenizer passed to generate: a drafter must share the verifier's tokenizer"
        )
    if not isinstance(drafter.max_draft_len, int) or drafter.max_draft_len < 1:
        raise ValueError(f"{name}.max_draft_len must be a positive int, got {drafter.max_draft_len!r}")
    if drafter.max_nodes is not None and (not isinstance(drafter.max_nodes, int) or drafter.max_nodes < 1):
        raise ValueError(f"{name}.max_nodes must be a positive int or None (chains), got {drafter.max_nodes!r}")
    if not isinstance(drafter.max_steps, int) or drafter.max_steps < 1:
        raise ValueError(f"{name}.max_steps must be a positive int, got {drafter.max_steps!r}")
