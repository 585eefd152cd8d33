"""hybrid behind transformers' own plumbing: the exported folder (custom_generate, from_pretrained) and
`transformers serve` on loopback, with a tiny random Llama whose 256 tokens are whole printable characters (so a
stream's text is exactly the decoded tokens)."""

from __future__ import annotations

import gc
import http.client
import json
import logging
import re
import socket
import threading
import urllib.error
import urllib.request
import weakref
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

import hybrid
from drafters import DFlashDrafter, ModelDrafter, PromptLookupDrafter
from hybrid.custom_generate import build_drafter, cached_drafter
from hybrid.custom_generate import generate as glue_generate
from hybrid.custom_generate.generate import _DRAFTERS
from hybrid.export import GLUE, export_served
from hybrid.testing import tiny_model

pytest.importorskip("fastapi", reason="the serving extra: pip install -e '.[serving]'")
pytest.importorskip("openai", reason="the serving extra: pip install -e '.[serving]'")

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
PROMPTS = ["hello there", "write a sorted merge", "what is a hash table?", "tell me about rivers"]


def printable_tokenizer() -> PreTrainedTokenizerFast:
    """256 tokens, each one whole character (printable ASCII, newline, then CJK ideographs), no merges."""
    from tokenizers import Tokenizer, decoders, models

    chars = [chr(c) for c in range(32, 127)] + ["\n"] + [chr(c) for c in range(0x4E00, 0x4E00 + 160)]
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[], unk_token=" "))
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def verifier_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("verifier")
    tiny_model("llama", 256, 2, seed=0, max_position_embeddings=1024).save_pretrained(folder)
    printable_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def served(verifier_dir, tmp_path_factory) -> Path:
    return export_served(tmp_path_factory.mktemp("served") / "tiny", verifier_dir, "prompt-lookup")


@pytest.fixture(scope="module")
def reference(verifier_dir):
    """(model, tokenizer, greedy answer of `hybrid.generate` for a prompt and a length)."""
    model = AutoModelForCausalLM.from_pretrained(verifier_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(verifier_dir)

    def answer(prompt: str, max_new_tokens: int) -> str:
        ids = chat_ids(tokenizer, prompt)
        out = hybrid.generate(model, ids, drafter=PromptLookupDrafter(), max_new_tokens=max_new_tokens, do_sample=False)
        return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)

    return model, tokenizer, answer


def chat_ids(tokenizer, prompt: str) -> torch.Tensor:
    messages = [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
        "input_ids"
    ]


# --------------------------------------------------------------------------- the folder, without a server


def test_the_folder_works_with_custom_generate_and_from_pretrained(served, reference):
    model, tokenizer, _ = reference
    ids = chat_ids(tokenizer, PROMPTS[0])
    expected = model.generate(ids, max_new_tokens=20, do_sample=False)
    by_path = model.generate(
        ids, max_new_tokens=20, do_sample=False, custom_generate=str(served), trust_remote_code=True
    )
    assert torch.equal(by_path, expected)

    loaded = AutoModelForCausalLM.from_pretrained(served, trust_remote_code=True)
    out, stats = loaded.generate(ids, max_new_tokens=20, do_sample=False, return_stats=True)  # hybrid's generate
    assert torch.equal(out, expected) and stats.new_tokens == 20
    assert torch.equal(loaded.generate(ids, None, max_new_tokens=20), expected)  # positional, as generate takes them

    plain = AutoModelForCausalLM.from_pretrained(served)  # without trust_remote_code: the plain verifier
    assert not isinstance(plain.generate(ids, max_new_tokens=20, do_sample=False), tuple)


def test_the_callable_form_is_refused_with_the_folder_form_named(reference):
    model, tokenizer, _ = reference
    with pytest.raises(TypeError, match=r"custom_generate is a folder, not a Callable.*export-served"):
        model.generate(chat_ids(tokenizer, "hi"), max_new_tokens=4, custom_generate=glue_generate)


def test_the_drafter_is_built_once_per_model_and_dies_with_it(verifier_dir, reference):
    _, tokenizer, _ = reference
    model = AutoModelForCausalLM.from_pretrained(verifier_dir).eval()
    ids = chat_ids(tokenizer, "hi")
    glue_generate(ids, model=model, drafter="prompt-lookup", max_new_tokens=4)
    drafter = _DRAFTERS[model]["prompt-lookup"]
    glue_generate(ids, model=model, drafter="prompt-lookup", max_new_tokens=4)
    assert cached_drafter(model, "prompt-lookup") is drafter

    # The cache alone does not keep a model alive (hybrid.generate's default scheduler, kept per verifier, does
    # hold it: a fresh model, never decoded, shows the cache's own part).
    fresh = AutoModelForCausalLM.from_pretrained(verifier_dir).eval()
    fresh_drafter = cached_drafter(fresh, "prompt-lookup")
    model_ref, drafter_ref = weakref.ref(fresh), weakref.ref(fresh_drafter)
    del fresh, fresh_drafter
    gc.collect()
    assert model_ref() is None and drafter_ref() is None


def test_each_call_logs_tau_and_tokens_per_second(reference, caplog):
    model, tokenizer, _ = reference
    with caplog.at_level(logging.INFO, logger="hybrid.serving"):
        glue_generate(chat_ids(tokenizer, "hi"), model=model, drafter="none", max_new_tokens=6)
    assert re.search(r"no drafter: 6 tokens in 6 verifier forwards: tau 1\.00, [0-9.]+ tok/s", caplog.text)


def test_served_the_glue_raises_a_refusal_as_the_requests_fault(reference, monkeypatch, capsys, served_logger):
    """Under `python -m hybrid serve` (HYBRID_SERVED=1, inherited by the process a server decodes in) what hybrid
    refuses is a ValueError, which transformers serve answers 400, and each call prints its line; a library caller
    gets hybrid's own error."""
    from hybrid.custom_generate.generate import SERVED

    model, tokenizer, _ = reference
    ids = chat_ids(tokenizer, "hi")
    with pytest.raises(TypeError, match=r"top_k='5' \(str\)"):
        glue_generate(ids, model=model, drafter="none", max_new_tokens=4, top_k="5")
    monkeypatch.setenv(SERVED, "1")
    with pytest.raises(ValueError, match=r"top_k='5' \(str\)"):
        glue_generate(ids, model=model, drafter="none", max_new_tokens=4, top_k="5")
    with pytest.raises(ValueError, match=r"needs .* of cache .* lower max_new_tokens"):
        glue_generate(ids, model=model, drafter="none", max_new_tokens=10**9)
    glue_generate(ids, model=model, drafter="none", max_new_tokens=3)  # and each call's line goes to stderr
    assert re.search(r"hybrid: no drafter: 3 tokens in 3 verifier forwards: tau 1\.00", capsys.readouterr().err)


def test_export_refuses_what_it_cannot_serve(verifier_dir, tmp_path):
    with pytest.raises(ValueError, match=r"drafter 'nonsense' is neither one of \['default', 'block'"):
        export_served(tmp_path / "a", verifier_dir, "nonsense")
    with pytest.raises(ValueError, match=r"trained for another verifier"):  # the shipped block model is SmolLM2's
        export_served(tmp_path / "b", verifier_dir, "block")
    with pytest.raises(ValueError, match=r"no config.json there"):
        export_served(tmp_path / "c", tmp_path, "none")
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match=r"was not written by export-served"):
        export_served(foreign, verifier_dir, "none")
    assert (foreign / "notes.txt").read_text() == "keep me"
    again = export_served(tmp_path / "d", verifier_dir, "none")
    assert export_served(again, verifier_dir, "prompt-lookup") == again  # its own folder may be rewritten
    assert "DRAFTER = 'prompt-lookup'" in (again / GLUE).read_text()


def test_a_drafter_folder_is_built_by_its_kind(verifier_dir, reference, tmp_path):
    from test_dflash import write_dflash_folder

    model, tokenizer, _ = reference
    small = tmp_path / "small-lm"
    tiny_model("llama", 256, 1, seed=3).save_pretrained(small)
    ids = chat_ids(tokenizer, PROMPTS[1])
    expected = model.generate(ids, max_new_tokens=16, do_sample=False)
    for folder, kind in ((write_dflash_folder(tmp_path / "dflash", model), DFlashDrafter), (small, ModelDrafter)):
        drafter = build_drafter(str(folder), model)
        # A trained drafter goes behind lookup and the online store (hybrid.drafter_for); a causal LM drafts alone.
        assert isinstance(drafter.sources[-1] if kind is DFlashDrafter else drafter, kind)
        served = export_served(tmp_path / f"served-{folder.name}", verifier_dir, str(folder))
        out = model.generate(
            ids, max_new_tokens=16, do_sample=False, custom_generate=str(served), trust_remote_code=True
        )
        assert torch.equal(out, expected)


def test_the_export_command_writes_the_folder(verifier_dir, tmp_path, capsys):
    from hybrid import cli

    assert cli.main(["export-served", str(tmp_path / "out"), "--verifier", str(verifier_dir), "--drafter", "none"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "out")
    assert "DRAFTER = 'none'" in (tmp_path / "out" / GLUE).read_text()
    assert (tmp_path / "out" / "model.safetensors").is_file() and (tmp_path / "out" / "tokenizer.json").is_file()


# --------------------------------------------------------------------------- through transformers serve


class Client:
    """Chat requests to one served folder on loopback, read as raw HTTP (status, SSE events), and the server's log."""

    def __init__(self, port: int, model: str, log: Path):
        self.port, self.model, self.log = port, model, log

    def logged(self) -> str:
        return self.log.read_text(errors="replace")

    def body(self, prompt: str, max_tokens: int, **extra) -> dict:
        return {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            **extra,
        }

    def post(self, body: dict | bytes, path: str = "/v1/chat/completions") -> tuple[int, bytes]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}", data=data, headers={"content-type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def complete(self, prompt: str, max_tokens: int, **extra) -> str:
        status, data = self.post(self.body(prompt, max_tokens, **extra))
        assert status == 200, data
        return json.loads(data)["choices"][0]["message"]["content"]

    def stream(self, prompt: str, max_tokens: int, **extra) -> tuple[str, list[dict]]:
        """(text, events) of a streaming request."""
        body = self.body(prompt, max_tokens, stream=True, stream_options={"include_usage": True}, **extra)
        status, data = self.post(body)
        assert status == 200, data
        events = [json.loads(line[6:]) for line in data.decode().splitlines() if line.startswith("data: ")]
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))
        return text, events


@pytest.fixture(scope="module")
def servers(served, tmp_path_factory):
    """The served folder behind `python -m hybrid serve` (trust_remote_code and hybrid's request rules) and behind
    plain `transformers serve` (neither), each a process of its own (`experiments.serving.Server`) whose output is
    its client's log."""
    from experiments.serving import Server

    logs = tmp_path_factory.mktemp("server-logs")
    started, clients = [], {}
    try:
        for name in ("hybrid", "plain"):
            # hybrid's measures into a folder of its own, empty at its start (`test_hybrid_serve_measures_before_ready`)
            costs = tmp_path_factory.mktemp("costs")
            server = Server(name, served, "cpu", logs / f"{name}.log", env={"HYBRID_COSTS": str(costs)})
            started.append(server)
            server.wait_ready(timeout=120)
            clients[name] = Client(server.port, str(served), server.log)
            clients[name].tables_at_ready = list(costs.glob("*.json"))  # the verify-cost tables measured
        yield clients
    finally:
        for server in started:
            server.stop()


def test_greedy_text_through_the_server_equals_hybrid_generate(servers, reference):
    _, _, answer = reference
    hybrid_server = servers["hybrid"]
    assert hybrid_server.complete(PROMPTS[1], 24, temperature=0) == answer(PROMPTS[1], 24)
    text, events = hybrid_server.stream(PROMPTS[1], 24, temperature=0)
    assert text == answer(PROMPTS[1], 24)
    assert events[-1]["usage"]["completion_tokens"] == 24
    assert servers["plain"].complete(PROMPTS[1], 24, temperature=0) == answer(PROMPTS[1], 24)


def test_text_completions_decode_with_hybrid_too(servers, reference):
    model, tokenizer, _ = reference
    prompt = "def merge(a, b):"
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    out = hybrid.generate(model, ids, drafter=PromptLookupDrafter(), max_new_tokens=16, do_sample=False)
    expected = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    client = servers["hybrid"]
    body = {"model": client.model, "prompt": prompt, "max_tokens": 16, "temperature": 0}
    status, data = client.post(body, "/v1/completions")
    assert status == 200 and json.loads(data)["choices"][0]["text"] == expected


def test_a_seeded_sampled_request_repeats_and_equals_the_plain_servers(servers, reference):
    _, _, answer = reference
    sampling = {"generation_config": json.dumps({"do_sample": True, "temperature": 1.0, "top_k": 0}), "seed": 11}
    first = servers["hybrid"].complete(PROMPTS[2], 32, **sampling)
    assert first != answer(PROMPTS[2], 32)  # it sampled
    assert servers["hybrid"].complete(PROMPTS[2], 32, **sampling) == first
    assert servers["plain"].complete(PROMPTS[2], 32, **sampling) == first


def test_concurrent_requests_never_mix_outputs(servers, reference):
    _, _, answer = reference
    expected = {p: answer(p, 20) for p in PROMPTS}
    got = {}

    def ask(prompt: str) -> None:
        got[prompt] = servers["hybrid"].stream(prompt, 20, temperature=0)[0]

    threads = [threading.Thread(target=ask, args=(p,)) for p in PROMPTS * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert got == expected


def test_an_unsupported_setting_is_a_clear_error_and_the_next_request_is_fine(servers, reference):
    _, _, answer = reference
    beams = {"generation_config": json.dumps({"num_beams": 4})}
    message = "hybrid.generate does not support num_beams=4: beam search is not speculative; use num_beams=1"
    _, events = servers["hybrid"].stream(PROMPTS[0], 8, **beams)
    assert message in events[-1]["error"]  # the stream had begun: transformers serve ends it with an error event
    status, data = servers["hybrid"].post(servers["hybrid"].body(PROMPTS[0], 8, **beams))
    assert status == 400 and json.loads(data)["error"]["message"] == message
    assert servers["hybrid"].complete(PROMPTS[0], 12, temperature=0) == answer(PROMPTS[0], 12)


def without(body: dict, name: str) -> dict:
    return {k: v for k, v in body.items() if k != name}


# (how the valid request is changed, whether it streams, what the 400's message says)
BAD_REQUESTS = {
    "messages missing": (lambda body: without(body, "messages"), False, r"messages is required: the conversation"),
    "messages a string": (lambda body: {**body, "messages": "hello"}, False, r"messages must be a non-empty list"),
    "messages empty, streamed": (lambda body: {**body, "messages": []}, True, r"messages must be a non-empty list"),
    "a message a string": (
        lambda body: {**body, "messages": ["hello"]},
        False,
        r"messages\[0\] must be an object with a string role",
    ),
    "max_tokens -5": (lambda body: {**body, "max_tokens": -5}, False, r"max_tokens=-5: ask for a whole number"),
    "a drafter folder of the server's": (
        lambda body: {**body, "generation_config": json.dumps({"drafter": "/etc"})},
        False,
        r"generation_config sets drafter=\"/etc\": a request may choose one of default, block",
    ),
    "max_tokens -5, streamed": (lambda body: {**body, "max_tokens": -5}, True, r"max_tokens=-5"),
    "max_tokens lots": (lambda body: {**body, "max_tokens": "lots"}, False, r"max_tokens='lots': ask for a whole"),
    "max_tokens 2.5": (lambda body: {**body, "max_tokens": 2.5}, False, r"max_tokens=2\.5"),
    "max_tokens 1e9": (lambda body: {**body, "max_tokens": 1e9}, False, r"needs .* of cache .* lower max_new_tokens"),
    "temperature hot": (lambda body: {**body, "temperature": "hot"}, False, r"temperature='hot': give 0 \(greedy\)"),
    "temperature -1": (lambda body: {**body, "temperature": -1}, False, r"temperature=-1"),
    "top_p 2": (lambda body: {**body, "top_p": 2}, False, r"top_p=2: give a number in \(0, 1\]"),
    "seed str": (lambda body: {**body, "seed": "11"}, False, r"seed='11': give a whole number"),
    "seed 2**70": (lambda body: {**body, "seed": 2**70}, False, r"seed=1180591620717411303424: .* to 2\*\*64 - 1"),
    "temperature Infinity": (lambda body: {**body, "temperature": float("inf")}, False, r"temperature=inf: .* up to 2"),
    "temperature 1e308": (lambda body: {**body, "temperature": 1e308}, False, r"temperature=1e\+308: .* up to 2"),
    "stop an empty string": (lambda body: {**body, "stop": [""]}, False, r'stop=\[""\]: give a non-empty string'),
    "logit_bias 101": (
        lambda body: {**body, "logit_bias": {"65": 101}},
        False,
        r"logit_bias '65': 101: .* -100 to 100",
    ),
    "generation_config not JSON": (
        lambda body: {**body, "generation_config": "{num_beams"},
        False,
        r"generation_config is not valid JSON",
    ),
    "generation_config a list": (
        lambda body: {**body, "generation_config": "[1]"},
        False,
        r"generation_config='\[1\]': give a JSON object as a string",
    ),
    "num_beams 2": (
        lambda body: {**body, "generation_config": json.dumps({"num_beams": 2})},
        False,
        r"hybrid.generate does not support num_beams=2: beam search is not speculative",
    ),
    "top_k a string in generation_config": (
        lambda body: {**body, "generation_config": json.dumps({"top_k": "5"})},
        False,
        r"top_k='5' \(str\): top_k takes a whole number",  # generation_config.top_k before transformers 5.25
    ),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS), ids=list(BAD_REQUESTS))
def test_a_bad_request_is_answered_400_with_the_reason(servers, case):
    change, stream, message = BAD_REQUESTS[case]
    client = servers["hybrid"]
    status, data = client.post(change(client.body(PROMPTS[0], 8, stream=stream, temperature=0)))
    assert status == 400, data
    error = json.loads(data)["error"]
    assert error["type"] == "invalid_request_error" and re.search(message, error["message"]), error


def test_after_bad_requests_the_next_one_is_right(servers, reference):
    _, _, answer = reference
    client = servers["hybrid"]
    for change, stream, _ in BAD_REQUESTS.values():
        assert client.post(change(client.body(PROMPTS[3], 8, stream=stream, temperature=0)))[0] == 400
    assert client.complete(PROMPTS[3], 12, temperature=0) == answer(PROMPTS[3], 12)
    assert client.stream(PROMPTS[3], 12, temperature=0)[0] == answer(PROMPTS[3], 12)


def test_a_temperature_alone_samples_as_openai_does_and_the_log_says_the_plain_server_differs(servers, reference):
    _, _, answer = reference
    greedy = answer(PROMPTS[2], 32)
    sampled = servers["hybrid"].complete(PROMPTS[2], 32, temperature=0.8, seed=5)
    assert sampled != greedy
    assert (
        "hybrid: temperature 0.8 asks for a sample: sampling (transformers serve alone decodes this request greedily"
        in servers["hybrid"].logged()
    )
    # The same draw as the plain server's when it is told to sample; told the temperature alone, it decodes greedily.
    told = {"generation_config": json.dumps({"do_sample": True, "temperature": 0.8}), "seed": 5}
    assert servers["plain"].complete(PROMPTS[2], 32, **told) == sampled
    assert servers["plain"].complete(PROMPTS[2], 32, temperature=0.8, seed=5) == greedy
    # A top_p below 1 without a temperature samples too (at temperature 1); an explicit do_sample is obeyed.
    assert servers["hybrid"].complete(PROMPTS[2], 32, top_p=0.95, seed=5) != greedy
    not_sampling = {"generation_config": json.dumps({"do_sample": False}), "temperature": 0.8}
    assert servers["hybrid"].complete(PROMPTS[2], 32, **not_sampling) == greedy
    assert servers["hybrid"].stream(PROMPTS[2], 32, temperature=0.8, seed=5)[0] == sampled


def test_a_malformed_request_is_refused_with_openais_error_object_and_the_next_one_is_fine(servers, reference):
    _, _, answer = reference
    client = servers["hybrid"]
    for body, reason in [
        (b"{not json", "JSON decode error: Expecting property name"),
        ('{"messages": "\xff"}'.encode("latin-1"), "not UTF-8: 'utf-8' codec can't decode byte 0xff"),
        (b"[1]", "Input should be a valid dictionary"),
    ]:
        status, data = client.post(body)
        assert status == 400, data
        error = json.loads(data)["error"]
        assert error["type"] == "invalid_request_error" and error["message"].startswith(
            f"the request body is not a JSON object ({reason}"
        ), error
    status, data = client.post({**client.body(PROMPTS[0], 8), "bogus": 1})
    assert status == 422 and "bogus" in json.loads(data)["error"]["message"]  # transformers' refusal, OpenAI's shape
    assert client.complete(PROMPTS[0], 12, temperature=0) == answer(PROMPTS[0], 12)


# Fields at their "off" value: they ask for nothing, and are accepted.
OFF_VALUES = {
    "n": 1, "best_of": 1, "logprobs": False, "top_logprobs": 0, "echo": False, "presence_penalty": 0,
    "frequency_penalty": 0.0, "response_format": {"type": "text"}, "text": {"format": {"type": "text"}}, "tools": [],
    "tool_choice": "auto", "parallel_tool_calls": True, "functions": [], "function_call": "auto",
    "modalities": ["text"], "store": False, "service_tier": "auto", "background": False, "truncation": "disabled",
    "include": [], "logit_bias": {}, "suffix": None, "audio": None,
}  # fmt: skip
ENDPOINTS = {"chat": ("chat_completion", "TransformersCompletionCreateParamsStreaming")}
ENDPOINTS["text"] = ("completion", "TransformersTextCompletionCreateParams")
ENDPOINTS["responses"] = ("response", "TransformersResponseCreateParamsStreaming")
VALID = {
    "chat": {"messages": [{"role": "user", "content": "hi"}]},
    "text": {"prompt": "hi"},
    "responses": {"input": "hi"},
}


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_every_request_field_is_honoured_or_refused_by_name(endpoint):
    """Each field transformers' request schema lets through is one hybrid's server honours, or one it refuses with
    its name (`param`) unless it asks for nothing (null, or its off value)."""
    import importlib

    from hybrid.serving import HONOURED, RequestFieldError, check_request

    module, schema = ENDPOINTS[endpoint]
    fields = getattr(importlib.import_module(f"transformers.cli.serving.{module}"), schema).__mutable_keys__
    assert HONOURED[endpoint] <= fields | {"user", "metadata", "safety_identifier"} | {
        f"prompt_cache_{n}" for n in ("key", "retention", "options")
    }
    for name in sorted(fields - HONOURED[endpoint]):
        check_request({**VALID[endpoint], name: None}, endpoint)
        if name in OFF_VALUES:
            check_request({**VALID[endpoint], name: OFF_VALUES[name]}, endpoint)
        with pytest.raises(RequestFieldError, match=rf"^{name}=.* is not served by hybrid: ") as refused:
            check_request({**VALID[endpoint], name: {"asks": "something"}}, endpoint)
        assert refused.value.param == name


def test_fields_hybrid_does_not_serve_are_refused_by_name_and_off_values_accepted(servers, reference):
    _, _, answer = reference
    client = servers["hybrid"]
    tool = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
    refused = {
        "n": 2,
        "logprobs": True,
        "top_logprobs": 2,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
        "response_format": {"type": "json_object"},
        "tools": [tool],  # the tiny model's chat template renders no tools
    }
    for name, value in refused.items():
        for stream in (False, True):
            status, data = client.post(client.body(PROMPTS[0], 8, temperature=0.8, stream=stream, **{name: value}))
            error = json.loads(data)["error"]
            assert status == 400 and error["param"] == name and error["message"].startswith(name), (name, error)
    status, data = client.post({"model": client.model, "prompt": "def f", "max_tokens": 4, "n": 2}, "/v1/completions")
    assert status == 400 and json.loads(data)["error"]["param"] == "n"
    off = {name: OFF_VALUES[name] for name in ("n", "logprobs", "top_logprobs", "tools", "logit_bias", *refused)}
    assert client.complete(PROMPTS[0], 12, temperature=0, **off) == answer(PROMPTS[0], 12)
    # logit_bias is honoured: +100 on "a" (token 65 of the printable tokenizer) makes every token an "a"
    assert client.complete(PROMPTS[0], 12, temperature=0, logit_bias={"65": 100}) == "a" * 12


def test_a_stop_sequence_is_left_out_of_the_answer_streamed_or_not(servers, reference):
    _, _, answer = reference
    full = answer(PROMPTS[1], 24)
    stop = full[10:13]  # an answer ends before the first place the stop sequence appears, as OpenAI's do
    expected = full[: full.index(stop)]
    client = servers["hybrid"]
    status, data = client.post(client.body(PROMPTS[1], 24, temperature=0, stop=[stop, "never said"]))
    choice = json.loads(data)["choices"][0]
    assert status == 200 and choice["message"]["content"] == expected and choice["finish_reason"] == "stop"
    text, events = client.stream(PROMPTS[1], 24, temperature=0, stop=stop)
    assert text == expected and events[-2]["choices"][0]["finish_reason"] == "stop"
    prompt = "def merge(a, b):"
    body = {"model": client.model, "prompt": prompt, "max_tokens": 16, "temperature": 0}
    full = json.loads(client.post(body, "/v1/completions")[1])["choices"][0]["text"]
    stopped = json.loads(client.post({**body, "stop": full[6:8]}, "/v1/completions")[1])["choices"][0]["text"]
    assert stopped == full[: full.index(full[6:8])]


def test_hybrid_serve_measures_before_it_is_ready(servers):
    """The verify-cost table a first request would measure is measured before /health answers, and the log says so;
    the plain server measures nothing."""
    assert servers["hybrid"].tables_at_ready and not servers["plain"].tables_at_ready
    logged = servers["hybrid"].logged()
    assert re.search(r"hybrid: measuring .* verify costs and kernels before serving", logged)
    assert logged.index("hybrid: measured in") < logged.index("Application startup complete")
    assert "hybrid: unlike plain transformers serve: a request field it would ignore is refused by name" in logged


def test_a_client_that_disconnects_mid_stream_aborts_its_generation(servers, reference):
    _, _, answer = reference
    client = servers["hybrid"]
    before = len(client.logged())
    connection = http.client.HTTPConnection("127.0.0.1", client.port, timeout=60)
    body = client.body(PROMPTS[3], 900, stream=True, temperature=0)
    connection.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: ")  # the stream has begun
    connection.sock.shutdown(socket.SHUT_RDWR)
    connection.close()
    assert client.complete(PROMPTS[0], 12, temperature=0) == answer(PROMPTS[0], 12)
    logged = re.findall(r"hybrid: .* drafter: (\d+) tokens in", client.logged()[before:])
    assert logged == ["12"]  # the abandoned request stopped without finishing its 900 tokens


# --------------------------------------------------------------------------- python -m hybrid serve


def test_hybrid_serve_logs_each_request(servers, reference):
    _, _, answer = reference
    client = servers["hybrid"]
    before = len(client.logged())
    assert client.complete(PROMPTS[0], 10, temperature=0) == answer(PROMPTS[0], 10)
    assert re.search(
        r"hybrid: prompt-lookup drafter: 10 tokens in \d+ verifier forwards: tau [0-9.]+, [0-9.]+ tok/s",
        client.logged()[before:],
    )


def test_hybrid_serve_refuses_what_would_bypass_hybrid(served, monkeypatch):
    from hybrid import cli, serving

    with pytest.raises(SystemExit, match=r"--continuous-batching serves requests without model.generate"):
        cli.main(["serve", str(served), "--", "--continuous-batching"])
    for extra in (["--api-server-count", "2"], ["--api-server-count=3"]):
        with pytest.raises(SystemExit, match=r"--api-server-count [23]: .* hybrid's request rules do not reach"):
            cli.main(["serve", str(served), "--", *extra])
    with pytest.raises(SystemExit):  # a folder's drafter is fixed when it is exported
        cli.main(["serve", str(served), "--drafter", "none"])
    with pytest.raises(SystemExit, match=r"has no custom_generate/generate.py: write the folder with"):
        cli.main(["serve", str(served.parent)])
    monkeypatch.setattr("transformers.utils.import_utils.is_serve_available", lambda: False)
    with pytest.raises(SystemExit, match=r'needs the serving extra: pip install -e "\.\[serving\]"'):
        serving.require_serving()


# --------------------------------------------------------------------------- python -m experiments.serving


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--servers", "hybrid,vllm"], r"--servers \['vllm'\]: choose from hybrid, plain, plain-cb"),
        (["--concurrency", "1,x"], r"--concurrency '1,x': give whole numbers"),
        (["--concurrency", "1,4", "--requests", "2"], r"--requests 2 < concurrency 4: every client sends one"),
        (["--max-tokens", "0"], r"--max-tokens must be at least 1"),
    ],
)
def test_the_load_generator_refuses_bad_settings_before_starting_anything(argv, message, capsys):
    from experiments import serving

    with pytest.raises(SystemExit):
        serving.parse_args(argv)
    assert re.search(message, capsys.readouterr().err)


def started_servers(monkeypatch) -> list:
    """Record every server experiments.serving starts."""
    from experiments import serving

    started = []

    class Recorded(serving.Server):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self)

    monkeypatch.setattr(serving, "Server", Recorded)
    return started


def test_the_load_generator_stops_its_servers_on_ctrl_c(monkeypatch, tmp_path):
    from experiments import serving

    started = started_servers(monkeypatch)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(serving, "run_level", interrupted)
    argv = ["--verifier", "tiny", "--drafter", "none", "--servers", "plain", "--concurrency", "1", "--requests", "1"]
    with pytest.raises(KeyboardInterrupt):
        serving.main([*argv, "--max-tokens", "4", "--out", str(tmp_path)])
    assert len(started) == 1 and started[0].process.poll() is not None  # stopped
    assert not (tmp_path / "requests.jsonl").exists()  # nothing half-measured is kept


@pytest.mark.slow
def test_the_load_generator_measures_every_server_and_resumes(monkeypatch, tmp_path):
    from experiments import serving

    started = started_servers(monkeypatch)
    argv = ["--verifier", "tiny", "--drafter", "prompt-lookup", "--concurrency", "1,2", "--requests", "2"]
    argv += ["--max-tokens", "8", "--out", str(tmp_path)]
    summary = serving.main(argv)
    assert len(started) == 3 and all(server.process.poll() is not None for server in started)
    assert {(s["server"], s["concurrency"]) for s in summary} == {(n, c) for n in serving.SERVERS for c in (1, 2)}
    for s in summary:
        assert s["requests"] == 2 and s["mean_tokens"] == 8 and s["same_text_as_plain"] == "2/2"
        assert (s["mean_tau"] is not None) == (s["server"] == "hybrid")
    from experiments import plots

    written = {"report.md", "summary.json"} | ({"latency.png"} if plots.available() else set())  # plots: optional
    assert written <= {p.name for p in tmp_path.iterdir()}
    assert serving.main(argv) == summary and len(started) == 3  # resumed: nothing left to measure, no server


# --------------------------------------------------------------------------- clients kept apart


@pytest.fixture(scope="module")
def store_server(verifier_dir, tmp_path_factory):
    """`python -m hybrid serve` of the verifier with the default drafter (lookup and online stores), as shipped:
    a store per client, streams in chunks of 16 tokens."""
    from experiments.serving import Server

    folder = export_served(tmp_path_factory.mktemp("served") / "tiny-default", verifier_dir, "default")
    server = Server("hybrid", folder, "cpu", tmp_path_factory.mktemp("server-logs") / "store.log")
    try:
        server.wait_ready(timeout=120)
        yield Client(server.port, str(folder), server.log)
    finally:
        server.stop()


def ask_as(client: Client, credential: str | None, body: dict) -> tuple[int, bytes, str]:
    """(status, body, the server's log line of the request) of a chat request sent with `credential` as its
    Authorization header (None: none)."""
    headers = {"content-type": "application/json"}
    if credential is not None:
        headers["authorization"] = credential
    before = len(client.logged())
    request = urllib.request.Request(
        f"http://127.0.0.1:{client.port}/v1/chat/completions", json.dumps(body).encode(), headers
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            status, data = response.status, response.read()
    except urllib.error.HTTPError as e:
        status, data = e.code, e.read()
    lines = [line for line in client.logged()[before:].splitlines() if " drafter: " in line]
    return status, data, lines[-1] if lines else ""


def test_a_clients_answers_draft_for_that_client_alone(store_server, reference):
    """The served online store is keyed by the bearer token: a repeated request from its client drafts from the first
    answer; the same request from another client, or from one without a token, drafts from nothing anyone asked."""
    _, _, answer = reference
    body = store_server.body(PROMPTS[2], 24, temperature=0)
    seen = re.compile(r"this client's online store: \d+/65536 tokens, (\d+) sequences seen")
    for credential, sequences in [
        ("Bearer alice-key", "1"),
        ("Bearer alice-key", "2"),
        ("Bearer bob-key", "1"),
        ("bearer  alice-key ", "3"),  # the same token, written otherwise
        (None, None),
        ("Bearer ", None),  # no token at all
    ]:
        status, data, line = ask_as(store_server, credential, body)
        assert status == 200 and json.loads(data)["choices"][0]["message"]["content"] == answer(PROMPTS[2], 24)
        found = seen.search(line)
        assert (found and found.group(1)) == sequences, (credential, line)
    settings = json.dumps({"hybrid_request": {"store": "shared"}})
    status, data, _ = ask_as(store_server, "Bearer mallory", {**body, "generation_config": settings})
    assert status == 400 and b"generation_config sets hybrid_request: the server sets it" in data


def test_a_stream_in_chunks_is_the_whole_answer(store_server, reference):
    _, _, answer = reference
    text, events = store_server.stream(PROMPTS[1], 40, temperature=0)
    assert text == answer(PROMPTS[1], 40) and events[-1]["usage"]["completion_tokens"] == 40


def test_the_store_policy_keys_clients_as_the_operator_chose():
    from hybrid.serving import StorePolicy

    alice, bob = StorePolicy().request("alice"), StorePolicy().request("bob")
    assert (
        alice["store"] != bob["store"]
        and "alice" not in alice["store"]
        and StorePolicy().request(None)["store"] is None
    )
    shared = StorePolicy("shared", stores=4, store_tokens=1000)
    assert (
        shared.request("alice")
        == shared.request(None)
        == {"store": "shared", "stores": 1, "store_tokens": 4000, "stream_chunk": 16}
    )
    assert StorePolicy("off").request("alice")["store"] is None
    for bad, message in [
        ({"scope": "everyone"}, "online store scope 'everyone': choose one of per-client, shared, off"),
        ({"stream_chunk": 0}, "stream_chunk=0: give whole numbers of at least 1"),
        ({"store_tokens": 10}, "max_tokens=10 cannot hold"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            StorePolicy(**bad)
