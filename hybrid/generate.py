"""`hybrid.generate`: a drop-in for `model.generate` that decodes speculatively and losslessly.

Argument handling reuses `generate`'s own preparation helpers (generation config merge, special
tokens, lengths, logits processors, stopping criteria), so a call means exactly what it means to
`model.generate`; what this engine cannot honour raises instead of being dropped (`hybrid.arguments`).
"""

from __future__ import annotations

import dataclasses
import warnings

import torch
from transformers import CompileConfig, GenerationConfig, LogitsProcessorList, MaxLengthCriteria, StoppingCriteriaList
from transformers.generation import GenerateDecoderOnlyOutput

from drafters.base import Drafter
from hybrid.arguments import (
    CALL_ARGS,
    check_batch_outputs,
    check_call_args,
    check_config,
    check_context,
    check_drafter,
    check_drafter_type,
    check_prompt,
    check_settings,
    drop_logits_to_keep,
    reject_unsupported_kwargs,
)
from hybrid.engine import DecodeSettings, decode
from hybrid.stats import GenerationStats
from schedulers.base import Scheduler
from schedulers.cost_aware import default_scheduler
from verifiers.cost_table import cached_kernel_choice
from verifiers.logits import shared_processors
from verifiers.support import adapted_model, check_causal_lm, check_masks
from verifiers.verifier import Verifier


def generate(
    model,
    input_ids: torch.LongTensor | None = None,
    *,
    drafter: Drafter | None,
    scheduler: Scheduler | None = None,
    return_stats: bool = False,
    generator: torch.Generator | None = None,
    acceptance: str = "match",
    generation_config: GenerationConfig | None = None,
    **kwargs,
):
    """Generate like `model.generate(input_ids, **kwargs)`, verifying drafts from `drafter` in one forward each.

    Returns what `model.generate` returns: a LongTensor [batch, prompt + new] or, with
    `return_dict_in_generate=True` (batch 1), a `GenerateDecoderOnlyOutput` (sequences, scores, logits,
    cache). Greedy output is the verifier's greedy output; sampled output has the verifier's distribution.

    A batch (left-padded, with its `attention_mask`) runs one verifier forward per step for all unfinished
    rows; each row drafts and accepts on its own. Rows stop as in `generate`: with an EOS criterion
    (`eos_token_id`) a row that stops is padded with `pad_token_id` and stops costing work, so its output is
    what a batch-1 call on the row gives; without one, a row stopped by other criteria (`stop_strings`, the
    caller's `stopping_criteria`) goes on with its own tokens until the last row stops.

    `model` is a causal LM, or a PEFT model whose adapters act within one (LoRA and its kin).

    Args beyond `generate`'s:
        drafter: a `drafters.Drafter` (None: no drafting, plain AR decoding through this engine).
        scheduler: a `schedulers.Scheduler` choosing the draft length (default: a `CostAwareScheduler`
            per verifier and drafter kind, learning across calls).
        return_stats: also return a `GenerationStats`, as `(output, stats)`.
        generator: a `torch.Generator` for the verifier's draws when sampling (None: torch's global one, as
            `generate` draws); `torch.manual_seed(s)` before both calls makes a batch-1 sampled output equal
            `model.generate`'s under the "match" rule.
        acceptance: "match" (default): keep a drafted token iff it equals the verifier's own choice, made as
            `generate` makes it, so the output is `generate`'s whatever the drafter does. "rejection":
            speculative sampling's min(1, p/q) rule when sampling, exact in distribution only if each drafted
            token really was drawn from the `Draft.probs` its drafter reports.
    """
    model = adapted_model(model)  # a PEFT model with LoRA-type adapters: the causal LM they act within
    check_causal_lm(model)
    check_settings(model, generation_config, kwargs, return_stats, acceptance)
    inputs = kwargs.pop("inputs", None)  # `generate`'s name for the prompt; custom_generate passes it, maybe None
    if inputs is not None:
        if input_ids is not None:
            raise TypeError("pass the prompt once: either input_ids or inputs")
        input_ids = inputs
    call = {name: kwargs.pop(name, None) for name in CALL_ARGS}
    check_call_args(call)
    reject_unsupported_kwargs(model, kwargs)
    config, has_default_max_length, has_default_min_length = _merged_config(model, generation_config, kwargs)

    input_ids, attention_mask = _prompt(model, input_ids, call["attention_mask"], config)
    prompt_len, batch = input_ids.shape[1], input_ids.shape[0]
    config = model._prepare_generated_length(
        generation_config=config,
        has_default_max_length=has_default_max_length,
        has_default_min_length=has_default_min_length,
        model_input_name="input_ids",
        inputs_tensor=input_ids,
        input_ids_length=prompt_len,
    )
    model._validate_generated_length(config, prompt_len, has_default_max_length)
    check_batch_outputs(batch, call["streamer"], config)

    check_drafter_type(drafter)
    verifier = _verifier(model, drafter, config)
    check_context(verifier, prompt_len, config.max_length, attention_mask, batch)
    check_masks(model, [None] * batch if attention_mask is None else list(attention_mask))
    check_drafter(drafter, verifier, call["tokenizer"])
    decoding = _decoding(config, acceptance)
    if scheduler is None:
        scheduler = default_scheduler(drafter, model, decoding) if drafter is not None else Scheduler()
    if not isinstance(scheduler, Scheduler):
        raise TypeError(f"scheduler must be a schedulers.Scheduler, got {type(scheduler).__name__}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")

    prompts = _row_prompts(model, config, input_ids, attention_mask, call)
    stopping = model._get_stopping_criteria(
        generation_config=config,
        stopping_criteria=call["stopping_criteria"] or StoppingCriteriaList(),
        tokenizer=call["tokenizer"],
    )
    settings = DecodeSettings(
        stopping_criteria=stopping,
        max_length=config.max_length,
        do_sample=bool(config.do_sample),
        generator=generator,
        acceptance=acceptance,
        streamer=call["streamer"],
        keep_scores=bool(config.return_dict_in_generate and config.output_scores),
        keep_logits=bool(config.return_dict_in_generate and config.output_logits),
        decoding=decoding,
        # `generate` pads a stopped row only where it has an EOS criterion; without one, a stopped row goes on
        # appending its own tokens until every row has stopped.
        pad_stopped=any(hasattr(criteria, "eos_token_id") for criteria in stopping),
    )
    with torch.inference_mode(), verifier.kernels():
        if verifier.batches or batch == 1:
            result = decode(verifier, drafter, scheduler, prompts, settings)
            sequences, stats = result.sequences, result.stats
        else:  # an attention implementation without per-row masks: one row per forward
            sequences, stats = _decode_one_by_one(verifier, drafter, scheduler, prompts, settings)
    output = _pad_rows(sequences, config._pad_token_tensor)
    if config.return_dict_in_generate:
        output = GenerateDecoderOnlyOutput(
            sequences=output, scores=result.scores, logits=result.logits, cache=verifier.generate_cache(0)
        )
    return (output, stats) if return_stats else output


def _merged_config(model, generation_config: GenerationConfig | None, kwargs: dict):
    """The call's settings merged over the model's as `generate` merges them, checked; and whether max_length and
    min_length are the defaults (`generate` sets them from the prompt then)."""
    has_default_max_length = (
        kwargs.get("max_length") is None
        and (generation_config is None or generation_config.max_length is None)
        and model.generation_config.max_length is None
    )
    has_default_min_length = (
        kwargs.get("min_length") is None
        and (generation_config is None or generation_config.min_length is None)
        and model.generation_config.min_length is None
    )
    config, unknown = model._prepare_generation_config(generation_config, **kwargs)
    unknown = {k: v for k, v in unknown.items() if k not in ("output_attentions", "output_hidden_states")}
    drop_logits_to_keep(model, unknown)
    if unknown:
        raise TypeError(
            f"hybrid.generate got unsupported argument(s) {sorted(unknown)}: they are neither generation "
            "settings nor arguments hybrid honours (see help(hybrid.generate))"
        )
    passed = kwargs.get("cache_implementation", getattr(generation_config, "cache_implementation", None))
    if passed is None and config.cache_implementation not in (None, "static", "quantized"):
        # The model's own default, an offloaded or sliding cache: where `generate` keeps exact keys and values, which
        # hybrid's own cache holds as well, so it asks hybrid for nothing. A quantized cache changes them: refused.
        config.cache_implementation = None
    check_config(config)
    return config, has_default_max_length, has_default_min_length


def _prompt(model, input_ids, attention_mask, config: GenerationConfig):
    """The checked prompt, with the special tokens set on `config` and the attention mask `generate` would use
    (None where nothing is padded, as `generate` passes none)."""
    given_mask = attention_mask is not None
    input_ids, attention_mask = check_prompt(model, input_ids, attention_mask, config.bos_token_id)
    model._prepare_special_tokens(config, given_mask, device=input_ids.device, batch_size=input_ids.shape[0])
    if attention_mask is None:
        attention_mask = model._prepare_attention_mask_for_generation(input_ids, config, {})
        if not bool((attention_mask[:, -1] == 1).all()):
            raise ValueError(
                f"the prompt ends with pad_token_id={int(config._pad_token_tensor)}, from which generate infers a "
                "right-padded prompt: pass attention_mask explicitly (left padding) or set another pad_token_id"
            )
    if bool((attention_mask == 1).all()):
        attention_mask = None  # as `generate` does: no padding, no mask
    return input_ids, attention_mask


def _verifier(model, drafter: Drafter | None, config: GenerationConfig) -> Verifier:
    static = config.cache_implementation == "static"
    row_kernels, forward_costs = cached_kernel_choice(model)  # the cached choice, never a measurement here
    return Verifier(
        model,
        hidden_layers=drafter.hidden_layers if drafter is not None else (),
        static=static,
        max_width=1 + (drafter.node_budget if drafter is not None else 0),
        compile_config=_compile_config(model, config) if static else None,
        row_kernels=row_kernels,
        forward_costs=forward_costs,
    )


def _row_prompts(model, config: GenerationConfig, input_ids, attention_mask, call: dict) -> list:
    """Per row: the prompt [1, n] as `generate` sees it (left padding included), its mask, its logits processors
    (one list shared by every row where they act row by row, so the engine processes aligned rows in one call)."""
    batch, prompt_len = input_ids.shape
    prompts = []
    for r in range(batch):
        row_mask = None if attention_mask is None else attention_mask[r : r + 1]
        allowed = call["prefix_allowed_tokens_fn"]
        if allowed is not None and batch > 1:  # it is told the row's index in the batch
            allowed = lambda _, ids, fn=allowed, r=r: fn(r, ids)  # noqa: E731
        processors = model._get_logits_processor(
            generation_config=config,
            input_ids_seq_length=prompt_len,
            encoder_input_ids=input_ids[r : r + 1],
            prefix_allowed_tokens_fn=allowed,
            logits_processor=call["logits_processor"] or LogitsProcessorList(),
            device=input_ids.device,
            model_kwargs={"attention_mask": row_mask},
        )
        prompts.append((input_ids[r : r + 1], None if row_mask is None else row_mask[0], processors))
    shared = shared_processors([processors for _, _, processors in prompts])
    if shared is not None:
        prompts = [(ids, mask, shared) for ids, mask, _ in prompts]
    return prompts


def _decode_one_by_one(verifier, drafter, scheduler, prompts, settings: DecodeSettings):
    """Each row in a forward of its own; where rows do not stop alone, each then runs on to where the last stopped,
    as in one batch."""
    parts = [decode(verifier, drafter, scheduler, [prompt], settings) for prompt in prompts]
    if not settings.pad_stopped:
        end = max(part.sequences[0].shape[1] for part in parts)
        settings = dataclasses.replace(settings, stopping_criteria=StoppingCriteriaList([MaxLengthCriteria(end)]))
        parts = [
            _run_on(verifier, drafter, scheduler, prompt, part, settings) if part.sequences[0].shape[1] < end else part
            for prompt, part in zip(prompts, parts)
        ]
    return [part.sequences[0] for part in parts], GenerationStats.combined([p.stats for p in parts])


def _run_on(verifier, drafter, scheduler, prompt, part, settings):
    """A stopped row decoded on, alone, from where it stopped to the batch's end (`settings`' stopping criteria)."""
    ids, mask, processors = prompt
    sequence = part.sequences[0]
    if mask is not None:
        mask = torch.cat([mask, mask.new_ones(sequence.shape[1] - ids.shape[1])])
    more = decode(verifier, drafter, scheduler, [(sequence, mask, processors)], settings)
    more.stats = GenerationStats.combined([part.stats, more.stats])
    return more


def _decoding(config: GenerationConfig, acceptance: str) -> dict:
    """How this call's tokens are chosen, as a scheduler is told it (`Scheduler.start`): {} greedily, else the
    settings of `config` that shape the sampled distribution, and the acceptance rule where it is not "match"."""
    if not config.do_sample:
        return {}
    decoding = {name: getattr(config, name, None) for name in _SHAPING}
    decoding = {name: value for name, value in decoding.items() if value not in (None, _SHAPING[name])}
    return decoding | ({"acceptance": acceptance} if acceptance != "match" else {})


# The settings that shape a sampled distribution, each with its value that leaves it as it is.
_SHAPING = {
    "temperature": None,
    "top_k": 0,
    "top_p": 1.0,
    "min_p": 0.0,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "top_h": None,
}


def _compile_config(model, config: GenerationConfig) -> CompileConfig | None:
    """How to compile the static path's steps where `model.generate` would compile a static cache's decoding
    step (a GPU, or `compile_config._compile_all_devices`; never with `disable_compile` or CPU/disk
    offload); else None, i.e. the static shapes run eagerly."""
    if config.disable_compile:
        return None
    compile_config = config.compile_config
    on_accelerator = model.device.type in ("cuda", "xpu")
    if not (on_accelerator or (compile_config is not None and compile_config._compile_all_devices)):
        if compile_config is not None:
            warnings.warn(
                f"compile_config is not used on {model.device.type}: as model.generate, hybrid compiles on "
                "a GPU only (set compile_config._compile_all_devices = True to compile here)",
                stacklevel=3,
            )
        return None
    devices = set(getattr(model, "hf_device_map", {}).values())
    if "disk" in devices or ("cpu" in devices and len(devices) > 1):
        warnings.warn(
            "the model is offloaded (device_map with cpu/disk): the static path runs without compiling", stacklevel=3
        )
        return None
    return compile_config or CompileConfig()  # transformers' default: CUDA graphs ("reduce-overhead")


def _pad_rows(sequences: list[torch.Tensor], pad: torch.Tensor | None) -> torch.Tensor:
    """Rows [1, n_b] as one tensor; rows that finished early are padded with `pad_token_id`, as `generate` pads them."""
    width = max(row.shape[1] for row in sequences)
    if len(sequences) == 1:
        return sequences[0]
    if pad is None and any(row.shape[1] < width for row in sequences):
        raise ValueError(
            "rows finished at different lengths and there is no pad_token_id to fill the shorter ones: "
            "set pad_token_id (e.g. to the tokenizer's eos_token_id)"
        )
    fill = 0 if pad is None else int(pad)
    return torch.cat([torch.cat([row, row.new_full((1, width - row.shape[1]), fill)], dim=1) for row in sequences])


__all__ = ["GenerationStats", "generate"]
