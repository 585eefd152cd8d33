"""The online store and `hybrid.drafter_for`: the store finds the longest earlier match of the context among the
verifier's committed tokens, holds at most its cap (oldest evicted), drafts a repeated request's earlier answer, is
keyed to one verifier, and greedy decoding with it is still `model.generate`'s; `drafter_for` builds the lookup for
any verifier and adds a trained folder only when it was trained for that verifier."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import random_block_drafter, tiny_model

import hybrid
from drafters import BlockDiffusionDrafter, ChainDrafter, DFlashDrafter, PromptLookupDrafter
from drafters.block_diffusion import save_model, verifier_fingerprint
from drafters.online_store import OnlineStore, OnlineStores
from hybrid.custom_generate import generate as glue_generate
from hybrid.custom_generate.generate import _STORES, SERVED_DEFAULTS, SERVED_REQUEST
from hybrid.testing import check_greedy_lossless
from schedulers import FixedScheduler, Scheduler

VOCAB = 48


def feed(store: OnlineStore, prompt: list[int], answer: list[int], steps: int = 3) -> None:
    """Record one sequence as the lookup drafter does: its prompt and first token, then the rest in a few steps."""
    sequence, ids = store.new_sequence(), prompt + answer
    done = len(prompt)
    for end in sorted({len(prompt) + 1, *range(len(prompt) + 1, len(ids) + 1, max(1, len(answer) // steps))}):
        store.add(sequence, ids[:end], done, len(prompt))
        done = end
    store.add(sequence, ids, done, len(prompt))


def brute_force(sequences: list[tuple[list[int], list[int]]], context: list[int], max_match: int, max_tokens: int):
    """The definition: of every position p of an earlier sequence (prompt tail + answer) followed by an answer token,
    the longest match (>= 2) of its tokens ending at p with the context's end, the most recent among equals; then the
    answer tokens after it."""
    best, best_n = [], 1
    for prompt, answer in sequences:
        ids, start = prompt[-max_match:] + answer, len(prompt[-max_match:])
        for p in range(len(ids) - 1):
            if p + 1 < start:
                continue
            n = 0
            while n < min(max_match, p + 1, len(context)) and ids[p - n] == context[-1 - n]:
                n += 1
            if n >= best_n and n >= 2:
                best, best_n = ids[p + 1 : p + 1 + max_tokens], n
    return (best, best_n) if best else ([], 0)


sequences = st.lists(
    st.tuples(
        st.lists(st.integers(0, 4), min_size=1, max_size=8), st.lists(st.integers(0, 4), min_size=1, max_size=20)
    ),
    min_size=1,
    max_size=5,
)  # a small alphabet: matches repeat, ties happen


@settings(max_examples=200, deadline=None)
@given(sequences, st.lists(st.integers(0, 4), min_size=2, max_size=12), st.integers(1, 8))
def test_a_lookup_copies_what_followed_the_longest_most_recent_match(seqs, context, max_tokens):
    store = OnlineStore(max_tokens=4096, max_match=6, max_chain=10_000)
    for prompt, answer in seqs:
        feed(store, prompt, answer)
    assert store.lookup(context, max_tokens) == brute_force(seqs, context, 6, max_tokens)


def test_prompt_tokens_are_matched_but_never_drafted():
    store = OnlineStore(max_tokens=256, max_match=8)
    feed(store, [1, 2, 3, 4, 5], [6, 7])
    assert store.lookup([9, 3, 4], 5) == ([], 0)  # 5 follows, but it is the prompt's
    assert store.lookup([9, 4, 5], 5) == ([6, 7], 2)


def test_memory_is_bounded_and_the_oldest_is_evicted_first():
    store = OnlineStore(max_tokens=200, max_match=4)
    nbytes = store.nbytes
    first = ([40, 41, 42], [43, 44, 45, 46])
    feed(store, *first)
    assert store.lookup([41, 42], 4) == ([43, 44, 45, 46], 2)
    for i in range(50):  # 50 sequences of ~30 tokens: seven times the cap
        feed(store, [1, 2], [(7 * i + j) % 39 for j in range(25)])
        assert store.num_tokens <= 200 and store.nbytes == nbytes
    assert store.num_tokens == 200 and store.sequences == 51
    assert store.lookup([41, 42], 4) == ([], 0)  # the first sequence is gone
    last = [(7 * 49 + j) % 39 for j in range(25)]
    assert store.lookup(last[:3], 4) == (last[3:7], 3)  # the newest is there
    assert "200/200 tokens, 51 sequences" in store.summary()


def test_bad_settings_name_the_fix():
    with pytest.raises(ValueError, match="max_tokens=10 cannot hold.*give at least 66"):
        OnlineStore(max_tokens=10)
    with pytest.raises(TypeError, match="online_store must be a drafters.online_store.OnlineStore"):
        PromptLookupDrafter(online_store="yes")


def test_a_store_filled_by_one_verifier_never_drafts_for_another():
    model, other = tiny_model("llama", VOCAB, 2, seed=1), tiny_model("llama", VOCAB, 2, seed=2)
    store = OnlineStore(max_tokens=1024)
    drafter = PromptLookupDrafter(online_store=store)
    prompt = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(0))
    hybrid.generate(model, prompt, drafter=drafter, max_new_tokens=8, do_sample=False)  # binds the store to `model`
    with pytest.raises(
        ValueError, match=r"online store holds another verifier's outputs \(embedding_sha256 .*OnlineStore"
    ):
        hybrid.generate(other, prompt, drafter=drafter, max_new_tokens=8, do_sample=False)
    with pytest.raises(ValueError, match=r"online store holds another verifier's outputs"):
        PromptLookupDrafter(online_store=store, verifier=other)


def fine_tuned(model, seed: int):
    """A copy of `model` with every weight but the input embedding moved a little, as a fine-tune or a merged LoRA
    moves them: its architecture, sizes and embedding are the original's."""
    other = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            if p is not other.get_input_embeddings().weight:
                p.add_(0.01 * torch.randn(p.shape, generator=generator))
    return other


def test_a_fine_tune_sharing_the_embedding_is_refused_by_name():
    model = tiny_model("llama", VOCAB, 2, seed=1)
    other = fine_tuned(model, seed=2)
    assert verifier_fingerprint(other) == verifier_fingerprint(model)  # what the store was keyed by before
    drafter = hybrid.drafter_for(model)
    prompt = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(0))
    hybrid.generate(model, prompt, drafter=drafter, max_new_tokens=8, do_sample=False)
    with pytest.raises(
        ValueError, match=r"online store holds another verifier's outputs \(weights_sha256 .*OnlineStore"
    ):
        hybrid.generate(other, prompt, drafter=drafter, max_new_tokens=8, do_sample=False)
    hybrid.generate(copy.deepcopy(model), prompt, drafter=drafter, max_new_tokens=8, do_sample=False)  # a twin is fine


@pytest.mark.parametrize("change", ["in place", "through .data", "a parameter replaced"])
def test_weights_changed_in_place_empty_the_store_and_it_learns_the_new_answers(change):
    """The same model object may change its weights between calls (hybrid.generate allows it): the store's earlier
    answers are no longer this model's, so it forgets them, and the next call fills it with the new model's."""
    model = tiny_model("llama", VOCAB, 2, seed=3)
    drafter = hybrid.drafter_for(model)
    store = drafter.online_store
    prompt = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(4))
    answer = hybrid.generate(model, prompt, drafter=drafter, max_new_tokens=30, do_sample=False)[0, 10:].tolist()
    hybrid.generate(model, prompt, drafter=drafter, max_new_tokens=30, do_sample=False)  # a call changes nothing
    assert store.sequences == 2 and store.lookup(prompt[0].tolist() + answer[:1], 16)[1] >= 11
    layer = model.model.layers[0].mlp.down_proj
    generator = torch.Generator().manual_seed(5)
    if change == "in place":
        with torch.no_grad():
            layer.weight.add_(torch.randn(layer.weight.shape, generator=generator))
    elif change == "through .data":  # bypasses autograd's version counter: the sampled elements see it
        layer.weight.data.add_(torch.randn(layer.weight.shape, generator=generator))
    else:
        layer.weight = torch.nn.Parameter(layer.weight + torch.randn(layer.weight.shape, generator=generator))
    report = check_greedy_lossless(model, prompt, drafter, FixedScheduler(16), max_new_tokens=30)
    assert store.sequences == 1  # emptied before this call, which it then recorded
    new = report.output[0, 10:].tolist()
    assert new != answer and store.lookup(prompt[0].tolist() + new[:1], 16)[0] == new[1:17]


# Qwen3.5 and Jamba: verifiers whose linear-attention or Mamba layers keep state that every rejected draft rolls back.
@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen3_5", "jamba"])
def test_a_repeated_request_drafts_the_earlier_answer_and_stays_lossless(arch, one_thread):
    model = tiny_model(arch, VOCAB, 2, seed=3)
    drafter = hybrid.drafter_for(model)
    assert isinstance(drafter, PromptLookupDrafter) and drafter.ngram_store is None
    prompt = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(4))
    first = check_greedy_lossless(model, prompt, drafter, max_new_tokens=40)
    answer = first.output[0, 10:].tolist()
    # The store drafts the answer's continuation from the prompt and its first token on.
    tokens, n = drafter.online_store.lookup(prompt[0].tolist() + answer[:1], 16)
    assert n >= 11 and tokens == answer[1:17]
    # Every step drafts: on a tiny verifier a lookup costs a fair share of a forward, and after a first call whose
    # drafts all failed the default scheduler explores it only now and then (test_schedulers covers that choice).
    again = check_greedy_lossless(model, prompt, drafter, FixedScheduler(16), max_new_tokens=40)
    assert again.stats.tau > 2 * first.stats.tau
    # A related request (the same prompt, asked for more) stays lossless too.
    check_greedy_lossless(model, prompt, drafter, max_new_tokens=60)


def test_the_store_records_the_steps_the_scheduler_did_not_draft_at():
    """The scheduler may skip drafting at any step (no stage pays): the store still gets the whole answer, from the
    drafter's `finish`, and the repeated request is drafted from it."""

    class NeverDrafts(Scheduler):
        def plan_step(self, steps_left):
            return dataclasses.replace(super().plan_step(steps_left), drafting_stages=0)

    model = tiny_model("llama", VOCAB, 2, seed=3)
    drafter = hybrid.drafter_for(model)
    prompt = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(4))
    first = hybrid.generate(model, prompt, drafter=drafter, scheduler=NeverDrafts(), max_new_tokens=40, do_sample=False)
    answer = first[0, 10:].tolist()
    tokens, n = drafter.online_store.lookup(prompt[0].tolist() + answer[:24], 16)
    assert n >= 11 and tokens == answer[24:40]


def test_rows_of_a_batch_each_record_their_own_sequence():
    model = tiny_model("llama", VOCAB, 2, seed=5)
    drafter = hybrid.drafter_for(model)
    prompts = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(prompts)
    mask[1, :3] = 0  # left padding
    out = hybrid.generate(model, prompts, attention_mask=mask, drafter=drafter, max_new_tokens=30, do_sample=False)
    assert drafter.online_store.sequences == 2
    for row in range(2):
        kept = prompts[row, mask[row].bool()][None]
        expected = model.generate(kept, max_new_tokens=30, do_sample=False)
        assert torch.equal(out[row, 9:], expected[0, kept.shape[1] :])
        report = check_greedy_lossless(model, kept, drafter, FixedScheduler(16), max_new_tokens=30)
        assert report.stats.tau > 2


def test_the_served_drafter_keeps_one_store_across_requests():
    model = tiny_model("llama", VOCAB, 2, seed=7)
    prompt = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(8))
    expected = model.generate(prompt, max_new_tokens=30, do_sample=False)
    taus = []
    for _ in range(2):
        # Every step drafts (see test_a_repeated_request_drafts_the_earlier_answer_and_stays_lossless).
        out, stats = glue_generate(
            prompt, model=model, max_new_tokens=30, do_sample=False, return_stats=True, scheduler=FixedScheduler(16)
        )
        assert torch.equal(out, expected)
        taus.append(stats.tau)
    from hybrid.custom_generate import cached_drafter

    assert cached_drafter(model, "default").online_store.sequences == 2
    assert taus[1] > 2 * taus[0]


def served_call(model, prompt, request=None, **kwargs):
    """A served call through the glue (HYBRID_SERVED=1 is set by the caller) with the request settings the server
    gives it; every step drafts (see test_a_repeated_request_drafts_the_earlier_answer_and_stays_lossless)."""
    if request is not None:
        kwargs[SERVED_REQUEST] = SERVED_DEFAULTS | request
    out, stats = glue_generate(
        prompt,
        model=model,
        max_new_tokens=30,
        do_sample=False,
        return_stats=True,
        scheduler=FixedScheduler(16),
        **kwargs,
    )
    return out, stats.tau


def test_a_served_request_drafts_only_from_its_own_clients_answers(monkeypatch, served_logger):
    """Served, a client's answers draft for that client alone: another client, a request without credentials and a
    request the server gave no settings (plain transformers serve) draft as if nobody had asked before."""
    from transformers import GenerationConfig

    monkeypatch.setenv("HYBRID_SERVED", "1")
    model = tiny_model("llama", VOCAB, 2, seed=12)
    prompt = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(13))
    expected = model.generate(prompt, max_new_tokens=30, do_sample=False)
    first, fresh = served_call(model, prompt, {"store": "alice"})
    again, repeat = served_call(model, prompt, {"store": "alice"})
    assert torch.equal(first, expected) and torch.equal(again, expected) and repeat > 2 * fresh
    config = GenerationConfig(max_new_tokens=30, do_sample=False)  # transformers < 5.25 carries them on the config
    setattr(config, SERVED_REQUEST, SERVED_DEFAULTS | {"store": "carol"})
    for others in ({"store": "bob"}, {"store": None}, None, {"generation_config": config}):
        kwargs = others if others is not None and "generation_config" in others else {}
        out, tau = served_call(model, prompt, others if not kwargs else None, **kwargs)
        assert torch.equal(out, expected) and tau == fresh, others
    assert getattr(config, SERVED_REQUEST)["store"] == "carol"  # the caller's config is left as it was


def test_client_stores_are_bounded_least_recently_used_first(monkeypatch, served_logger):
    monkeypatch.setenv("HYBRID_SERVED", "1")
    model = tiny_model("llama", VOCAB, 2, seed=14)
    prompt = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(15))
    bound = {"stores": 2, "store_tokens": 256}
    _, fresh = served_call(model, prompt, {"store": "a", **bound})
    for client in ("b", "a", "c"):  # c's store pushes out b's, the least recently used
        served_call(model, prompt, {"store": client, **bound})
    stores = _STORES[model]
    assert len(stores) == 2 and stores.get("a").sequences == 2 and stores.get("a").max_tokens == 256
    assert served_call(model, prompt, {"store": "b", **bound})[1] == fresh  # b starts over
    with pytest.raises(ValueError, match="max_stores=0: keep at least one store"):
        OnlineStores(0, 256)


def test_a_served_stream_is_sent_in_fixed_chunks_not_per_verify_step(monkeypatch, served_logger):
    """What a stream's chunks show is how many tokens each chunk holds: the prefill's one token, then a fixed number,
    whatever each verify step accepted (the last chunk holds the rest)."""

    class Recorder:
        def __init__(self):
            self.sizes = []

        def put(self, value):
            self.sizes.append(value.numel())

        def end(self):
            self.sizes.append("end")

    monkeypatch.setenv("HYBRID_SERVED", "1")
    model = tiny_model("llama", VOCAB, 2, seed=16)
    prompt = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(17))
    for request, chunk in (({"store": "a", "stream_chunk": 4}, 4), (None, SERVED_DEFAULTS["stream_chunk"])):
        for _ in range(2):  # the second call accepts long drafts from the store
            recorder = Recorder()
            out, tau = served_call(model, prompt, request, streamer=recorder)
            rest = [chunk] * (29 // chunk) + ([29 % chunk] if 29 % chunk else [])
            assert recorder.sizes == [10, 1] + rest + ["end"]
    recorder = Recorder()
    served_call(model, prompt, {"store": "a", "stream_chunk": 1}, streamer=recorder)  # the operator's choice
    assert sum(recorder.sizes[1:-1]) == 30 and max(recorder.sizes[1:-1]) > 1  # each step's tokens as they come


def test_drafter_for_adds_a_folder_trained_for_the_verifier_and_refuses_another_s(tmp_path):
    from test_dflash import write_dflash_folder

    model, other = tiny_model("llama", VOCAB, 2, seed=9), tiny_model("llama", VOCAB, 3, seed=10)
    save_model(random_block_drafter(model, seed=0).model, tmp_path / "block")
    write_dflash_folder(tmp_path / "dflash", model)
    for folder, kind in (("block", BlockDiffusionDrafter), ("dflash", DFlashDrafter)):
        drafter = hybrid.drafter_for(model, tmp_path / folder)
        assert isinstance(drafter, ChainDrafter) and isinstance(drafter.sources[-1], kind)
        assert drafter.sources[0].online_store is not None
        prompt = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(11))
        check_greedy_lossless(model, prompt, drafter, max_new_tokens=20)
    with pytest.raises(
        ValueError,
        match=r"block was trained for LlamaForCausalLM \(.*2 layers.*\), but the verifier given is LlamaForCausalLM \(.*3 layers",
    ):
        hybrid.drafter_for(other, tmp_path / "block")
    with pytest.raises(
        ValueError,
        match=r"dflash was trained for a verifier \(.*2 layers\), but the verifier given is a verifier \(.*3 layers\)",
    ):
        hybrid.drafter_for(other, tmp_path / "dflash")
    with pytest.raises(ValueError, match=r"holds neither drafter_config.json .* nor a config.json with dflash_config"):
        hybrid.drafter_for(model, tmp_path)


@pytest.fixture(scope="module")
def verifier_dir(tmp_path_factory):
    from experiments.models import load_tiny_model

    folder = tmp_path_factory.mktemp("verifier")
    for part in load_tiny_model():  # a byte tokenizer with a chat template
        part.save_pretrained(folder)
    return folder


def test_the_commands_take_a_verifier_folder_and_its_drafter_folder(verifier_dir, tmp_path, monkeypatch, capsys):
    from transformers import AutoModelForCausalLM

    from hybrid import cli
    from hybrid.export import GLUE
    from hybrid.serving import served_default

    model = AutoModelForCausalLM.from_pretrained(verifier_dir)
    save_model(random_block_drafter(model, seed=0).model, tmp_path / "block")
    save_model(random_block_drafter(tiny_model("llama", 256, 1, seed=1), seed=0).model, tmp_path / "foreign")
    argv = ["--verifier", str(verifier_dir), "--max-new-tokens", "12"]
    assert cli.main(["generate", "hi", *argv, "--drafter", str(tmp_path / "block")]) == 0
    assert "identical to model.generate: yes" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"foreign was trained for LlamaForCausalLM \(.*1 layers.*given is"):
        cli.main(["generate", "hi", *argv, "--drafter", str(tmp_path / "foreign")])
    with pytest.raises(SystemExit):  # neither a name nor a folder: argparse says so
        cli.main(["generate", "hi", *argv, "--drafter", str(tmp_path / "missing")])
    assert "is neither one of default, block, prompt-lookup, none nor a drafter folder" in capsys.readouterr().err
    out = tmp_path / "served"
    assert (
        cli.main(["export-served", str(out), "--verifier", str(verifier_dir), "--drafter", str(tmp_path / "block")])
        == 0
    )
    assert f"DRAFTER = {str(tmp_path / 'block')!r}" in (out / GLUE).read_text()
    monkeypatch.setenv("HYBRID_CACHE", str(tmp_path / "cache"))  # what `serve --verifier DIR --drafter DIR` serves
    folder = served_default(str(tmp_path / "block"), verifier_dir)
    assert folder.is_relative_to(tmp_path / "cache") and (folder / GLUE).read_text() == (out / GLUE).read_text()


def test_the_experiment_compares_lookup_with_and_without_the_store_on_related_requests(tmp_path):
    from experiments.online_store import main

    summary = main(
        ["--model", "tiny", "--num-prompts", "1", "--max-new-tokens", "12", "--scheduler", "fixed-16"]
        + ["--out", str(tmp_path / "s.json")]
    )
    assert summary["identical_to_generate"] and summary["requests"] == 3
    rows = summary["rows"]
    assert rows["lookup + online store / repeat"]["tau"] > rows["lookup / repeat"]["tau"]
    assert (tmp_path / "s.json").is_file()


@pytest.mark.slow
def test_the_embedded_verifier_gets_the_shipped_store_and_block_model_too():
    model, tokenizer, _ = hybrid.load_default()
    drafter = hybrid.drafter_for(model, tokenizer=tokenizer)
    lookup, block = drafter.sources
    assert lookup.ngram_store is not None and lookup.online_store is not None
    assert isinstance(block, BlockDiffusionDrafter)
