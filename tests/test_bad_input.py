"""Bad input to `hybrid.generate` fails loudly, with a message that names the problem, and leaves nothing behind.

Every test makes one call with one bad input and checks the exception type and that its message
says what is wrong. The "no partial state" tests then check that the very drafter and model used in
a failing call still give `model.generate`'s greedy output in the next, valid call.
"""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
import torch
import transformers
from transformers import DynamicCache, LlamaForCausalLM

import hybrid
from drafters import Draft, DraftContext, Drafter, DraftError, ModelDrafter, PromptLookupDrafter
from hybrid.testing import tiny_model
from schedulers import FixedScheduler, HeuristicScheduler, Scheduler

VOCAB = 64
CONTEXT = 128
MAX_NEW = 10


def tiny_llama(seed: int, vocab_size: int = VOCAB) -> LlamaForCausalLM:
    """hybrid.testing's tiny Llama. It has no eos token: every call runs long enough to reach the drafter."""
    return tiny_model("llama", vocab_size, num_layers=2, seed=seed, max_position_embeddings=CONTEXT)


class FakeTokenizer:
    """Just enough of a tokenizer for the drafter/tokenizer consistency check."""

    def __init__(self, vocab: dict[str, int]):
        self._vocab = dict(vocab)

    def get_vocab(self) -> dict[str, int]:
        return dict(self._vocab)


TOKENS_A = {f"tok{i}": i for i in range(VOCAB)}
TOKENS_B = {f"other{i}": i for i in range(VOCAB)}


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models: intra-op threads only add overhead (and thrash when other jobs share the CPUs)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def env(_one_thread):
    model = tiny_llama(0)
    draft_model = tiny_llama(1)
    torch.manual_seed(2)
    prompt = torch.randint(3, VOCAB, (1, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = model.generate(prompt, max_new_tokens=MAX_NEW, do_sample=False)
    assert reference.shape == (1, prompt.shape[1] + MAX_NEW)
    return {"model": model, "draft_model": draft_model, "prompt": prompt, "reference": reference}


@pytest.fixture(scope="module")
def model(env):
    return env["model"]


@pytest.fixture(scope="module")
def prompt(env):
    return env["prompt"]


@pytest.fixture(scope="module")
def drafter(env):
    """One ModelDrafter shared by the whole module: every failing call below goes through it."""
    return ModelDrafter(env["draft_model"], max_draft_len=4)


def gen(model, input_ids, drafter, **kwargs):
    kwargs.setdefault("max_new_tokens", MAX_NEW)
    kwargs.setdefault("do_sample", False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return hybrid.generate(model, input_ids, drafter=drafter, **kwargs)


def assert_still_works(env, drafter):
    """The model and the drafter of a failed call produce the verifier's greedy output in a valid call."""
    out = gen(env["model"], env["prompt"], drafter, max_new_tokens=MAX_NEW, do_sample=False)
    assert torch.equal(out, env["reference"])


# --------------------------------------------------------------------------- drafter / verifier mismatch


def test_drafter_vocabulary_differs(model, prompt):
    other = ModelDrafter(tiny_llama(3, vocab_size=80))
    with pytest.raises(ValueError, match=r"drafter vocabulary 80 != verifier vocabulary 64"):
        gen(model, prompt, other)


def test_drafter_tokenizer_differs(env, model, prompt):
    other = ModelDrafter(env["draft_model"], tokenizer=FakeTokenizer(TOKENS_A))
    with pytest.raises(ValueError, match=r"tokenizer differs from the tokenizer passed to generate"):
        gen(model, prompt, other, tokenizer=FakeTokenizer(TOKENS_B))


def test_drafter_tokenizer_equal_is_accepted(env, model, prompt):
    same = ModelDrafter(env["draft_model"], tokenizer=FakeTokenizer(TOKENS_A))
    out = gen(model, prompt, same, tokenizer=FakeTokenizer(TOKENS_A))
    assert torch.equal(out, env["reference"])


def test_drafter_not_a_drafter(env, model, prompt):
    # A common slip: passing the draft *model* instead of ModelDrafter(draft_model).
    with pytest.raises(TypeError, match=r"drafter must be a drafters\.Drafter.*LlamaForCausalLM"):
        gen(model, prompt, env["draft_model"])


def test_drafter_max_draft_len_not_positive(model, prompt):
    class ZeroLen(Drafter):
        max_draft_len = 0

        def propose(self, ctx, max_tokens):
            return Draft.empty()

    with pytest.raises(ValueError, match=r"ZeroLen\.max_draft_len must be a positive int, got 0"):
        gen(model, prompt, ZeroLen())


def test_drafter_hidden_layers_out_of_range(model, prompt):
    class WantsLayer9(Drafter):
        hidden_layers = (9,)

        def propose(self, ctx, max_tokens):
            return Draft.empty()

    with pytest.raises(ValueError, match=r"hidden_layers \[9\] out of range"):
        gen(model, prompt, WantsLayer9())


# --------------------------------------------------------------------------- the prompt


def test_empty_prompt(model, drafter):
    with pytest.raises(ValueError, match=r"empty prompt"):
        gen(model, torch.empty(1, 0, dtype=torch.long), drafter)


def test_input_ids_none(model, drafter):
    with pytest.raises(ValueError, match=r"input_ids is required.*bos_token_id"):
        gen(model, None, drafter)


def test_no_input_ids_start_from_the_bos_token_as_generate_does(model, drafter):
    settings = {"max_new_tokens": MAX_NEW, "do_sample": False, "bos_token_id": 7}
    assert torch.equal(gen(model, None, drafter, **settings), model.generate(**settings))


def test_input_ids_1d(model, prompt, drafter):
    with pytest.raises(ValueError, match=r"input_ids must be a LongTensor \[batch, length\], got \(8,\)"):
        gen(model, prompt[0], drafter)


def test_input_ids_list(model, prompt, drafter):
    with pytest.raises(ValueError, match=r"input_ids must be a LongTensor \[batch, length\], got list"):
        gen(model, prompt.tolist(), drafter)


def test_input_ids_float_names_the_dtype(model, prompt, drafter):
    # A [1, 8] float tensor has the right shape; the message must say that the dtype is what is wrong.
    with pytest.raises(ValueError, match=r"(?=.*input_ids must be a LongTensor)(?=.*float)"):
        gen(model, prompt.float(), drafter)


def test_input_ids_and_inputs_both(model, prompt, drafter):
    with pytest.raises(TypeError, match=r"either input_ids or inputs"):
        gen(model, prompt, drafter, inputs=prompt)


@pytest.mark.parametrize("bad_id", [VOCAB, VOCAB + 100, -1])
def test_token_ids_outside_vocabulary(model, prompt, drafter, bad_id):
    ids = prompt.clone()
    ids[0, 3] = bad_id
    with pytest.raises(ValueError, match=r"input_ids contains ids outside the model's vocabulary \[0, 64\)"):
        gen(model, ids, drafter)


@pytest.mark.parametrize("length", [CONTEXT, CONTEXT + 50])
def test_prompt_longer_than_a_rotary_context_runs_as_generate(model, drafter, length):
    """RoPE has no table: `generate` decodes past max_position_embeddings and so does hybrid (learned tables:
    tests/test_model_support.py)."""
    ids = torch.randint(3, VOCAB, (1, length))
    expected = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(gen(model, ids, drafter, max_new_tokens=8, pad_token_id=0), expected)


def test_batch_with_a_streamer(model, prompt, drafter):
    from transformers.generation.streamers import BaseStreamer

    with pytest.raises(ValueError, match=r"streamer with batch size 2: streamers take one sequence"):
        gen(model, prompt.repeat(2, 1), drafter, streamer=BaseStreamer())


def test_batch_with_return_dict(model, prompt, drafter):
    with pytest.raises(ValueError, match=r"return_dict_in_generate with batch size 2 is not supported yet"):
        gen(model, prompt.repeat(2, 1), drafter, return_dict_in_generate=True)


def test_batch_with_a_right_padded_row(model, prompt, drafter):
    mask = torch.ones(2, prompt.shape[1], dtype=torch.long)
    mask[1, -1] = 0
    with pytest.raises(ValueError, match=r"right-padded.*padding_side='left'"):
        gen(model, prompt.repeat(2, 1), drafter, attention_mask=mask)


def test_batch_rows_of_different_lengths_need_a_pad_token(model, prompt, drafter):
    from transformers import StoppingCriteria, StoppingCriteriaList

    class StopRowStartingWith(StoppingCriteria):  # ends the row whose first token is `first` after 2 new tokens
        def __init__(self, first: int):
            self.first = first
            # An EOS criterion (transformers' own have this attribute): `generate` pads the rows it stops, where it
            # lets rows stopped by other criteria run on to the batch's end.
            self.eos_token_id = None

        def __call__(self, input_ids, scores, **kwargs):
            done = (input_ids[:, 0] == self.first) & (input_ids.shape[1] >= prompt.shape[1] + 2)
            return done

    other = prompt.clone()
    other[0, 0] = (other[0, 0] + 1) % VOCAB
    with pytest.raises(ValueError, match=r"no pad_token_id to fill the shorter ones: set pad_token_id"):
        gen(
            model,
            torch.cat([prompt, other]),
            drafter,
            eos_token_id=None,
            pad_token_id=None,
            max_new_tokens=5,
            stopping_criteria=StoppingCriteriaList([StopRowStartingWith(int(prompt[0, 0]))]),
        )


@pytest.mark.parametrize("shape", [(1, 5), (1, 9), (2, 8)])
def test_attention_mask_wrong_shape(model, prompt, drafter, shape):
    mask = torch.ones(shape, dtype=torch.long)
    with pytest.raises(ValueError, match=r"attention_mask \(\d+, \d+\) must have the shape of input_ids \(1, 8\)"):
        gen(model, prompt, drafter, attention_mask=mask)


def test_attention_mask_right_padded(model, prompt, drafter):
    mask = torch.ones_like(prompt)
    mask[0, -2:] = 0
    with pytest.raises(ValueError, match=r"right-padded.*padding_side='left'"):
        gen(model, prompt, drafter, attention_mask=mask)


# --------------------------------------------------------------------------- lengths and sampling settings


@pytest.mark.parametrize("n", [0, -3])
def test_max_new_tokens_not_positive(model, prompt, drafter, n):
    with pytest.raises(ValueError, match=rf"max_new_tokens.*{n}"):
        gen(model, prompt, drafter, max_new_tokens=n)


def test_max_length_shorter_than_prompt(model, prompt, drafter):
    with pytest.raises(ValueError, match=r"max_length"):
        gen(model, prompt, drafter, max_new_tokens=None, max_length=5)


@pytest.mark.parametrize("temperature", [0, -1])
def test_temperature_not_positive_when_sampling(model, prompt, drafter, temperature):
    with pytest.raises(ValueError, match=rf"temperature={temperature} with do_sample=True"):
        gen(model, prompt, drafter, do_sample=True, temperature=temperature)


# --------------------------------------------------------------------------- arguments of the wrong kind

# Each fails up front with a TypeError that names the argument (and, before these checks, failed deep inside
# transformers or the engine with a message that named neither, or was silently read as something else).
WRONG_KIND = {
    "max_new_tokens str": ({"max_new_tokens": "5"}, r"max_new_tokens='5' \(str\): max_new_tokens takes a length"),
    "min_new_tokens float": ({"min_new_tokens": 2.5}, r"min_new_tokens=2\.5 \(float\): min_new_tokens takes a whole"),
    "max_new_tokens bool": ({"max_new_tokens": True}, r"max_new_tokens=True \(bool\)"),
    "max_length str": ({"max_new_tokens": None, "max_length": "20"}, r"max_length='20' \(str\)"),
    "min_new_tokens str": ({"min_new_tokens": "3"}, r"min_new_tokens='3' \(str\)"),
    "no_repeat_ngram_size str": ({"no_repeat_ngram_size": "2"}, r"no_repeat_ngram_size='2'"),
    "top_k str": ({"do_sample": True, "top_k": "5"}, r"top_k='5' \(str\): top_k takes a whole number"),
    "top_k float": ({"do_sample": True, "top_k": 5.5}, r"top_k=5\.5 \(float\)"),
    "temperature str": (
        {"do_sample": True, "temperature": "0.7"},
        r"temperature='0\.7' \(str\): temperature takes a number",
    ),
    "top_p str": ({"do_sample": True, "top_p": "0.9"}, r"top_p='0\.9' \(str\)"),
    "min_p str": ({"do_sample": True, "min_p": "0.1"}, r"min_p='0\.1' \(str\)"),
    "typical_p str": ({"do_sample": True, "typical_p": "0.5"}, r"typical_p='0\.5' \(str\)"),
    "repetition_penalty str": ({"repetition_penalty": "1.2"}, r"repetition_penalty='1\.2' \(str\)"),
    "max_time str": ({"max_time": "1"}, r"max_time='1' \(str\): max_time takes a number"),
    "do_sample str": ({"do_sample": "yes"}, r"do_sample='yes' \(str\): do_sample takes True or False"),
    "return_dict_in_generate str": ({"return_dict_in_generate": "yes"}, r"return_dict_in_generate='yes'"),
    "output_scores str": ({"return_dict_in_generate": True, "output_scores": "x"}, r"output_scores='x'"),
    "use_cache str": ({"use_cache": "no"}, r"use_cache='no' \(str\): use_cache takes True or False"),
    "eos_token_id str": ({"eos_token_id": "3"}, r"eos_token_id='3' \(str\): eos_token_id takes a token id"),
    "pad_token_id str": ({"pad_token_id": "0"}, r"pad_token_id='0' \(str\)"),
    "suppress_tokens int": ({"suppress_tokens": 5}, r"suppress_tokens=5 \(int\): suppress_tokens takes a list"),
    "forced_eos_token_id str": ({"forced_eos_token_id": "x"}, r"forced_eos_token_id='x'"),
    "stop_strings int": ({"stop_strings": 5}, r"stop_strings=5 \(int\): stop_strings takes a string or a list"),
    "exponential_decay_length_penalty int": (
        {"exponential_decay_length_penalty": 5},
        r"exponential_decay_length_penalty=5 \(int\): exponential_decay_length_penalty takes a pair",
    ),
    "watermarking_config int": ({"watermarking_config": 5}, r"watermarking_config=5 \(int\)"),
    "a field of generation_config": (
        {"generation_config": transformers.GenerationConfig(top_k=5.5)},
        r"generation_config\.top_k=5\.5 \(float\)",
    ),
    "generation_config a dict": (
        {"generation_config": {"do_sample": True}},
        r"generation_config must be a transformers\.GenerationConfig, got dict: pass GenerationConfig\(\*\*settings\)",
    ),
    "return_stats str": ({"return_stats": "x"}, r"return_stats='x': pass True .* or False"),
    "stopping_criteria of ints": (
        {"stopping_criteria": [1, 2]},
        r"stopping_criteria\[0\] \(int\) is not callable: each entry is a StoppingCriteria",
    ),
    "stopping_criteria an int": ({"stopping_criteria": 5}, r"stopping_criteria must be a list \(int given\)"),
    "logits_processor of ints": (
        {"logits_processor": [1]},
        r"logits_processor\[0\] \(int\) is not callable: each entry is a LogitsProcessor",
    ),
    "logits_processor a processor": (
        {"logits_processor": transformers.TopKLogitsWarper(3)},
        r"logits_processor must be a list \(TopKLogitsWarper given\): pass a LogitsProcessorList",
    ),
    "prefix_allowed_tokens_fn not callable": (
        {"prefix_allowed_tokens_fn": [1, 2]},
        r"prefix_allowed_tokens_fn \(list\) is not callable: pass a function \(batch_id, input_ids\)",
    ),
    "streamer without put": (
        {"streamer": object()},
        r"streamer \(object\) has no put\(\) or end\(\): a streamer is a transformers BaseStreamer",
    ),
}


@pytest.mark.parametrize("case", list(WRONG_KIND), ids=list(WRONG_KIND))
def test_an_argument_of_the_wrong_kind_is_named(model, prompt, drafter, case):
    kwargs, message = WRONG_KIND[case]
    with pytest.raises(TypeError, match=message):
        gen(model, prompt, drafter, **kwargs)


class PutOnly:
    def put(self, value):
        pass


def test_a_streamer_without_end_is_named(model, prompt, drafter):
    with pytest.raises(TypeError, match=r"streamer \(PutOnly\) has no end\(\)"):
        gen(model, prompt, drafter, streamer=PutOnly())


# Each setting at the value that switches it off (or with a type that is not a plain int/float: numpy, tensors):
# `generate` reads each as asking for nothing, and so does hybrid; the output is the greedy reference.
OFF_VALUES = {
    "top_k=0": {"top_k": 0},
    "top_p=1.0": {"top_p": 1.0},
    "temperature=1 (an int)": {"temperature": 1},
    "repetition_penalty=1.0": {"repetition_penalty": 1.0},
    "no_repeat_ngram_size=0": {"no_repeat_ngram_size": 0},
    "min_new_tokens=0": {"min_new_tokens": 0},
    "max_new_tokens numpy": {"max_new_tokens": np.int64(MAX_NEW)},
    "max_new_tokens a whole float (generate takes it)": {"max_new_tokens": float(MAX_NEW)},
    "max_time=None": {"max_time": None},
    "stop_strings=None": {"stop_strings": None},
    "eos_token_id=None": {"eos_token_id": None},
    "eos_token_id a list": {"eos_token_id": [VOCAB + 1]},
    "eos_token_id a tensor": {"eos_token_id": torch.tensor([VOCAB + 1])},
    "suppress_tokens=[]": {"suppress_tokens": []},
    "logits_processor=[]": {"logits_processor": []},
    "logits_processor=None": {"logits_processor": None},
    "stopping_criteria empty": {"stopping_criteria": transformers.StoppingCriteriaList()},
    "prefix_allowed_tokens_fn=None": {"prefix_allowed_tokens_fn": None},
    "streamer=None": {"streamer": None},
    "return_stats=False": {"return_stats": False},
    "renormalize_logits=False": {"renormalize_logits": False},
    "return_dict_in_generate=False": {"return_dict_in_generate": False, "output_scores": False},
    "generation_config=None": {"generation_config": None},
    "use_cache=True": {"use_cache": True},
    "cache_implementation=dynamic (generate's own default)": {"cache_implementation": "dynamic"},
    "cache_implementation=None": {"cache_implementation": None},
    "low_memory=False": {"low_memory": False},
    "is_assistant=False": {"is_assistant": False},
}


@pytest.mark.parametrize("case", list(OFF_VALUES), ids=list(OFF_VALUES))
def test_an_argument_at_its_off_value_is_accepted(env, model, prompt, drafter, case):
    assert torch.equal(gen(model, prompt, drafter, **OFF_VALUES[case]), env["reference"])


# --------------------------------------------------------------------------- drafters that break the contract


class BadDrafter(Drafter):
    """Returns whatever `make(ctx, max_tokens)` builds."""

    def __init__(self, make):
        self.make = make
        self.calls = 0

    def propose(self, ctx: DraftContext, max_tokens: int):
        self.calls += 1
        return self.make(ctx, max_tokens)


def _one_hot(token: int, k: int = 1) -> torch.Tensor:
    probs = torch.zeros(k, VOCAB)
    probs[:, token] = 1.0
    return probs


BAD_DRAFTS = {
    "negative token": (
        lambda ctx, n: Draft(torch.tensor([5, -1])),
        False,
        r"token id -1 outside the verifier's vocabulary \[0, 64\)",
    ),
    "token == vocab": (
        lambda ctx, n: Draft(torch.tensor([VOCAB])),
        False,
        r"token id 64 outside the verifier's vocabulary \[0, 64\)",
    ),
    "token > vocab": (
        lambda ctx, n: Draft(torch.tensor([3, VOCAB + 7])),
        False,
        r"token id 71 outside the verifier's vocabulary",
    ),
    "2-D tokens": (lambda ctx, n: Draft(torch.tensor([[3, 4]])), False, r"tokens \(1, 2\).*expected a 1-D LongTensor"),
    "float tokens": (lambda ctx, n: Draft(torch.tensor([3.0, 4.0])), False, r"expected a 1-D LongTensor"),
    "list tokens": (lambda ctx, n: Draft([3, 4]), False, r"tokens list; expected a 1-D LongTensor"),
    "too many tokens": (
        lambda ctx, n: Draft(torch.full((n + 1,), 3)),
        False,
        r"returned \d+ tokens but at most \d+ were asked for",
    ),
    "probs wrong vocab": (
        lambda ctx, n: Draft(torch.tensor([3]), torch.full((1, VOCAB + 1), 1 / (VOCAB + 1))),
        True,
        r"probs \(1, 65\); expected \(1, 64\)",
    ),
    "probs wrong rows": (
        lambda ctx, n: Draft(torch.tensor([3]), _one_hot(3, 2)),
        True,
        r"probs \(2, 64\); expected \(1, 64\)",
    ),
    "probs 1-D": (lambda ctx, n: Draft(torch.tensor([3]), _one_hot(3)[0]), True, r"probs \(64,\); expected \(1, 64\)"),
    "probs not a tensor": (
        lambda ctx, n: Draft(torch.tensor([3]), [[1.0] + [0.0] * (VOCAB - 1)]),
        True,
        r"probs list; expected \(1, 64\)",
    ),
    "probs rows do not sum to 1": (
        lambda ctx, n: Draft(torch.tensor([3]), torch.ones(1, VOCAB)),
        True,
        r"probs whose rows do not sum to 1",
    ),
    "probs negative": (
        lambda ctx, n: Draft(torch.tensor([3]), _one_hot(3) * 2 - _one_hot(4)),
        True,
        r"probs\[0, 4\] = -1\.0: each row of probs is a distribution \(finite, non-negative",
    ),
    "probs nan": (lambda ctx, n: Draft(torch.tensor([3]), _one_hot(3) * float("nan")), True, r"probs\[0, 0\] = nan"),
    "probs inf": (
        lambda ctx, n: Draft(torch.tensor([3]), _one_hot(3).index_fill(1, torch.tensor([5]), float("inf"))),
        True,
        r"probs\[0, 5\] = inf",
    ),
    "confidence nan": (
        lambda ctx, n: Draft(torch.tensor([3]), None, torch.tensor([float("nan")])),
        False,
        r"confidence nan for node 0: confidences are finite",
    ),
    "confidence inf": (
        lambda ctx, n: Draft(torch.tensor([3, 4]), None, torch.tensor([0.5, float("inf")])),
        False,
        r"confidence inf for node 1",
    ),
    "confidence -inf": (
        lambda ctx, n: Draft(torch.tensor([3]), None, torch.tensor([float("-inf")])),
        False,
        r"confidence -inf for node 0",
    ),
    "probs zero at token": (
        lambda ctx, n: Draft(torch.tensor([3]), _one_hot(4)),
        True,
        r"proposed a token its own probs give probability 0",
    ),
    "not a Draft (tensor)": (
        lambda ctx, n: torch.tensor([3, 4]),
        False,
        r"returned Tensor; it must return a drafters\.Draft",
    ),
    "not a Draft (None)": (lambda ctx, n: None, False, r"returned NoneType; it must return a drafters\.Draft"),
    "not a Draft (tuple)": (
        lambda ctx, n: (torch.tensor([3]), None),
        False,
        r"returned tuple; it must return a drafters\.Draft",
    ),
}


@pytest.mark.parametrize("case", list(BAD_DRAFTS), ids=list(BAD_DRAFTS))
def test_drafter_breaks_contract(model, prompt, case):
    make, do_sample, message = BAD_DRAFTS[case]
    bad = BadDrafter(make)
    with pytest.raises(DraftError, match=message) as excinfo:
        gen(model, prompt, bad, do_sample=do_sample)
    assert "BadDrafter.propose" in str(excinfo.value)  # the message names the culprit
    assert bad.calls == 1  # rejected at the first proposal, before the verifier saw any of it


@pytest.mark.parametrize("case", ["token > vocab", "probs wrong vocab", "probs zero at token"])
def test_drafter_breaks_contract_when_sampling(model, prompt, case):
    # Probs-independent cases raise whatever the mode; probs cases raise in greedy mode too.
    make, _, message = BAD_DRAFTS[case]
    with pytest.raises(DraftError, match=message):
        gen(model, prompt, BadDrafter(make), do_sample=True)
    with pytest.raises(DraftError, match=message):
        gen(model, prompt, BadDrafter(make), do_sample=False)


def test_draft_float_tokens_message_names_the_dtype(model, prompt):
    # The tokens are 1-D and of a valid length: only the dtype is wrong, so the message must say so
    # (not just print the shape "(2,)" next to "expected a 1-D LongTensor").
    with pytest.raises(DraftError, match=r"(?=.*expected a 1-D LongTensor)(?=.*float)"):
        gen(model, prompt, BadDrafter(lambda ctx, n: Draft(torch.tensor([3.0, 4.0]))))


def test_draft_error_is_a_value_error():
    assert issubclass(DraftError, ValueError)


# --------------------------------------------------------------------------- unsupported arguments


UNSUPPORTED = {
    "num_beams": ({"num_beams": 4}, ValueError, r"num_beams=4"),
    "assistant_model": (None, TypeError, r"assisted-generation argument\(s\) \['assistant_model'\]"),
    "num_assistant_tokens": (
        {"num_assistant_tokens": 5},
        TypeError,
        r"assisted-generation argument\(s\) \['num_assistant_tokens'\]",
    ),
    "made-up kwarg": ({"foo": 1}, TypeError, r"unsupported argument\(s\) \['foo'\]"),
    "prompt_lookup_num_tokens": (
        {"prompt_lookup_num_tokens": 3},
        ValueError,
        r"prompt_lookup_num_tokens=3.*PromptLookupDrafter",
    ),
    "output_attentions": ({"output_attentions": True}, ValueError, r"output_attentions=True"),
    "output_hidden_states": ({"output_hidden_states": True}, ValueError, r"output_hidden_states=True"),
    "past_key_values": (
        {"past_key_values": "cache"},
        ValueError,
        r"does not continue from a past_key_values.*drop past_key_values",
    ),
    "synced_gpus": ({"synced_gpus": True}, TypeError, r"does not support argument\(s\) \['synced_gpus'\]"),
    # Greedy: `generate`'s own config validation names it; sampling: hybrid's check does.
    "num_return_sequences": ({"num_return_sequences": 2}, ValueError, r"num_return_sequences.*2"),
    "num_return_sequences sampling": (
        {"num_return_sequences": 2, "do_sample": True},
        ValueError,
        r"num_return_sequences=2",
    ),
    "num_beams sampling": ({"num_beams": 4, "do_sample": True}, ValueError, r"num_beams=4"),
    "penalty_alpha": ({"penalty_alpha": 0.6, "top_k": 4}, ValueError, r"penalty_alpha=0\.6"),
    "use_cache=False": ({"use_cache": False}, ValueError, r"use_cache=False"),
    "cache_implementation=offloaded": (
        {"cache_implementation": "offloaded"},
        ValueError,
        r"cache_implementation='offloaded'.*cache_implementation='static'",
    ),
    "compile_config without static": (
        {"compile_config": "config"},
        ValueError,
        r"compile_config applies to the static-shape path.*cache_implementation='static'",
    ),
}


@pytest.mark.parametrize("default", ["offloaded", "sliding_window", "quantized"])
def test_a_cache_implementation_that_is_only_the_models_default(default):
    """A model's generation config may name a cache of its own (Gemma 2 once shipped "hybrid"): where that cache keeps
    exact keys and values it asks hybrid for nothing; a quantized one changes what `generate` computes: refused."""
    model = tiny_model("llama", 96, 2, seed=0)
    model.generation_config.cache_implementation = default
    prompt = torch.tensor([[4, 5, 6, 4, 5, 6, 7]])
    if default == "quantized":
        with pytest.raises(ValueError, match=r"cache_implementation='quantized'"):
            hybrid.generate(model, prompt, drafter=PromptLookupDrafter(), max_new_tokens=10, pad_token_id=0)
        return
    runs_here = {} if default != "offloaded" else {"cache_implementation": "dynamic"}  # offloading needs CUDA
    expected = model.generate(prompt, max_new_tokens=10, do_sample=False, pad_token_id=0, **runs_here)
    output = hybrid.generate(model, prompt, drafter=PromptLookupDrafter(), max_new_tokens=10, pad_token_id=0)
    assert torch.equal(output, expected)
    with pytest.raises(ValueError, match=rf"cache_implementation='{default}'"):  # passed to the call: refused
        hybrid.generate(model, prompt, drafter=None, max_new_tokens=10, pad_token_id=0, cache_implementation=default)


@pytest.mark.parametrize("case", list(UNSUPPORTED), ids=list(UNSUPPORTED))
def test_unsupported_argument(env, model, prompt, drafter, case):
    kwargs, error, message = UNSUPPORTED[case]
    if kwargs is None:
        kwargs = {"assistant_model": env["draft_model"]}
    if kwargs.get("past_key_values") == "cache":
        kwargs = {"past_key_values": DynamicCache()}
    if kwargs.get("compile_config") == "config":
        kwargs = {"compile_config": transformers.CompileConfig()}
    with pytest.raises(error, match=message):
        gen(model, prompt, drafter, **kwargs)


# --------------------------------------------------------------------------- the verifier is not a causal LM


def test_verifier_is_bert(prompt, drafter):
    bert = transformers.BertModel(
        transformers.BertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=CONTEXT,
        )
    ).eval()
    with pytest.raises(TypeError, match=r"(causal LM|decoder-only).*BertModel|BertModel.*(causal LM|decoder-only)"):
        gen(bert, prompt, drafter)


def test_verifier_is_linear(prompt, drafter):
    with pytest.raises(TypeError, match=r"verifier must be a Hugging Face causal LM.*Linear"):
        gen(torch.nn.Linear(4, 4), prompt, drafter)


def test_verifier_compiled_with_torch_compile(model, prompt, drafter):
    with pytest.raises(TypeError, match=r"torch.compile wrapper.*_orig_mod.*cache_implementation='static'"):
        gen(torch.compile(model), prompt, drafter)


def test_verifier_is_encoder_decoder(prompt, drafter):
    t5 = transformers.T5ForConditionalGeneration(
        transformers.T5Config(
            vocab_size=VOCAB,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=1,
            num_decoder_layers=1,
            num_heads=4,
        )
    ).eval()
    with pytest.raises(TypeError, match=r"T5ForConditionalGeneration is not a decoder-only causal LM"):
        gen(t5, prompt, drafter)


# --------------------------------------------------------------------------- scheduler and generator


class NotAScheduler:
    def select(self, drafts):
        return [2 for _ in drafts]


def test_scheduler_not_a_scheduler(model, prompt, drafter):
    with pytest.raises(TypeError, match=r"scheduler must be a schedulers\.Scheduler, got NotAScheduler"):
        gen(model, prompt, drafter, scheduler=NotAScheduler())


def test_fixed_scheduler_zero(model, prompt, drafter):
    with pytest.raises(ValueError, match=r"k=0 must be an int in 1\.\."):
        gen(model, prompt, drafter, scheduler=FixedScheduler(0))


def test_fixed_scheduler_above_drafter_max_draft_len(model, prompt):
    with pytest.raises(ValueError, match=r"k=8 must be an int in 1\.\.4 \(the drafter's node_budget\)"):
        gen(model, prompt, PromptLookupDrafter(max_draft_len=4), scheduler=FixedScheduler(8))


def test_scheduler_select_out_of_range(model, prompt, drafter):
    class Greedy(Scheduler):
        def plan_step(self, steps_left):
            return dataclasses.replace(super().plan_step(steps_left), max_nodes=2)

        def select(self, drafts):
            return [len(draft) + 1 for draft in drafts]

    with pytest.raises(ValueError, match=r"Greedy\.select returned \d+; expected 0\.\.\d+"):
        gen(model, prompt, drafter, scheduler=Greedy())


@pytest.mark.parametrize("generator", [123, "cuda", torch.Generator().get_state()])
def test_generator_not_a_generator(model, prompt, drafter, generator):
    with pytest.raises(TypeError, match=r"generator must be a torch\.Generator, got"):
        gen(model, prompt, drafter, generator=generator, do_sample=True)


# --------------------------------------------------------------------------- no partial state


def test_no_partial_state_after_bad_calls(env, model, prompt, drafter):
    """Every failure above used the module's `drafter` and `model`; both still give the reference output."""
    config_before = model.generation_config.to_dict()
    failing = [
        dict(input_ids=prompt, max_new_tokens=0),
        dict(input_ids=prompt, num_beams=4),
        dict(input_ids=prompt, foo=1),
        dict(input_ids=prompt, attention_mask=torch.ones(1, 3, dtype=torch.long)),
        dict(input_ids=prompt.repeat(2, 1), return_dict_in_generate=True),
        dict(input_ids=prompt, do_sample=True, temperature=0),
        dict(input_ids=prompt, scheduler=NotAScheduler()),
    ]
    for kwargs in failing:
        ids = kwargs.pop("input_ids")
        with pytest.raises((ValueError, TypeError)):
            gen(model, ids, drafter, **kwargs)
    assert model.generation_config.to_dict() == config_before
    assert not model.training
    assert_still_works(env, drafter)


class FlakyModelDrafter(ModelDrafter):
    """A ModelDrafter that breaks its contract on the `fail_at`-th proposal of a call (1-based)."""

    def __init__(self, *args, fail_at: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.fail_at = fail_at
        self.calls = 0

    def reset(self, ctx):
        super().reset(ctx)
        self.calls = 0

    def propose(self, ctx, max_tokens):
        self.calls += 1
        draft = super().propose(ctx, max_tokens)  # advances the drafter's own cache first
        if self.calls == self.fail_at:
            return Draft(torch.full((max_tokens,), VOCAB))
        return draft


@pytest.mark.parametrize("fail_at", [1, 3])
def test_no_partial_state_after_draft_error_mid_generation(env, model, prompt, fail_at):
    flaky = FlakyModelDrafter(env["draft_model"], max_draft_len=4, fail_at=fail_at)
    # A fixed scheduler drafts every step: the default one may skip a drafter whose forward does not pay.
    with pytest.raises(DraftError, match=r"FlakyModelDrafter\.propose returned token id 64"):
        gen(model, prompt, flaky, scheduler=FixedScheduler(4))
    assert flaky.calls == fail_at
    flaky.fail_at = None
    assert_still_works(env, flaky)
    # And the same instance again, sampling then greedy, after another failure.
    flaky.fail_at = 2
    with pytest.raises(DraftError):
        gen(model, prompt, flaky, do_sample=True, scheduler=FixedScheduler(4))
    flaky.fail_at = None
    assert_still_works(env, flaky)


def test_no_partial_state_after_scheduler_error_mid_generation(env, model, prompt, drafter):
    with pytest.raises(ValueError, match=r"k=8 must be an int in 1\.\.4"):
        gen(model, prompt, drafter, scheduler=FixedScheduler(8))  # fails after the prefill, in start
    assert_still_works(env, drafter)
    out = gen(model, prompt, drafter, scheduler=FixedScheduler(4))
    assert torch.equal(out, env["reference"])


def test_no_partial_state_prompt_lookup(env, model, prompt):
    lookup = PromptLookupDrafter(max_draft_len=4)
    with pytest.raises(ValueError):
        gen(model, prompt, lookup, scheduler=FixedScheduler(8))
    with pytest.raises(ValueError):
        gen(model, prompt[0], lookup)
    assert_still_works(env, lookup)


def test_no_partial_state_heuristic_scheduler_reused(env, model, prompt, drafter):
    scheduler = HeuristicScheduler()
    with pytest.raises(DraftError):
        gen(model, prompt, BadDrafter(lambda ctx, n: Draft(torch.tensor([VOCAB]))), scheduler=scheduler)
    out = gen(model, prompt, drafter, scheduler=scheduler)
    assert torch.equal(out, env["reference"])
