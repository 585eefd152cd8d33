"""Examples where a property would be vague: what each shipped drafter proposes."""

from __future__ import annotations

import math

import torch

import hybrid
from drafters import Draft, OracleDrafter, PromptLookupDrafter
from drafters.prompt_lookup import lookup_continuation
from schedulers import FixedScheduler, HeuristicScheduler
from strategies import tiny_model


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


def test_oracle_drafter_reaches_the_ceiling():
    """Proposing the verifier's own greedy text: every draft is accepted, so forwards = 1 + ceil((N - 1) / (k + 1))."""
    model = tiny_model("llama", 64, 2, seed=0)
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    reference = model.generate(prompt, max_new_tokens=40, do_sample=False)
    for k in (1, 4, 16):
        out, stats = hybrid.generate(
            model, prompt, drafter=OracleDrafter(reference), scheduler=FixedScheduler(k), max_new_tokens=40,
            return_stats=True,
        )  # fmt: skip
        assert torch.equal(out, reference)
        assert stats.verifier_forwards == 1 + math.ceil(39 / (k + 1))
        assert stats.accepted[1:-1] == [k] * (stats.verifier_forwards - 2)


def test_heuristic_scheduler_grows_on_success_and_shrinks_on_failure():
    s = HeuristicScheduler(4)
    s.reset(PromptLookupDrafter(max_draft_len=8))
    draft = lambda k: Draft(torch.zeros(k, dtype=torch.long))  # noqa: E731
    s.update(draft(4), 4, 0.0, 0.1)
    assert s.max_draft_length() == 6
    s.update(draft(6), 6, 0.0, 0.1)
    assert s.max_draft_length() == 8  # capped by the drafter
    s.update(draft(8), 3, 0.0, 0.1)
    assert s.max_draft_length() == 7
    s.update(draft(0), 0, 0.0, 0.1)  # nothing drafted: no evidence
    assert s.max_draft_length() == 7
