"""What `generate` feeds a model at each decoding step, where the model's own `prepare_inputs_for_generation` does
more than slice the step's token off the sequence.

`generate` asks `model.prepare_inputs_for_generation` for every step's forward. For most models that is
transformers' own, which passes the cache on and feeds the newest token. Some override it. Most overrides only
handle inputs a text-only call never passes (pixels, token types), but Phi-3, PhiMoE and Phi-4-multimodal drop the
cache once the sequence first grows past `original_max_position_embeddings` and re-read the whole sequence in one
forward: under LongRoPE that forward switches every cached key to the long factors, so a decode that keeps its
short-factor keys gives other tokens from there on, at any score gap.

hybrid does not call the hook at each step, so it asks it beforehand: for each position the pending token of a
decode may sit at, the model's hook is called as `generate` would call it there (a sequence one token longer than
the cache) and compared with transformers' own. Where the hook re-reads the sequence, the engine does the same at
that position (`Verifier.reread`); where it feeds anything else, the call is refused by name.
"""

from __future__ import annotations

import inspect
import weakref

import torch
from transformers import DynamicCache, GenerationMixin

_BASE = GenerationMixin.prepare_inputs_for_generation


def overrides_step_inputs(model) -> bool:
    """Whether `model`'s class has a `prepare_inputs_for_generation` of its own."""
    return type(model).prepare_inputs_for_generation is not _BASE


class _CacheOfLength(DynamicCache):
    """A cache that only says how long it is: what a step's hook reads of the cache it is given."""

    def __init__(self, model, length: int):
        super().__init__(config=model.config)  # its layers, so that it is as truthy as generate's after a prefill
        self.length = length
        # What `generate` puts in every step's model_kwargs for this model
        self.takes_positions = "position_ids" in inspect.signature(model.forward).parameters
        self.keeps_logits = model._supports_logits_to_keep()

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length


# model -> ({pending position: None (as transformers' own), "reread", or why it cannot be reproduced}, the cache)
_VERDICTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def step_verdict(model, position: int) -> str | None:
    """What `model`'s `generate` feeds at the step whose pending token sits at `position` (the cache holding every
    token before it): None where it feeds that token on the cache, as transformers' own hook does; "reread" where it
    drops the cache and feeds the whole sequence; else a description of what it feeds instead."""
    if model not in _VERDICTS:
        _VERDICTS[model] = ({}, _CacheOfLength(model, 0))
    verdicts, cache = _VERDICTS[model]
    if position not in verdicts:
        cache.length = position
        verdicts[position] = _probe(model, position, cache)
    return verdicts[position]


def _probe(model, position: int, cache: _CacheOfLength) -> str | None:
    ids = torch.zeros(1, position + 1, dtype=torch.long, device=model.device)

    # The step's model_kwargs as `generate` keeps them for an unpadded prompt
    kwargs = dict(attention_mask=torch.ones_like(ids), use_cache=True, is_first_iteration=False)
    if cache.takes_positions:
        kwargs["position_ids"] = torch.arange(position + 1, device=ids.device)[None]
    if cache.keeps_logits:
        kwargs["logits_to_keep"] = 1

    def step_inputs(hook, cache):
        return hook(ids, next_sequence_length=1, cache=cache, **kwargs)

    try:
        own = step_inputs(model.prepare_inputs_for_generation, cache)
    except Exception as error:  # a hook that needs inputs of a call this decode does not have
        return f"its prepare_inputs_for_generation fails on a text-only step ({type(error).__name__}: {error})"
    base = step_inputs(lambda *args, **kwargs: _BASE(model, *args, **kwargs), cache)
    fed = own.get("input_ids")
    if own.get("cache") is not cache:
        if isinstance(fed, torch.Tensor) and fed.shape == ids.shape:
            return "reread"
        return "its prepare_inputs_for_generation drops the cache and feeds part of the sequence"
    for name in sorted(set(own) | set(base)):
        # A hook that drops the step's mask of ones (the state-space models' do) feeds the same step without it
        dropped_ones = name == "attention_mask" and own.get(name) is None and _all_ones(base.get(name))
        if not dropped_ones and not _same(own.get(name), base.get(name)):
            return f"its prepare_inputs_for_generation feeds another {name} than the step's"
    return None


def _all_ones(mask) -> bool:
    return isinstance(mask, torch.Tensor) and bool((mask == 1).all())


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool((a == b).all())
    return a is b or a == b


def rereads(model, first: int, last: int) -> list[int]:
    """The pending positions in [first, last) at which `model.generate` drops its cache and re-reads the sequence.
    Raises ValueError, naming the position, where its hook feeds something else than transformers' own does."""
    if not overrides_step_inputs(model):
        return []
    found = []
    for position in range(first, last):
        verdict = step_verdict(model, position)
        if verdict == "reread":
            found.append(position)
        elif verdict is not None:
            raise ValueError(
                f"{type(model).__name__}.generate feeds other inputs than the newest token at position {position}: "
                f"{verdict}, which hybrid cannot reproduce. Keep the prompt plus max_new_tokens within {position} "
                "tokens, or decode with model.generate"
            )
    return found
