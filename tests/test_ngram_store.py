"""The n-gram store: what it keeps is what the answers say, lookups chain the longest match, it round-trips,
and drafters built on it stay lossless and refuse a store of another verifier."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import ngram_store_for, random_block_drafter, tiny_model
from transformers import LogitsProcessorList

from drafters import ChainDrafter, PromptLookupDrafter
from drafters.base import DraftContext
from drafters.block_diffusion import verifier_fingerprint
from drafters.ngram_store import CONFIG_NAME, TABLES_NAME, NgramStore
from drafters.training.ngram_build import main
from hybrid.testing import check_greedy_lossless
from schedulers import FixedScheduler
from verifiers.verifier import Verifier

VOCAB = 48

answers = st.lists(
    st.tuples(st.lists(st.integers(0, 5), min_size=1, max_size=30), st.integers(0, 4)), min_size=1, max_size=6
)  # small alphabet: n-grams repeat, ties happen


def brute_force(answers, max_n):
    """{(n-gram): Counter of the answer tokens that followed it}, the definition the store must match."""
    seen = {}
    for ids, prompt_len in answers:
        for j in range(prompt_len, len(ids)):
            for n in range(1, max_n + 1):
                if j - n >= 0:
                    seen.setdefault(tuple(ids[j - n : j]), Counter())[ids[j]] += 1
    return seen


@settings(max_examples=60, deadline=None)
@given(answers=answers, max_n=st.integers(1, 4), min_count=st.integers(1, 3))
def test_the_store_keeps_the_most_frequent_next_token_of_every_frequent_ngram(answers, max_n, min_count):
    store = NgramStore.build(answers, vocab_size=6, max_n=max_n, min_count=min_count)
    expected = {k: c for k, c in brute_force(answers, max_n).items() if sum(c.values()) >= min_count}
    assert sum(store.info["entries"]) == len(expected)
    for gram, counts in expected.items():
        best = max(counts.values())
        token = min(t for t, c in counts.items() if c == best)  # ties: the smaller token id
        found = store.next_token(list(gram), min_n=len(gram))
        assert found is not None and found[0] == token and found[2] == len(gram)
        assert found[1] == pytest.approx(best / sum(counts.values()))


@settings(max_examples=60, deadline=None)
@given(answers=answers, context=st.lists(st.integers(0, 5), min_size=1, max_size=8), min_n=st.integers(1, 3))
def test_a_continuation_chains_the_longest_known_ngram(answers, context, min_n):
    store = NgramStore.build(answers, vocab_size=6, max_n=3, min_count=1)
    seen = brute_force(answers, 3)
    tokens, shares = store.continuation(context, 6, min_n)
    ids = list(context)
    for token, share in zip(tokens, shares):
        gram = next(tuple(ids[-n:]) for n in range(min(3, len(ids)), min_n - 1, -1) if tuple(ids[-n:]) in seen)
        counts = seen[gram]
        assert counts[token] == max(counts.values()) and share == pytest.approx(counts[token] / sum(counts.values()))
        ids.append(token)
    if len(tokens) < 6:  # it stopped: nothing of length >= min_n matches
        assert all(tuple(ids[-n:]) not in seen for n in range(min_n, min(3, len(ids)) + 1))


def test_save_and_load_round_trip(tmp_path):
    store = NgramStore.build(
        [([1, 2, 3, 1, 2, 4, 1, 2, 3], 1)],
        vocab_size=VOCAB,
        max_n=3,
        min_count=1,
        verifier={"vocab_size": VOCAB},
        info={"answers": "test"},
    )
    store.save_pretrained(tmp_path / "s")
    loaded = NgramStore.from_pretrained(tmp_path / "s")
    assert loaded.digest() == store.digest() and loaded.verifier == store.verifier and loaded.info == store.info
    assert loaded.continuation([9, 1], 4) == ([2, 3, 1, 2], pytest.approx([1.0, 2 / 3, 1.0, 1.0], abs=1e-3))


def test_bad_stores_are_refused_with_the_fix(tmp_path):
    with pytest.raises(ValueError, match=r"max_n must be in 1\.\.10 .*got 11"):
        NgramStore.build([([1, 2], 0)], vocab_size=48, max_n=11)  # 6 bits a token: 10 fit in 64
    with pytest.raises(ValueError, match="token id 50 >= vocab_size 48: answers from another tokenizer"):
        NgramStore.build([([1, 50], 0)], vocab_size=48)
    with pytest.raises(ValueError, match="min_count must be >= 1"):
        NgramStore.build([([1, 2], 0)], vocab_size=48, min_count=0)
    with pytest.raises(FileNotFoundError, match=CONFIG_NAME):
        NgramStore.from_pretrained(tmp_path / "nothing")
    store = NgramStore.build([([1, 2, 1, 2], 0)], vocab_size=48, max_n=2, min_count=1)
    store.save_pretrained(tmp_path / "s")
    (tmp_path / "s" / TABLES_NAME).write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="not a valid NgramStore.*python -m drafters.training.ngram_build"):
        NgramStore.from_pretrained(tmp_path / "s")
    with pytest.raises(ValueError, match=r"store_min_n must be in 1\.\.2"):
        PromptLookupDrafter(ngram_store=store, store_min_n=3)
    with pytest.raises(SystemExit):
        main(["--answers", str(tmp_path), "--out", str(tmp_path / "o")])  # no gen-*.json there


def test_a_store_of_another_verifier_is_refused():
    verifier, other = tiny_model("llama", VOCAB, 1, seed=0), tiny_model("llama", VOCAB, 1, seed=1)
    with pytest.raises(
        ValueError, match="built from another verifier's answers .*python -m drafters.training.ngram_build"
    ):
        PromptLookupDrafter(ngram_store=ngram_store_for(other, 0, own_answers=False), verifier=verifier)
    wrong_vocab = NgramStore.build([([1, 2, 1, 2], 0)], vocab_size=VOCAB + 16, max_n=2, min_count=1)
    with pytest.raises(ValueError, match="vocab"):
        check_greedy_lossless(
            verifier, torch.tensor([[1, 2, 3]]), PromptLookupDrafter(ngram_store=wrong_vocab), max_new_tokens=4
        )


def test_the_store_continues_the_context_match_then_the_model_fills_the_block():
    verifier = tiny_model("qwen2", VOCAB, 1, seed=3)
    store = NgramStore.build(
        [([30, 31, 32, 33, 34, 35, 36], 0)],
        vocab_size=VOCAB,
        max_n=2,
        min_count=1,
        verifier=verifier_fingerprint(verifier),
    )
    ids = torch.tensor([5, 30, 9, 30])  # 30 was followed by 9 here; the store knows 9 -> nothing, 30 -> 31 -> ...
    v = Verifier(verifier, hidden_layers=(1,))
    v.prefill(ids[None, :-1], None, capacity=64)
    ctx = DraftContext(ids[None], False, LogitsProcessorList(), None, v)
    context_only = random_block_drafter(verifier, seed=0, block_size=8, lookup_ngram=1)
    with_store = random_block_drafter(verifier, seed=0, block_size=8, lookup_ngram=1, ngram_store=store, store_min_n=1)
    assert isinstance(with_store, ChainDrafter)  # the lookup (continued by the store), then the block model
    assert context_only.sources[0].propose(ctx, 7).tokens.tolist() == [9, 30]  # what followed 30 last time
    lookup = with_store.sources[0].propose(ctx, 7)
    assert lookup.tokens.tolist() == [9, 30, 31, 32, 33, 34, 35]  # then the store: 30 -> 31 -> ... up to the block's 7
    assert lookup.confidence.tolist() == pytest.approx([1 / 2, 1 / 2, 1, 1, 1, 1, 1])  # a 1-token match: 1 / (1 + 1)
    assert with_store.propose(ctx, 7).tokens.tolist() == lookup.tokens.tolist()
    assert context_only.fingerprint != with_store.fingerprint  # schedulers calibrate them apart
    no_store_hit = random_block_drafter(
        verifier, seed=0, block_size=8, lookup_ngram=1, ngram_store=store, store_min_n=2
    )
    draft = no_store_hit.propose(ctx, 7)  # [30, 9] and [9, 30] are unknown bigrams: the model fills positions 3..7
    assert draft.tokens[:2].tolist() == [9, 30] and len(draft) == 7
    store_alone = random_block_drafter(verifier, seed=0, block_size=8, ngram_store=store, store_min_n=1)
    assert store_alone.sources[0].min_ngram == 0  # no context match: the store continues the context itself
    draft = store_alone.propose(ctx, 7)  # 30 -> 31 -> ... -> 36, which nothing follows: the model drafts the 7th
    assert draft.tokens[:6].tolist() == [31, 32, 33, 34, 35, 36] and len(draft) == 7


# A sliding window, and verifiers with state layers: Qwen3.5's Gated DeltaNet, Jamba's Mamba (then attention).
VERIFIERS = {"mistral": (2, 5), "qwen3_5": (1, None), "jamba": (1, None)}  # architecture: (layers, sliding window)


@pytest.mark.parametrize("arch", sorted(VERIFIERS))
@pytest.mark.parametrize("own_answers", [True, False])
def test_drafters_with_a_store_stay_lossless(arch, own_answers, one_thread):
    layers, window = VERIFIERS[arch]
    verifier = tiny_model(arch, VOCAB, layers, seed=4, sliding_window=window)
    prompt = torch.tensor([[3, 7, 11, 3]])
    if own_answers:  # the store holds this very answer: its drafts are accepted
        answer = verifier.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=30, do_sample=False)
        store = NgramStore.build(
            [(answer[0].tolist(), 4)], VOCAB, max_n=3, min_count=1, verifier=verifier_fingerprint(verifier)
        )
    else:
        store = ngram_store_for(verifier, seed=1, own_answers=False)
    for drafter in (
        PromptLookupDrafter(ngram_store=store, store_min_n=1, max_draft_len=6),
        random_block_drafter(
            verifier, seed=2, block_size=5, lookup_ngram=1, lookup_tokens=9, ngram_store=store, store_min_n=1
        ),
    ):
        report = check_greedy_lossless(
            verifier, prompt, drafter, FixedScheduler(drafter.node_budget), max_new_tokens=30
        )
        assert sum(report.stats.drafted) > 0  # every step drafts: whether that pays is the cost model's call
        if own_answers:
            assert sum(report.stats.accepted) > 0
