"""Properties of sampling: under the default rule the output is `model.generate`'s for the same seed; under the
rejection rule (and in batches) every emitted token is distributed exactly as the verifier's p."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from strategies import (
    AdversarialDrafter,
    drafters_for,
    ngram_store_for,
    prompts,
    random_block_drafter,
    schedulers_for,
    tiny_model,
    verifiers,
)

import hybrid
from drafters import ModelDrafter, PromptLookupDrafter
from hybrid import acceptance
from hybrid.acceptance import acceptance_probability, residual_distribution, speculative_step
from hybrid.testing import check_sampled_identical, chi_square_critical, chi_square_statistic, sequence_distribution
from schedulers import ConfidenceScheduler, CostAwareScheduler, FixedScheduler, HeuristicScheduler

ALPHA = 1e-3  # false-alarm rate of each statistical test, at fixed seeds


def distributions(vocab: int, allow_zeros: bool):
    weights = st.floats(0.0 if allow_zeros else 1e-3, 1.0)
    return (
        st.lists(weights, min_size=vocab, max_size=vocab)
        .filter(lambda w: sum(w) > 1e-3)
        .map(lambda w: torch.tensor(w, dtype=torch.float64) / sum(w))
    )


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_one_step_emits_exactly_p(data):
    """Sum over drafts x ~ q of [accept x] + [reject x, then draw the residual] equals p, exactly."""
    vocab = data.draw(st.integers(2, 10))
    p = data.draw(distributions(vocab, allow_zeros=True), label="p")
    deterministic = data.draw(st.booleans(), label="one-hot q")
    if deterministic:  # a deterministic drafter: q is a point mass on its token
        x = data.draw(st.integers(0, vocab - 1))
        cases = [(1.0, None, x)]
    else:
        q = data.draw(distributions(vocab, allow_zeros=True), label="q")
        cases = [(float(q[x]), q, x) for x in range(vocab) if q[x] > 0]
    emitted = torch.zeros(vocab, dtype=torch.float64)
    for weight, q_row, x in cases:
        a = acceptance_probability(p, q_row, x)
        emitted[x] += weight * a
        emitted += weight * (1 - a) * residual_distribution(p, q_row, x)
    assert torch.allclose(emitted, p, atol=1e-9), (emitted, p)


def test_speculative_step_samples_p():
    """The sampler itself, at a fixed seed: 20,000 steps pass a chi-square test against p, and fail it against q."""
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.0, 0.30])
    q = torch.tensor([0.40, 0.10, 0.20, 0.05, 0.25, 0.0])
    n = 20_000
    counts = Counter()
    drafted = Counter()
    for _ in range(n):
        x = int(torch.multinomial(q, 1, generator=gen))
        drafted[x] += 1
        counts[speculative_step(p, q, x, gen)[1]] += 1
    as_dict = {i: float(v) for i, v in enumerate(p) if v > 0}
    stat, df = chi_square_statistic(counts, as_dict)
    assert stat < chi_square_critical(df, ALPHA), (stat, df, counts)
    stat_q, _ = chi_square_statistic(drafted, as_dict)  # the test has power: the raw drafts are not p
    assert stat_q > chi_square_critical(df, ALPHA)


VOCAB, NEW_TOKENS, SAMPLES = 4, 3, 2000
WARPERS = {"temperature": 0.7, "top_k": 3}


@pytest.fixture(scope="module")
def tiny():
    model = tiny_model("llama", VOCAB, 1, seed=11)
    prompt = torch.tensor([[1, 2]])
    return model, prompt, sequence_distribution(model, prompt, NEW_TOKENS, **WARPERS)


@pytest.mark.parametrize(
    "drafter_kind",
    [
        "model",
        "self",
        "lookup",
        "adversarial",
        "block",
        "block-steps-lookup",
        "block-long-lookup",
        "block-store",
        "block-static",
    ],
)
def test_generated_sequences_follow_ar_sampling(tiny, drafter_kind):
    """Under the rejection rule, 2,000 sequences of 3 tokens (4-token vocabulary, T=0.7, top-k 3) pass a
    chi-square goodness-of-fit test, at level 1e-3, against the exact distribution of plain AR sampling."""
    model, prompt, exact = tiny
    drafter = {
        "model": lambda: ModelDrafter(tiny_model("qwen2", VOCAB, 1, seed=5)),
        "self": lambda: ModelDrafter(model),
        "lookup": lambda: PromptLookupDrafter(min_ngram=1, max_ngram=1),
        "adversarial": lambda: AdversarialDrafter(VOCAB, None, seed=2),
        "block": lambda: random_block_drafter(model, seed=3, draft_vocab_size=3, block_size=4),
        # Several denoising passes fix tokens left to right, and lookup tokens come first: still exact.
        "block-steps-lookup": lambda: random_block_drafter(
            model, seed=4, block_size=4, steps=3, threshold=0.3, lookup_ngram=1
        ),
        # Lookup matches longer than the block are proposed whole (deterministic tokens past the block).
        "block-long-lookup": lambda: random_block_drafter(model, seed=4, block_size=3, lookup_ngram=1, lookup_tokens=6),
        # The n-gram store (of the model's greedy answers) continues the lookup: more deterministic drafts.
        "block-store": lambda: random_block_drafter(
            model,
            seed=4,
            block_size=3,
            lookup_ngram=1,
            lookup_tokens=5,
            ngram_store=ngram_store_for(model, seed=0, own_answers=True),
        ),
        # The static-shape path: padded verifies, the whole cache read through masks.
        "block-static": lambda: random_block_drafter(model, seed=3, draft_vocab_size=3, block_size=4),
    }[drafter_kind]()
    static = "static" if drafter_kind.endswith("static") else None
    gen = torch.Generator().manual_seed(1234)
    counts, drafted = Counter(), 0
    for _ in range(SAMPLES):
        out, stats = hybrid.generate(
            model,
            prompt,
            drafter=drafter,
            do_sample=True,
            max_new_tokens=NEW_TOKENS,
            generator=gen,
            return_stats=True,
            scheduler=FixedScheduler(drafter.node_budget),  # drafts every step (the default may skip a poor drafter)
            cache_implementation=static,
            acceptance="rejection",
            **WARPERS,
        )
        counts[tuple(out[0, prompt.shape[1] :].tolist())] += 1
        drafted += sum(stats.drafted)
    assert drafted > 0, "the drafter never drafted: the test would not exercise rejection sampling"
    stat, df = chi_square_statistic(counts, exact)
    assert stat < chi_square_critical(df, ALPHA), (stat, df)


def test_sequence_test_has_power(tiny):
    """The same procedure rejects a sampler that is off: plain sampling at T=1 instead of T=0.7."""
    model, prompt, exact = tiny
    torch.manual_seed(0)
    counts = Counter()
    for _ in range(SAMPLES):
        out = model.generate(prompt, do_sample=True, max_new_tokens=NEW_TOKENS, temperature=1.0, top_k=3)
        counts[tuple(out[0, prompt.shape[1] :].tolist())] += 1
    stat, df = chi_square_statistic(counts, exact)
    assert stat > chi_square_critical(df, ALPHA), (stat, df)


@pytest.mark.parametrize(
    "make_scheduler",
    [
        lambda: FixedScheduler(3),
        HeuristicScheduler,
        ConfidenceScheduler,
        lambda: CostAwareScheduler(costs={1: 1.0, 17: 2.0}),
    ],
)
def test_generator_makes_sampling_reproducible(tiny, make_scheduler):
    """Same generator seed: same sample, whatever the scheduler chose (the verifier's draws are all there is)."""
    model, prompt, _ = tiny
    runs = [
        hybrid.generate(
            model,
            prompt,
            drafter=ModelDrafter(model),
            scheduler=make_scheduler(),
            do_sample=True,
            max_new_tokens=20,
            generator=torch.Generator().manual_seed(7),
        )
        for _ in range(2)
    ]
    assert torch.equal(runs[0], runs[1])


@pytest.mark.parametrize("drafter_kind", ["adversarial", "block"])
def test_batched_rows_follow_ar_sampling(tiny, drafter_kind):
    """A left-padded batch of two different prompts, sampled 2,000 times: each row passes the same
    chi-square test against plain AR sampling of its own unpadded prompt (a batch draws its rows in another
    order than `generate` does, so rows are exact in distribution, not token for token)."""
    model, prompt, exact = tiny
    other = torch.tensor([[3, 0, 1]])
    exact_other = sequence_distribution(model, other, NEW_TOKENS, **WARPERS)
    batch = torch.tensor([[0, 1, 2], [3, 0, 1]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    drafter = (
        AdversarialDrafter(VOCAB, None, seed=2)
        if drafter_kind == "adversarial"
        else random_block_drafter(model, seed=3, draft_vocab_size=3, block_size=4)
    )
    gen = torch.Generator().manual_seed(99)
    counts, drafted = [Counter(), Counter()], 0
    for _ in range(SAMPLES):
        out, stats = hybrid.generate(
            model,
            batch,
            attention_mask=mask,
            drafter=drafter,
            do_sample=True,
            max_new_tokens=NEW_TOKENS,
            generator=gen,
            return_stats=True,
            scheduler=FixedScheduler(drafter.node_budget),  # drafts every step (the default may skip a poor drafter)
            **WARPERS,
        )
        for r in range(2):
            counts[r][tuple(out[r, batch.shape[1] :].tolist())] += 1
        drafted += sum(stats.drafted)
    assert drafted > 0
    for row_counts, row_exact in zip(counts, (exact, exact_other)):
        stat, df = chi_square_statistic(row_counts, row_exact)
        assert stat < chi_square_critical(df, ALPHA), (stat, df)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_sampled_output_equals_model_generate_with_the_same_seed(data):
    """After the same `torch.manual_seed`, sampled `hybrid.generate` equals `model.generate` token for token, for
    every verifier, drafter (lying and adversarial ones included) and scheduler, up to a boundary draw."""
    model = data.draw(verifiers(), label="verifier")
    vocab = model.config.vocab_size
    input_ids = data.draw(prompts(vocab), label="prompt")
    drafter = data.draw(drafters_for(model, None), label="drafter")
    scheduler = data.draw(schedulers_for(drafter), label="scheduler")
    warpers = data.draw(
        st.sampled_from([{}, {"top_k": 5}, {"top_p": 0.9}, {"top_k": 8, "top_p": 0.8}]), label="warpers"
    )
    kwargs = {
        "max_new_tokens": data.draw(st.integers(1, 30), label="max_new_tokens"),
        "temperature": data.draw(st.sampled_from([0.7, 1.0]), label="temperature"),
        **warpers,
    }
    if (
        check_sampled_identical(
            model, input_ids, drafter, data.draw(st.integers(0, 2**31), label="seed"), scheduler, **kwargs
        )
        is not None
    ):
        event("boundary-draw exception used")


def test_the_sampled_check_finds_a_draw_its_distribution_does_not_explain(monkeypatch):
    """A hybrid whose draws run one variate behind `generate`'s diverges where the two distributions agree to the
    last bits: replaying `generate`'s draw, the check finds that hybrid's own distribution gives another token."""
    model = tiny_model("llama", 64, 2, seed=0)
    real = acceptance.sample

    def late(probs, generator):
        torch.rand((), generator=generator)  # a variate `generate` does not draw
        return real(probs, generator)

    monkeypatch.setattr(acceptance, "sample", late)
    ids = torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2]])
    with pytest.raises(AssertionError, match="not a boundary draw"):
        check_sampled_identical(model, ids, PromptLookupDrafter(), 0, max_new_tokens=20, temperature=1.0)
