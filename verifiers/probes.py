"""Probes: a few tiny forwards that tell what no signature does, each run once per model or kind of model
(`verifiers.verdicts.probed`). Whether a forward takes new tokens on top of the cache it is passed, whether an output
depends on the tokens after it or on the forward's width, whether `generate` lets a padded row's output depend on its
padding. `verifiers.support` turns their answers into refusals."""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from verifiers.cache_layers import storing_layers
from verifiers.own_state import StateForwards, state_format
from verifiers.verdicts import built_of_own_modules, least_precise_dtype, probe_tokens, probed


def attends_ahead(model) -> bool:
    """Whether `model`'s output at a position depends on tokens after it in the same forward, as a BERT-family LM
    head's does when loaded without is_decoder=True, a model whose linears torch.ao quantized dynamically (one
    activation scale for all of a forward's tokens) or bitsandbytes' LLM.int8 with outlier columns (taken wherever
    any of a forward's tokens exceeds the threshold). Self-attention modules that all declare is_causal=True, in a
    model built of torch's and transformers' own modules with plain parameters, settle it; otherwise forwards of
    four tokens tell, once per kind of model (`verifiers.verdicts.probed`): the earlier outputs must not move when
    the last token changes, nor when its input is one large feature."""
    declared = [
        module.is_causal
        for module in model.modules()
        if isinstance(getattr(module, "is_causal", None), bool)
        and not getattr(module, "is_cross_attention", False)
        and "cross" not in type(module).__name__.lower()
    ]
    if declared and all(declared) and built_of_own_modules(model):
        return False
    return probed(model, _changes_earlier_outputs, failed=False)


def padding_changes_outputs(model) -> bool:
    """Whether `model.generate`'s logits for a left-padded row differ from the same row's alone, as GIT's do (its
    decoding steps widen a 2-D mask by its image tokens, moving a padded row's mask off its slots). hybrid decodes
    each row as if it were alone, so it cannot follow such a model's padded rows. Told by two greedy `generate` calls
    of two new tokens each (the prefill and a cached step), once per model."""
    return probed(model, _padded_logits_differ, failed=False)


def batching_changes_outputs(model) -> bool:
    """Whether `model.generate`'s logits for a row of a batch differ from the same row's alone, as RWKV's do in
    transformers (its one-token step mixes each row's input with the shifted state of every row, and runs the rows'
    mixes through its recurrence as if they were tokens). hybrid decodes each row as if it were alone, so it cannot
    follow such a model's batches. Told by three greedy `generate` calls of two new tokens each (two rows together
    and each alone), once per model; asked only of models that keep their state in a structure of their own, whose
    batching is their modeling code's alone (a Cache layer's rows are transformers' cache code's)."""
    return probed(model, _batched_logits_differ, failed=False)


def scores_depend_on_width(model) -> bool:
    """Whether `model`'s scores for a token move with the number of tokens its forward feeds by more than the
    rounding of the dtype it computes in, as torchao's and bitsandbytes' int8 products of activations quantized per
    token do on a CPU: a prefill or a verify then scores other numbers than `generate`'s. A model built of torch's
    and transformers' own modules with plain parameters rounds by width only as its dtype does; any other is told by
    forwards of every prefix of 16 tokens against the whole, and cached forwards of 2 to 8 tokens against the same
    tokens fed one by one, once per kind of model (`verifiers.verdicts.probed`)."""
    return not built_of_own_modules(model) and probed(model, _width_changes_scores, failed=False)


def cache_feed_problem(model, width: int) -> str | None:
    """Why `model`'s forward cannot take `width` new tokens on top of the cache it is passed, step after step, as
    hybrid feeds them (None if it can): a forward that stores nothing in that cache (Reformer's), keeps state in a
    cache of its own around it (BLT's), or fails, or scores another number of positions than it was fed, when tokens
    are cached already (XLM's takes the whole sequence every step and slices off what its cache holds, ProphetNet's
    asserts one token at a time). The signature cannot tell, so forwards of 2 tokens and then twice `width` tell,
    once per kind of model and width (`verifiers.verdicts.probed`): without this the first steps, or the cost
    measurement before them, would fail inside the model."""
    return probed(model, _feed_problem, width)


def relative_difference(reference: torch.Tensor, other: torch.Tensor) -> float:
    """How far `other` is from `reference`, as a share of the largest magnitude in `reference` (float32)."""
    reference, other = reference.float(), other.float()
    return float((other - reference).abs().max() / reference.abs().max())


LOGITS_DIFFER = 1e-3  # a relative difference of logits past float noise: the model computed something else


def _changes_earlier_outputs(model) -> bool:
    tokens, other = probe_tokens(model, 4)
    changed = tokens.clone()
    changed[0, -1] = other
    before = model(tokens, use_cache=False).logits[0, :-1]
    after = model(changed, use_cache=False).logits[0, :-1]
    if relative_difference(before, after) > LOGITS_DIFFER:
        return True
    # A range taken over the whole forward (LLM.int8's outlier columns, a per-tensor activation scale) may not move
    # with another token of the vocabulary, and moves with one large feature, which normalization keeps large.
    embeds = model.get_input_embeddings()(tokens)
    spiked = embeds.clone()
    spiked[0, -1] = 0
    spiked[0, -1, embeds.shape[-1] // 2] = 10 * embeds.abs().max()
    try:
        before = model(inputs_embeds=embeds, use_cache=False).logits[0, :-1]
    except (TypeError, ValueError):  # a model that takes token ids only: the tokens told what they can
        return False
    after = model(inputs_embeds=spiked, use_cache=False).logits[0, :-1]
    return relative_difference(before, after) > LOGITS_DIFFER


def _width_changes_scores(model) -> bool:
    tokens, _ = probe_tokens(model, 16)
    limit = max(LOGITS_DIFFER, 8 * torch.finfo(least_precise_dtype(model)).eps)  # several rounding steps

    def differs(reference: torch.Tensor, other: torch.Tensor) -> bool:
        return relative_difference(reference, other) > limit

    # A prefill: each prefix against the whole (some kernels change at a particular width, not at every one)
    whole = model(tokens, use_cache=False).logits[0]
    if any(differs(whole[:n], model(tokens[:, :n], use_cache=False).logits[0]) for n in range(1, 16)):
        return True

    # A verify: tokens fed together on top of a cache against the same fed one by one, as `generate` decodes
    def prefilled():
        forwards = cached_forwards(model)
        forwards(tokens[:, :2])
        return forwards

    forwards = prefilled()
    one_by_one = torch.cat([forwards(tokens[:, i : i + 1]).logits[0] for i in range(2, 10)])
    together = (prefilled()(tokens[:, 2 : 2 + n]).logits[0] for n in range(2, 9))
    return any(differs(one_by_one[: len(scores)], scores) for scores in together)


# Two greedy steps of `generate` with their logits: what the probes that compare `generate`'s rows ask of it
GENERATE_PROBE = dict(
    max_new_tokens=2,
    do_sample=False,
    num_beams=1,
    output_logits=True,
    return_dict_in_generate=True,
    disable_compile=True,  # a probe of four tiny forwards: compiling them would cost more than it saves
)


def _padded_logits_differ(model) -> bool:
    tokens, pad = probe_tokens(model, 3)
    padded = torch.cat([tokens.new_full((1, 2), pad), tokens], dim=1)
    settings = dict(GENERATE_PROBE, pad_token_id=pad)
    generate = type(model).generate  # transformers' own, even where hybrid stands in for the instance's
    alone = generate(model, tokens, attention_mask=torch.ones_like(tokens), **settings).logits
    mask = torch.ones_like(padded)
    mask[0, :2] = 0
    beside = generate(model, padded, attention_mask=mask, **settings).logits
    return any(relative_difference(a, b) > LOGITS_DIFFER for a, b in zip(alone, beside))


def _batched_logits_differ(model) -> bool:
    tokens, pad = probe_tokens(model, 6)
    rows = torch.cat([tokens[:, :3], tokens[:, 3:]])
    settings = dict(GENERATE_PROBE, pad_token_id=pad)
    generate = type(model).generate  # transformers' own, even where hybrid stands in for the instance's
    together = generate(model, rows, attention_mask=torch.ones_like(rows), **settings).logits
    for b in range(rows.shape[0]):
        alone = generate(model, rows[b : b + 1], attention_mask=torch.ones_like(rows[b : b + 1]), **settings).logits
        if any(relative_difference(a[0], t[b]) > LOGITS_DIFFER for a, t in zip(alone, together)):
            return True
    return False


def cached_forwards(model):
    """A function that runs `model` on input_ids [1, q] after every token it was given before, as hybrid feeds a
    verifier: through a DynamicCache, or through the model's own state structure (`verifiers.own_state`)."""
    if state_format(model) is not None:
        return StateForwards(model)
    cache = DynamicCache(config=model.config)
    return lambda input_ids: model(input_ids, cache=cache, use_cache=True)


def _feed_problem(model, width: int) -> str | None:
    tokens, _ = probe_tokens(model, 2 + 2 * width)
    # Position ids as the verifier passes them: some forwards cannot derive their own (XMOD's without a pad id)
    positions = torch.arange(tokens.shape[1], device=model.device)[None]
    cache = DynamicCache(config=model.config)
    # A model with a state structure of its own is fed through it, as the verifier feeds it (`verifiers.own_state`)
    own = StateForwards(model) if state_format(model) is not None else None
    for start, end in ((0, 2), (2, 2 + width), (2 + width, 2 + 2 * width)):
        fed = f"{end - start} token{'s' if end - start > 1 else ''}" + (f" after {start} cached ones" if start else "")
        try:
            if own is not None:
                out = own(tokens[:, start:end])
            else:
                # Through `forward`, past hooks on the model itself: they watch decoding's forwards, and this is none.
                out = model.forward(
                    input_ids=tokens[:, start:end], position_ids=positions[:, start:end], cache=cache, use_cache=True
                )
        except (MemoryError, torch.OutOfMemoryError):  # this machine's limit, not the model's
            raise
        except Exception as error:
            reason = (str(error).strip().splitlines() or [""])[0]
            return f"its forward fails when fed {fed} ({type(error).__name__}: {reason})"
        problem = None if own is not None else _cache_problem(model, out, cache)
        if problem:
            return problem
        if out.logits.shape[1] != end - start:
            return f"its forward, fed {fed}, returns scores for {out.logits.shape[1]} of them"
    return None


def _cache_problem(model, out, cache: DynamicCache) -> str | None:
    """Why a forward's `out` shows that it did not keep its state in the `cache` it was passed (None if it did)."""
    returned = getattr(out, "cache", None)
    if returned is not None and returned is not cache:
        return (
            f"its forward keeps state in a cache of its own ({type(returned).__name__}) around the one it is "
            "passed, which a forward through hybrid's cache would lose"
        )
    stores = storing_layers(cache, model.config.get_text_config())
    if not all(getattr(layer, "is_initialized", True) for layer in stores):  # recurrent layers: no flag
        return (
            "its forward did not store its keys/values in the cache hybrid passed it (cache=...): such a model "
            "recomputes the whole sequence every step"
        )
    return None


def records_each_state(model) -> bool:
    """Whether `model`'s recurrent and convolution layers, asked to record (`recurrent_states_to_keep`), hand the
    cache the state after each token of a forward and the whole convolution input, as hybrid's rollback needs
    (`verifiers.state_layers`). A layer that ignores the request hands over the last state alone, which would roll a
    partly accepted verify back to the wrong token. Told by a forward of 3 tokens after 2, once per kind of model."""
    return probed(model, _records_each_state, failed=False)


def _records_each_state(model) -> bool:
    tokens, _ = probe_tokens(model, 5)
    cache = DynamicCache(config=model.config)
    model(tokens[:, :2], cache=cache, use_cache=True)
    cache.activate_past_recording(recurrent_states_to_keep=3)
    layers = [layer for layer in cache.layers if isinstance(layer, LinearAttentionCacheLayerMixin)]
    for layer in layers:  # one list per state (transformers' own shares one between a layer's states)
        layer.recurrent_states_history = {i: [] for i in range(layer.number_of_states)}
    model(tokens[:, 2:], cache=cache, use_cache=True)
    for layer in layers:
        for i in range(layer.number_of_states):
            if layer.is_recurrent_states_initialized[i] and len(layer.recurrent_states_history[i]) != 3:
                return False
            if layer.is_conv_states_initialized[i] and layer.conv_states[i].shape[-1] != layer.conv_kernel_size[i] + 3:
                return False
    return bool(layers)
