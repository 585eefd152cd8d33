"""`generate` arguments beyond the properties: each one means what it means to `model.generate`."""

from __future__ import annotations

import inspect

import pytest
import torch
from strategies import tiny_model
from transformers import (
    GenerationConfig,
    GenerationMixin,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.generation.streamers import BaseStreamer

import hybrid
from drafters import ModelDrafter, PromptLookupDrafter
from hybrid.testing import check_greedy_lossless
from schedulers import FixedScheduler

MODEL = tiny_model("llama", 64, 2, seed=4)
PROMPT = torch.tensor([[7, 3, 9, 7, 3, 9, 7]])


def test_max_length_counts_the_prompt():
    report = check_greedy_lossless(MODEL, PROMPT, PromptLookupDrafter(), max_length=20)
    assert report.output.shape[1] == 20


class BanEvenTokens(LogitsProcessor):
    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[:, ::2] = -float("inf")
        return scores


class StopAfterToken(StoppingCriteria):
    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_custom_logits_processor_and_stopping_criteria():
    plain = MODEL.generate(
        PROMPT, max_new_tokens=30, do_sample=False, logits_processor=LogitsProcessorList([BanEvenTokens()])
    )
    stop_token = int(plain[0, PROMPT.shape[1] + 5])  # a token the processed greedy run emits: stop there
    kwargs = {
        "max_new_tokens": 30,
        "logits_processor": LogitsProcessorList([BanEvenTokens()]),
        "stopping_criteria": StoppingCriteriaList([StopAfterToken(stop_token)]),
    }
    report = check_greedy_lossless(MODEL, PROMPT, ModelDrafter(MODEL), FixedScheduler(4), **kwargs)
    new = report.output[0, PROMPT.shape[1] :]
    assert (new % 2 == 1).all() and int(new[-1]) == stop_token and new.shape[0] <= 6


def test_generation_config_object():
    config = GenerationConfig(max_new_tokens=12, do_sample=False, repetition_penalty=1.5)
    expected = MODEL.generate(PROMPT, generation_config=config)
    assert torch.equal(
        hybrid.generate(MODEL, PROMPT, drafter=PromptLookupDrafter(), generation_config=config), expected
    )


def test_output_scores_and_logits_match_generate():
    kwargs = {
        "max_new_tokens": 15,
        "do_sample": False,
        "return_dict_in_generate": True,
        "output_scores": True,
        "output_logits": True,
        "repetition_penalty": 1.2,
    }
    ref = MODEL.generate(PROMPT, **kwargs)
    out = hybrid.generate(MODEL, PROMPT, drafter=ModelDrafter(MODEL), scheduler=FixedScheduler(5), **kwargs)
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.scores) == len(ref.scores) == len(out.logits) == 15
    for mine, theirs in zip(out.scores + out.logits, ref.scores + ref.logits):
        assert mine.shape == theirs.shape == (1, 64)
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)


class Recorder(BaseStreamer):
    def __init__(self):
        self.puts, self.ended = [], False

    def put(self, value):
        self.puts.append(value.reshape(-1).tolist())

    def end(self):
        self.ended = True


def test_streamer_sees_the_prompt_then_every_token_once():
    plain, mine = Recorder(), Recorder()
    MODEL.generate(PROMPT, max_new_tokens=25, do_sample=False, streamer=plain)
    hybrid.generate(
        MODEL, PROMPT, drafter=ModelDrafter(MODEL), scheduler=FixedScheduler(6), max_new_tokens=25, streamer=mine
    )
    assert mine.puts[0] == plain.puts[0] == PROMPT[0].tolist()
    assert sum(mine.puts[1:], []) == sum(plain.puts[1:], [])
    assert len(mine.puts) < len(plain.puts)  # blocks arrive several tokens at a time
    assert mine.ended and plain.ended


def test_top_p_sampling_only_emits_tokens_inside_the_nucleus():
    """With top_p the engine can only emit tokens the warped p keeps, whatever the drafter proposes."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        out = hybrid.generate(
            MODEL,
            PROMPT,
            drafter=ModelDrafter(tiny_model("qwen2", 64, 1, seed=9)),
            do_sample=True,
            top_p=0.3,
            top_k=0,
            max_new_tokens=8,
            generator=gen,
            return_dict_in_generate=True,
            output_scores=True,
        )
        for token, scores in zip(out.sequences[0, PROMPT.shape[1] :], out.scores):
            assert torch.isfinite(scores[0, token])  # warped-out tokens have score -inf


def _generate_defaults() -> dict:
    """Every parameter of `model.generate` at its default: what transformers' custom_generate path passes on."""
    parameters = inspect.signature(GenerationMixin.generate).parameters.values()
    return {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}


def test_every_generate_parameter_at_its_off_value_is_accepted():
    """An argument at its off value asks for nothing: hybrid accepts it and decodes as generate does."""
    defaults = _generate_defaults()
    assert {"inputs", "synced_gpus", "assistant_model", "negative_prompt_ids"} <= defaults.keys()
    expected = MODEL.generate(PROMPT, max_new_tokens=12, do_sample=False)
    off = {**defaults, "inputs": PROMPT, "custom_generate": None}
    out = hybrid.generate(MODEL, drafter=PromptLookupDrafter(), max_new_tokens=12, do_sample=False, **off)
    assert torch.equal(out, expected)
    extra_off = {"synced_gpus": False, "trust_remote_code": False, "past_key_values": None, "assistant_tokenizer": None}
    out = hybrid.generate(MODEL, PROMPT, drafter=PromptLookupDrafter(), inputs=None, max_new_tokens=12, **extra_off)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("count", [0, 1, 5])
def test_a_count_of_logits_to_keep_decodes_as_generate(count):
    """`generate` reads the last position's logits whatever count it keeps (0: all), so its tokens do not change."""
    check_greedy_lossless(MODEL, PROMPT, PromptLookupDrafter(), max_new_tokens=12, logits_to_keep=count)


def test_logits_to_keep_as_positions_is_refused():
    """Positions that leave out the last make `generate` read another position's logits: its tokens change."""
    positions, prompt = torch.tensor([0]), torch.tensor([[1, 2, 3, 4, 5, 6]])
    expected = MODEL.generate(prompt, max_new_tokens=4, do_sample=False)
    assert not torch.equal(
        MODEL.generate(prompt, max_new_tokens=4, do_sample=False, logits_to_keep=positions), expected
    )
    with pytest.raises(
        TypeError, match=r"logits_to_keep=tensor\(\[0\]\): hybrid takes a count .* pass a count or drop"
    ):
        hybrid.generate(MODEL, prompt, drafter=None, max_new_tokens=4, do_sample=False, logits_to_keep=positions)


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("synced_gpus", True, r"does not support argument\(s\) \['synced_gpus'\]"),
        ("negative_prompt_ids", torch.tensor([[1, 2]]), r"does not support argument\(s\) \['negative_prompt_ids'\]"),
        ("negative_prompt_attention_mask", torch.ones(1, 2), r"\['negative_prompt_attention_mask'\]"),
        ("assistant_model", MODEL, r"assisted-generation argument\(s\) \['assistant_model'\]"),
        ("trust_remote_code", True, r"does not support argument\(s\) \['trust_remote_code'\]"),
    ],
)
def test_an_argument_that_asks_for_something_still_raises(name, value, message):
    with pytest.raises(TypeError, match=message):
        hybrid.generate(MODEL, PROMPT, drafter=PromptLookupDrafter(), max_new_tokens=4, **{name: value})
