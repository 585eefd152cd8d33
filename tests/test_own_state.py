"""Models whose recurrent state lives in a structure of their own (RWKV's `state` list, xLSTM's `xLSTMCache`), served
by snapshot and replay (`verifiers.own_state`): `hybrid.generate` equals `model.generate` with drafts accepted at
every depth, batches are refused where `generate`'s rows are not the rows alone, and the state left behind is
`generate`'s."""

from __future__ import annotations

import pytest
import torch

import hybrid
from drafters import Draft, Drafter, ModelDrafter, PromptLookupDrafter
from hybrid.testing import (
    ARCHITECTURES,
    AdversarialDrafter,
    check_batch_greedy_lossless,
    check_cache_matches_prefill,
    check_greedy_lossless,
    check_sampled_identical,
    tiny_model,
)
from schedulers import FixedScheduler
from verifiers import cost_table, probes, support
from verifiers.own_state import OwnStates, state_format
from verifiers.verifier import Verifier

OWN_STATE = ("rwkv", "xlstm")
VOCAB = 64
NEW = 30


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny models run fastest on one thread, and the suite shares the machine."""


def prompt(seed: int, length: int = 7) -> torch.Tensor:
    return torch.randint(1, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


class CorruptedOracle(Drafter):
    """Proposes the reference continuation with one token changed at a depth drawn anew each step (or none), so a
    verify keeps a prefix of every length: the snapshot is replayed over 1, 2, ... tokens, or kept whole."""

    max_draft_len = 8

    def __init__(self, reference: torch.Tensor, seed: int):
        self.reference = reference.reshape(-1)
        self.rng = torch.Generator().manual_seed(seed)

    def propose(self, ctx, max_tokens: int) -> Draft:
        committed = ctx.input_ids[0]
        n = committed.shape[0]
        if not torch.equal(committed, self.reference[:n]):
            return Draft.empty(committed.device)
        tokens = self.reference[n : n + max_tokens].clone()
        depth = int(torch.randint(0, tokens.shape[0] + 1, (), generator=self.rng))
        if depth < tokens.shape[0]:
            tokens[depth] = (tokens[depth] + 1) % VOCAB
        return Draft(tokens)


def reference(model, ids: torch.Tensor) -> torch.Tensor:
    return model.generate(ids, max_new_tokens=NEW, do_sample=False)


@pytest.mark.parametrize("arch", OWN_STATE)
def test_greedy_with_drafts_accepted_at_every_depth(arch, monkeypatch):
    model = tiny_model(arch, VOCAB, 1, seed=0)
    replayed = []  # the token count of each replay
    real = OwnStates._replayed

    def counted(self, input_ids, state):
        replayed.append(input_ids.shape[1])
        return real(self, input_ids, state)

    monkeypatch.setattr(OwnStates, "_replayed", counted)
    for seed in range(3):
        ids = prompt(seed)
        drafter = CorruptedOracle(reference(model, ids), seed)
        report = check_greedy_lossless(model, ids, drafter, scheduler=FixedScheduler(6), max_new_tokens=NEW)
        assert report.near_tie_at is None
    assert len(set(replayed)) >= 3, f"replays of too few lengths: {sorted(set(replayed))}"


@pytest.mark.parametrize("arch", OWN_STATE)
def test_greedy_with_adversarial_and_prompt_lookup_drafts(arch):
    model = tiny_model(arch, VOCAB, 1, seed=1)
    for seed in range(3):
        ids = prompt(seed)
        check_greedy_lossless(
            model, ids, AdversarialDrafter(VOCAB, None, seed), scheduler=FixedScheduler(6), max_new_tokens=NEW
        )
    repetitive = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    check_greedy_lossless(model, repetitive, PromptLookupDrafter(), scheduler=FixedScheduler(6), max_new_tokens=NEW)


@pytest.mark.parametrize("arch", OWN_STATE)
def test_greedy_without_drafter_is_generates_steps(arch):
    model = tiny_model(arch, VOCAB, 2, seed=2)
    ids = prompt(5)
    out = hybrid.generate(model, ids, drafter=None, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(out, reference(model, ids))  # one token a forward: generate's own steps, bit for bit


@pytest.mark.parametrize("arch", OWN_STATE)
def test_seeded_sampling_equals_generate(arch):
    model = tiny_model(arch, VOCAB, 1, seed=3)
    ids = prompt(7)
    oracle = CorruptedOracle(reference(model, ids), 0)
    check_sampled_identical(model, ids, None, 0, max_new_tokens=NEW)
    for seed, drafter in enumerate((AdversarialDrafter(VOCAB, None, 1), oracle, PromptLookupDrafter()), start=1):
        check_sampled_identical(model, ids, drafter, seed, scheduler=FixedScheduler(6), max_new_tokens=NEW)


@pytest.mark.parametrize("arch", OWN_STATE)
def test_model_drafter_with_its_own_state(arch):
    """As a drafter its state records across its one-token forwards and is replayed after a rollback: the verifier
    drafting for itself has every draft accepted, and another seed's model is lossless."""
    model = tiny_model(arch, VOCAB, 1, seed=4)
    ids = prompt(9)
    report = check_greedy_lossless(model, ids, ModelDrafter(model), scheduler=FixedScheduler(4), max_new_tokens=NEW)
    if report.near_tie_at is None:
        assert report.stats.accepted[1:-1] == report.stats.drafted[1:-1], report.stats.accepted
    other = ModelDrafter(tiny_model(arch, VOCAB, 1, seed=5))
    check_greedy_lossless(model, ids, other, scheduler=FixedScheduler(4), max_new_tokens=NEW)


def left_padded_batch():
    rows = [prompt(seed, length) for seed, length in ((11, 4), (12, 7), (13, 5))]
    width = max(row.shape[1] for row in rows)
    ids = torch.cat([torch.cat([row.new_zeros(1, width - row.shape[1]), row], 1) for row in rows])
    mask = (torch.arange(width) >= width - torch.tensor([[row.shape[1]] for row in rows])).long()
    return ids, mask


@pytest.mark.parametrize("arch", OWN_STATE)
def test_left_padded_batch_is_refused_as_generate_folds_padding_into_the_state(arch):
    """Neither model reads the attention mask: `generate` folds a row's padding into its state, so its padded rows
    are not the rows alone, which the padding probe finds."""
    model = tiny_model(arch, VOCAB, 1, seed=6)
    ids, mask = left_padded_batch()
    alone = model.generate(ids[:1, 3:], max_new_tokens=8, do_sample=False)[0, 4:]
    padded = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)[0, 7:]
    assert not torch.equal(alone, padded)
    for drafter in (None, PromptLookupDrafter()):
        with pytest.raises(ValueError, match=r"masks tokens of row 0.*depends on its padding"):
            hybrid.generate(model, ids, attention_mask=mask, drafter=drafter, max_new_tokens=8, pad_token_id=0)


def test_rwkv_batch_is_refused_as_generate_mixes_its_rows():
    """transformers' RWKV one-token step mixes the rows of a batch, so `generate`'s rows are not the rows alone even
    without padding: refused by the batching probe."""
    model = tiny_model("rwkv", VOCAB, 1, seed=7)
    ids = torch.cat([prompt(seed) for seed in range(3)])
    batch = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert not torch.equal(batch[1], model.generate(ids[1:2], max_new_tokens=8, do_sample=False)[0])
    with pytest.raises(ValueError, match=r"depends on the other rows.*Pass one prompt per call"):
        hybrid.generate(model, ids, drafter=PromptLookupDrafter(), max_new_tokens=8, do_sample=False)


def test_xlstm_batch_of_one_length_is_served():
    """Rows stop at their EOS at different steps: the finished ones leave the state."""
    model = tiny_model("xlstm", VOCAB, 1, seed=8)
    ids = torch.cat([prompt(seed) for seed in range(3)])
    assert not probes.batching_changes_outputs(model)
    eos = int(reference(model, ids[:1])[0, ids.shape[1] + 8])
    stops = {"eos_token_id": eos, "pad_token_id": 0}
    check_batch_greedy_lossless(model, ids, None, max_new_tokens=NEW, **stops)
    for drafter in (AdversarialDrafter(VOCAB, None, 2), PromptLookupDrafter()):
        check_batch_greedy_lossless(model, ids, drafter, scheduler=FixedScheduler(6), max_new_tokens=NEW, **stops)


def test_rows_of_different_lengths_keep_different_prefixes():
    """Prompts of different lengths are prefilled apart and joined; each verify keeps another prefix per row (rows of
    one kept count replayed together) and a row selection keeps the rows' own states (xLSTM: its batches are
    `generate`'s rows alone)."""
    model = tiny_model("xlstm", VOCAB, 1, seed=13)
    verifier = Verifier(model, max_width=6)
    sequences = [prompt(seed, length=24)[0] for seed in range(3)]
    with torch.inference_mode():
        verifier.prefill_rows([seq[:n] for seq, n in zip(sequences, (3, 6, 4))], capacity=40)
        for kept in ([1, 4, 2], [5, 5, 3], [2, 1, 5], [3, 3, 0]):
            fed = torch.stack([seq[verifier.length(b) :][:5] for b, seq in enumerate(sequences)])
            verifier.verify_rows(fed)
            verifier.keep_accepted([list(range(k)) for k in kept])
        verifier.select_rows([2, 0])
        for b, row in enumerate((2, 0)):
            fresh = model(sequences[row][None, : verifier.length(b)], use_cache=True)
            assert_states_close(model, verifier.generate_cache(b), fresh.cache)


def assert_states_close(model, mine, theirs, atol: float = 1e-4) -> None:
    tensors = state_format(model).tensors
    for a, b in zip(tensors(mine), tensors(theirs), strict=True):
        assert a.shape == b.shape
        # RWKV's running maximum starts at -1e38: compared where a token has set it
        finite = b.abs() < 1e30
        assert torch.allclose(a[finite], b[finite], atol=atol, rtol=1e-4), float((a - b)[finite].abs().max())


@pytest.mark.parametrize("arch", OWN_STATE)
def test_returned_cache_is_generates_state(arch):
    """`out.cache` is what `generate` returns there: the state list (RWKV) or the xLSTMCache, after every token but
    the last, equal up to the rounding of a wider forward."""
    model = tiny_model(arch, VOCAB, 1, seed=9)
    ids = prompt(3)
    settings = dict(max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True)
    expected = model.generate(ids, **settings)
    drafter = CorruptedOracle(expected.sequences, 1)
    out = hybrid.generate(model, ids, drafter=drafter, scheduler=FixedScheduler(6), **settings)
    assert torch.equal(out.sequences, expected.sequences)
    assert type(out.cache) is type(expected.cache)
    assert_states_close(model, out.cache, expected.cache)
    check_cache_matches_prefill(model, out.sequences, out.cache, prompt_length=ids.shape[1])
    if arch == "xlstm":
        assert int(out.cache.seqlen_offset) == int(expected.cache.seqlen_offset) == out.sequences.shape[1] - 1


@pytest.mark.parametrize("arch", OWN_STATE)
def test_verifier_keeps_any_prefix_and_its_hidden_states(arch):
    """Verify, keep a prefix, verify again: each row's state and kept hidden states are a fresh forward's."""
    model = tiny_model(arch, VOCAB, 2, seed=10)
    verifier = Verifier(model, hidden_layers=(0, -1), max_width=6)
    sequence = prompt(4, length=20)[0]
    with torch.inference_mode():
        verifier.prefill_rows([sequence[:5]], capacity=32)
        for fed, kept in ((6, 2), (4, 4), (5, 1), (3, 0)):
            start = verifier.length()
            logits = verifier.verify(sequence[None, start : start + fed])
            verifier.keep_accepted([list(range(kept))])
        length = verifier.length()
        fresh = model(sequence[None, :length], use_cache=True, output_hidden_states=True)
        kept_hidden = torch.cat([fresh.hidden_states[0], fresh.hidden_states[-1]], -1)
        assert torch.allclose(verifier.hidden_states(), kept_hidden, atol=1e-4)
        assert_states_close(model, verifier.generate_cache(), state_format(model).returned(fresh))
        # the next step's scores continue the kept prefix
        logits = verifier.verify(sequence[None, length : length + 1])
        alone = model(sequence[None, : length + 1]).logits[0, -1]
        assert torch.allclose(logits[0], alone, atol=1e-4)


@pytest.mark.parametrize("arch", OWN_STATE)
def test_probes_and_cost_measurement_feed_the_models_own_state(arch):
    model = tiny_model(arch, VOCAB, 1, seed=11)
    assert support.cache_feed_refusal(model, several=True) is None
    with torch.inference_mode():
        assert not probes._width_changes_scores(model)
    costs = cost_table.measure_verify_costs(model, sizes=(1, 2, 5), repeats=1)
    assert all(0 < seconds < float("inf") for seconds in costs["torch"].values())


@pytest.mark.parametrize("arch", OWN_STATE)
def test_static_path_is_refused(arch):
    model = tiny_model(arch, VOCAB, 1, seed=12)
    with pytest.raises(ValueError, match=r"structure of its own.*Drop cache_implementation"):
        hybrid.generate(
            model, prompt(0), drafter=PromptLookupDrafter(), max_new_tokens=5, cache_implementation="static"
        )


def test_rwkv_is_drawn_by_the_property_strategies():
    assert "rwkv" in ARCHITECTURES
