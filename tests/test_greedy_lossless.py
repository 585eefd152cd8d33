"""Property: greedy `hybrid.generate` returns `model.generate`'s tokens, for every verifier, drafter and scheduler.

The only allowed divergence is after a near tie (top-2 processed scores within NEAR_TIE_EPS); how
often that was needed is printed in the terminal summary (tests/conftest.py).
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from strategies import cache_layouts, drafters_for, prompt_masks, prompts, schedulers_for, verifiers

from hybrid.testing import check_cache_matches_prefill, check_greedy_lossless

PROPERTY = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(data=st.data())
def test_greedy_output_equals_model_generate(data):
    model = data.draw(verifiers(), label="verifier")
    vocab = model.config.vocab_size
    input_ids = data.draw(prompts(vocab), label="prompt")
    eos = data.draw(
        st.one_of(st.none(), st.integers(0, vocab - 1), st.lists(st.integers(0, vocab - 1), min_size=1, max_size=3)),
        label="eos",
    )
    first_eos = eos[0] if isinstance(eos, list) else eos
    drafter = data.draw(drafters_for(model, first_eos), label="drafter")
    scheduler = data.draw(schedulers_for(drafter), label="scheduler")
    kwargs = {"max_new_tokens": data.draw(st.integers(1, 40), label="max_new_tokens"), "eos_token_id": eos}
    if eos is not None:
        kwargs["pad_token_id"] = first_eos
        kwargs["min_new_tokens"] = data.draw(st.sampled_from([None, 0, 3]), label="min_new_tokens")
    mask = data.draw(prompt_masks(input_ids, model), label="attention_mask")  # padding, holes inside windows
    if mask is not None:
        kwargs["attention_mask"] = mask
    processor = data.draw(st.sampled_from([None, "repetition_penalty", "no_repeat_ngram_size"]), label="processor")
    if processor == "repetition_penalty":
        kwargs["repetition_penalty"] = 1.3
    elif processor == "no_repeat_ngram_size":
        kwargs["no_repeat_ngram_size"] = 2

    static = data.draw(cache_layouts(model), label="cache_implementation")
    report = check_greedy_lossless(
        model, input_ids, drafter, scheduler, hybrid_kwargs={"cache_implementation": static}, **kwargs
    )
    if report.near_tie_at is not None:
        event("near-tie exception used")
    event(f"drafter={type(drafter).__name__}")


@PROPERTY
@given(data=st.data())
def test_cache_after_generation_equals_fresh_prefill(data):
    model = data.draw(verifiers(), label="verifier")
    input_ids = data.draw(prompts(model.config.vocab_size), label="prompt")
    drafter = data.draw(drafters_for(model, None), label="drafter")
    scheduler = data.draw(schedulers_for(drafter), label="scheduler")
    max_new_tokens = data.draw(st.integers(2, 30), label="max_new_tokens")
    static = data.draw(cache_layouts(model), label="cache_implementation")
    import hybrid

    out = hybrid.generate(
        model,
        input_ids,
        drafter=drafter,
        scheduler=scheduler,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        return_dict_in_generate=True,
        cache_implementation=static,
    )
    check_cache_matches_prefill(model, out.sequences, out.cache, prompt_length=input_ids.shape[1])


def test_left_padded_prompt_matches_model_generate():
    """A left-padded batch-1 prompt with its attention mask decodes exactly as `generate` decodes it."""
    from strategies import tiny_model

    from drafters import ModelDrafter, PromptLookupDrafter

    model = tiny_model("llama", 64, 2, seed=3)
    ids = torch.tensor([[0, 0, 0, 5, 9, 5, 9, 17]])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])
    for drafter in (PromptLookupDrafter(), ModelDrafter(model)):
        report = check_greedy_lossless(model, ids, drafter, attention_mask=mask, max_new_tokens=30, pad_token_id=0)
        assert report.near_tie_at is None
