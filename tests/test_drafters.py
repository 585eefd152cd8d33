"""Examples where a property would be vague: what each shipped drafter proposes."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import tiny_model

import hybrid
from drafters import Draft, OracleDrafter, PromptLookupDrafter
from drafters.ngram_store import NgramStore
from drafters.prompt_lookup import lookup_continuation, lookup_draft
from schedulers import FixedScheduler, HeuristicScheduler


def ids(*tokens):
    return torch.tensor(tokens)


def test_lookup_prefers_longest_ngram_then_most_recent_match():
    # suffix (7, 8): the bigram occurred at 0 (-> 1) and at 4 (-> 2); the most recent wins.
    assert lookup_continuation(ids(7, 8, 1, 5, 7, 8, 2, 3, 9, 7, 8), 1, 3, 2)[0].tolist() == [2, 3]
    # trigram (5, 7, 8) beats the more recent bigram match.
    tokens, n = lookup_continuation(ids(5, 7, 8, 4, 7, 8, 6, 5, 7, 8), 1, 3, 1)
    assert (tokens.tolist(), n) == ([4], 3)


def test_lookup_never_matches_the_suffix_itself_and_may_find_nothing():
    assert lookup_continuation(ids(1, 2, 3), 1, 3, 4)[0].tolist() == []
    assert lookup_continuation(ids(4), 1, 3, 4)[0].tolist() == []
    assert lookup_continuation(ids(4, 4), 1, 3, 4)[0].tolist() == [4]


def longest_match_by_definition(
    ids: list[int], min_ngram: int, max_ngram: int, max_tokens: int
) -> tuple[list[int], int]:
    """For n = max_ngram down to min_ngram: the most recent earlier occurrence of the last n tokens that has a
    token after it; what follows it."""
    for n in range(min(max_ngram, len(ids) - 1), min_ngram - 1, -1):
        starts = [j for j in range(len(ids) - n) if ids[j : j + n] == ids[len(ids) - n :]]
        if starts:
            return ids[starts[-1] + n : starts[-1] + n + max_tokens], n
    return [], 0


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=40), st.integers(1, 4), st.integers(0, 40), st.integers(1, 9))
def test_lookup_finds_the_longest_then_most_recent_match(tokens, min_ngram, extra, max_tokens):
    max_ngram = min_ngram + extra
    found, n = lookup_continuation(torch.tensor(tokens), min_ngram, max_ngram, max_tokens)
    assert (found.tolist(), n) == longest_match_by_definition(tokens, min_ngram, max_ngram, max_tokens)


def test_the_store_takes_over_from_a_one_token_match_only_when_confident():
    # The store's answers: after (1, 2) comes 3 twice, 4 once; after (2, 3) comes 3 again.
    store = NgramStore.build([([1, 2, 3, 3, 1, 2, 3, 3, 1, 2, 4], 0)], vocab_size=8, max_n=2, min_count=1)
    one_token = torch.tensor([2, 7, 1, 2])  # the context's match is "2" alone (followed by 7)
    assert lookup_draft(one_token, 1, 8, 3, store)[0].tolist() == [7, 1, 2]  # no preference: the context's match
    tokens, confidence = lookup_draft(one_token, 1, 8, 3, store, prefer_store=0.6)
    assert tokens.tolist() == [3, 3, 1] and confidence[0] == pytest.approx(2 / 3)  # (1, 2) -> 3 has share 2/3
    assert lookup_draft(one_token, 1, 8, 3, store, prefer_store=0.7)[0].tolist() == [7, 1, 2]  # 2/3 < 0.7
    two_tokens = torch.tensor([1, 2, 6, 1, 2])  # a 2-token match is kept whatever the store says
    assert lookup_draft(two_tokens, 1, 8, 3, store, prefer_store=0.0)[0].tolist() == [6, 1, 2]


def test_lookup_options_are_checked():
    with pytest.raises(ValueError, match="prefer_store"):
        PromptLookupDrafter(prefer_store=0.5)  # no store to prefer
    store = NgramStore.build([([1, 2, 3], 0)], vocab_size=8, max_n=2, min_count=1)
    with pytest.raises(ValueError, match="prefer_store"):
        PromptLookupDrafter(ngram_store=store, prefer_store=1.5)
    with pytest.raises(ValueError, match="min_ngram=0 .* needs an ngram_store"):
        PromptLookupDrafter(min_ngram=0)  # no context match and no store: nothing to draft from
    with pytest.raises(ValueError, match="need 0 <= min_ngram <= max_ngram"):
        PromptLookupDrafter(min_ngram=4, max_ngram=3)
    with pytest.raises(ValueError, match="max_draft_len must be >= 1"):
        PromptLookupDrafter(max_draft_len=0)


def test_oracle_drafter_reaches_the_ceiling():
    """Proposing the verifier's own greedy text: every draft is accepted, so forwards = 1 + ceil((N - 1) / (k + 1))."""
    model = tiny_model("llama", 64, 2, seed=0)
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    reference = model.generate(prompt, max_new_tokens=40, do_sample=False)
    for k in (1, 4, 16):
        out, stats = hybrid.generate(
            model,
            prompt,
            drafter=OracleDrafter(reference),
            scheduler=FixedScheduler(k),
            max_new_tokens=40,
            return_stats=True,
        )
        assert torch.equal(out, reference)
        assert stats.verifier_forwards == 1 + math.ceil(39 / (k + 1))
        assert stats.accepted[1:-1] == [k] * (stats.verifier_forwards - 2)


def test_heuristic_scheduler_grows_on_success_and_shrinks_on_failure():
    s = HeuristicScheduler(4)
    s.start(PromptLookupDrafter(max_draft_len=8))
    draft = lambda k: Draft(torch.zeros(k, dtype=torch.long))  # noqa: E731
    s.observe([draft(4)], [list(range(4))], [0.0], 0.1)
    assert s.plan([1.0]).max_nodes == 6
    s.observe([draft(6)], [list(range(6))], [0.0], 0.1)
    assert s.plan([1.0]).max_nodes == 8  # capped by the drafter
    s.observe([draft(8)], [list(range(3))], [0.0], 0.1)
    assert s.plan([1.0]).max_nodes == 7
    s.observe([draft(0)], [list(range(0))], [0.0], 0.1)  # nothing drafted: no evidence
    assert s.plan([1.0]).max_nodes == 7
    s.observe([draft(8), draft(3)], [list(range(8)), []], [0.0, 0.0], 0.1)  # row by row: +2, then -1
    assert s.plan([1.0, 1.0]).max_nodes == 7


def recorded_drafts_module():
    """tests/data/record_default_drafts.py, which recorded tests/data/default_drafts.json (and replays it here)."""
    path = Path(__file__).parent / "data" / "record_default_drafts.py"
    spec = importlib.util.spec_from_file_location("record_default_drafts", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_default_drafter_proposes_the_recorded_drafts():
    """`hybrid.load_default()`'s drafter, asked the recorded calls (the same prompts, greedy, every draft verified),
    proposes the very drafts recorded from it: token for token, confidences within 1e-4."""
    recorder = recorded_drafts_module()
    recorded = json.loads(recorder.OUT.read_text())
    model, tokenizer, drafter = hybrid.load_default()
    replayed = recorder.record(model, tokenizer, drafter, recorder.dev_prompts())
    runs = [(f"prompt {i}", calls) for i, calls in enumerate(replayed["single"])] + [("batch", replayed["batch"])]
    expected = recorded["single"] + [recorded["batch"]]
    for (name, calls), want in zip(runs, expected, strict=True):
        assert len(calls) == len(want), name
        for step, (rows, want_rows) in enumerate(zip(calls, want)):
            for row, (got, exp) in enumerate(zip(rows, want_rows, strict=True)):
                where = f"{name}, call {step}, row {row}"
                assert got[:3] == exp[:3], where  # committed length, tokens asked, tokens drafted
                assert max((abs(a - b) for a, b in zip(got[3], exp[3], strict=True)), default=0) <= 1, where


def test_sampling_warpers_keep_the_order_other_processors_may_not():
    """A drafter may take its greedy guesses from raw logits exactly when no processor can reorder tokens."""
    from transformers import (
        LogitsProcessorList,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    from drafters import DraftContext

    def ctx(*processors):
        return DraftContext(torch.tensor([[1, 2]]), False, LogitsProcessorList(processors), None, None)

    warpers = (TemperatureLogitsWarper(0.7), TopKLogitsWarper(5), TopPLogitsWarper(0.9))
    assert not ctx().reorders and not ctx(*warpers).reorders
    assert ctx(*warpers, RepetitionPenaltyLogitsProcessor(1.3)).reorders
    logits = torch.randn(50)
    processed = LogitsProcessorList(warpers)(torch.tensor([[1, 2]]), logits[None])[0]
    assert int(processed.argmax()) == int(logits.argmax())
