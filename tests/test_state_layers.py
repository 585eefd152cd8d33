"""Verifiers with recurrent, linear-attention and convolution state (Qwen3.5's Gated DeltaNet, Mamba, Jamba,
Falcon-H1): a verify records the state after each fed token and keeps the accepted prefix's, so decoding with drafts
equals `generate` at every acceptance depth (verifiers/state_layers.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import CompileConfig, DynamicCache

import hybrid
from drafters import Draft, Drafter, ModelDrafter, PromptLookupDrafter
from hybrid.testing import (
    STATE_ARCHITECTURES,
    check_batch_greedy_lossless,
    check_cache_matches_prefill,
    check_greedy_lossless,
    check_sampled_identical,
    tiny_model,
)
from schedulers import FixedScheduler
from verifiers.memory import bytes_per_row, state_bytes
from verifiers.verifier import Verifier

CACHE_API_STATES = ("qwen3_5", "qwen3_next", "jamba", "falcon_h1", "mamba2", "mamba")
VOCAB = 64


class ScriptedDrafter(Drafter):
    """Proposes `sequence`'s continuation with the token at depth `depths[step]` changed, so that step after step
    the verify accepts exactly 0, 1, ... of its drafts (a depth past the draft: all of them)."""

    max_draft_len = 6

    def __init__(self, sequence: torch.Tensor, depths: list[int]):
        self.sequence, self.depths, self.step = sequence.reshape(-1), depths, 0

    def propose(self, ctx, max_tokens: int) -> Draft:
        n = ctx.input_ids.shape[1]
        tokens = self.sequence[n : n + max_tokens].clone()
        depth = self.depths[self.step % len(self.depths)]
        self.step += 1
        if depth < len(tokens):
            tokens[depth] = (tokens[depth] + 1) % VOCAB
        return Draft(tokens)


@pytest.fixture(autouse=True)
def quiet():
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # the reference kernels' notes that faster packages exist
    yield
    transformers.logging.set_verbosity(verbosity)


def test_a_recorded_verify_scores_as_one_token_steps_and_keeps_each_state():
    """The fact the rollback rests on: with recording, each state after a fed token is the one-token step's."""
    model = tiny_model("qwen3_5", VOCAB, 1, seed=0)
    tokens = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(tokens[:, :8], cache=cache, use_cache=True)
        stepped, states = copy.deepcopy(cache), []
        steps = []
        for i in range(8, 12):
            steps.append(model(tokens[:, i : i + 1], cache=stepped, use_cache=True).logits[0, -1])
            states.append(stepped.layers[0].recurrent_states[0].clone())
        recorded = copy.deepcopy(cache)
        recorded.activate_past_recording(recurrent_states_to_keep=4)
        together = model(tokens[:, 8:12], cache=recorded, use_cache=True).logits[0]
    assert (together - torch.stack(steps)).abs().max() < 1e-4
    history = recorded.layers[0].recurrent_states_history[0][1:] + [recorded.layers[0].recurrent_states[0]]
    for mine, theirs in zip(history, states):
        assert (mine - theirs).abs().max() < 1e-5


@pytest.mark.parametrize("arch", CACHE_API_STATES)
@pytest.mark.parametrize("cache_implementation", [None, "static"])
def test_every_acceptance_depth_rolls_back_to_generate(arch, cache_implementation, one_thread):
    model = tiny_model(arch, VOCAB, 1, seed=1)
    prompt = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(1))
    reference = model.generate(prompt, max_new_tokens=40, do_sample=False)
    drafter = ScriptedDrafter(reference, depths=[0, 1, 2, 3, 4, 5, 6])
    report = check_greedy_lossless(
        model,
        prompt,
        drafter,
        scheduler=FixedScheduler(6),
        max_new_tokens=40,
        hybrid_kwargs={"cache_implementation": cache_implementation},
    )
    assert report.stats.tau > 2  # drafts were accepted at many depths, not just rejected


@pytest.mark.parametrize("arch", ["qwen3_5", "jamba", "mamba2"])
def test_a_left_padded_batch_equals_generate_row_by_row(arch, one_thread):
    """Rows of different lengths are prefilled apart (no padding folded into a state) and accept apart."""
    model = tiny_model(arch, VOCAB, 1, seed=2)
    rows = torch.randint(1, VOCAB, (3, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(rows)
    mask[0, :4], mask[2, :2] = 0, 0
    rows[mask == 0] = 0
    check_batch_greedy_lossless(
        model, rows, PromptLookupDrafter(), attention_mask=mask, max_new_tokens=24, pad_token_id=0
    )


@pytest.mark.parametrize("arch", ["qwen3_5", "falcon_h1"])
def test_seeded_sampling_equals_generate(arch, one_thread):
    model = tiny_model(arch, VOCAB, 1, seed=3)
    prompt = torch.tensor([[5, 6, 7, 5, 6, 7, 5]])
    check_sampled_identical(model, prompt, PromptLookupDrafter(), 0, max_new_tokens=24)


def test_a_model_with_state_layers_drafts_for_another(one_thread):
    """A drafter's cache rolls back past its one-token forwards: its states record across them."""
    verifier = tiny_model("llama", VOCAB, 2, seed=4)
    drafter_model = tiny_model("qwen3_5", VOCAB, 1, seed=4)
    prompt = torch.tensor([[3, 4, 5, 6, 7, 8]])
    check_greedy_lossless(verifier, prompt, ModelDrafter(drafter_model, max_draft_len=5), max_new_tokens=30)
    check_greedy_lossless(drafter_model, prompt, ModelDrafter(drafter_model, max_draft_len=5), max_new_tokens=30)


def test_the_returned_cache_holds_the_states_and_decoding_continues_from_it(one_thread):
    model = tiny_model("qwen3_5", VOCAB, 1, seed=5)
    prompt = torch.tensor([[9, 8, 7, 9, 8, 7, 9]])
    out = hybrid.generate(
        model, prompt, drafter=PromptLookupDrafter(), max_new_tokens=12, do_sample=False, return_dict_in_generate=True
    )
    check_cache_matches_prefill(model, out.sequences, out.cache, prompt_length=prompt.shape[1])
    onward = model.generate(out.sequences, cache=out.cache, max_new_tokens=6, do_sample=False)
    assert torch.equal(onward, model.generate(prompt, max_new_tokens=18, do_sample=False))


def test_a_masked_token_inside_a_prompt_is_refused_by_name():
    """`generate` folds a masked token into the state as a zero input; hybrid's cache leaves it out."""
    model = tiny_model("qwen3_5", VOCAB, 1, seed=6)
    prompt = torch.tensor([[3, 4, 5, 6]])
    mask = torch.tensor([[1, 0, 1, 1]])
    with pytest.raises(ValueError, match=r"keeps recurrent state, into which model.generate folds a masked token"):
        hybrid.generate(model, prompt, attention_mask=mask, drafter=PromptLookupDrafter(), max_new_tokens=4)


def test_token_trees_are_verified_as_chains():
    verifier = Verifier(tiny_model("qwen3_5", VOCAB, 1, seed=7), max_width=4)
    assert not verifier.takes_trees


def test_a_compiled_static_step_is_refused_by_name():
    with pytest.raises(ValueError, match=r"CUDA graph would not own.*disable_compile=True"):
        Verifier(tiny_model("qwen3_5", VOCAB, 1, seed=8), static=True, max_width=4, compile_config=CompileConfig())


def test_the_memory_check_counts_the_states_a_verify_records():
    model = tiny_model("qwen3_5", VOCAB, 1, seed=9)
    live, per_token = state_bytes(model)
    assert live > 0 and per_token > 0
    assert bytes_per_row(model, 100, verify_width=9) - bytes_per_row(model, 100) == 9 * per_token
    assert state_bytes(tiny_model("llama", VOCAB, 1, seed=9)) == (0, 0)


@pytest.mark.parametrize("kind", ["zamba", "recurrent_gemma"])
def test_a_model_whose_multi_token_forward_restarts_its_recurrence_verifies_no_drafts(kind):
    from experiments.architectures import tiny_from_defaults

    model = tiny_from_defaults(kind)
    with pytest.raises(ValueError, match=r"cannot verify drafted tokens.*Pass drafter=None"):
        hybrid.generate(model, torch.tensor([[3, 4, 5]]), drafter=PromptLookupDrafter(), max_new_tokens=4)


def test_the_tiny_configs_hold_the_layers_they_test():
    assert set(CACHE_API_STATES) <= set(STATE_ARCHITECTURES)


def test_eos_stop_strings_streamer_and_the_returned_dict_follow_generate(one_thread):
    """The call paths besides the tokens: an EOS inside an accepted draft, a stop string, the streamer's tokens and
    return_dict_in_generate's scores, on a Qwen3.5 verifier drafting itself."""
    from transformers.generation.streamers import BaseStreamer

    from hybrid.testing import byte_tokenizer

    class Recorder(BaseStreamer):
        def __init__(self):
            self.tokens = []

        def put(self, value):
            self.tokens.append(value.reshape(-1).tolist())

        def end(self):
            pass

    tokenizer = byte_tokenizer(chat_template=False)
    model = tiny_model("qwen3_5", len(tokenizer), 1, seed=10)
    prompt = torch.tensor([[104, 101, 108, 108, 111, 32, 104, 101]])
    reference = model.generate(prompt, max_new_tokens=30, do_sample=False)
    eos = int(reference[0, prompt.shape[1] + 9])  # a token the greedy text reaches, so the call stops there
    drafter = ScriptedDrafter(reference, depths=[7, 2, 7])
    settings = dict(max_new_tokens=30, do_sample=False, eos_token_id=eos, pad_token_id=0)
    check_greedy_lossless(model, prompt, drafter, scheduler=FixedScheduler(6), **settings)
    stop = tokenizer.decode(reference[0, prompt.shape[1] + 4 : prompt.shape[1] + 6])
    expected = model.generate(prompt, stop_strings=stop, tokenizer=tokenizer, max_new_tokens=30, do_sample=False)
    got = hybrid.generate(
        model,
        prompt,
        drafter=ScriptedDrafter(reference, [7]),
        stop_strings=stop,
        tokenizer=tokenizer,
        max_new_tokens=30,
        do_sample=False,
    )
    assert torch.equal(got, expected)
    plain, mine = Recorder(), Recorder()
    model.generate(prompt, max_new_tokens=20, do_sample=False, streamer=plain)
    out = hybrid.generate(
        model,
        prompt,
        drafter=ScriptedDrafter(reference, [7]),
        scheduler=FixedScheduler(6),
        max_new_tokens=20,
        do_sample=False,
        streamer=mine,
        return_dict_in_generate=True,
        output_scores=True,
    )
    assert sum(mine.tokens[1:], []) == sum(plain.tokens[1:], []) == out.sequences[0, prompt.shape[1] :].tolist()
    assert len(out.scores) == 20
