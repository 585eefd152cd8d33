"""`python -m hybrid serve`: hybrid behind `transformers serve`, an OpenAI-compatible server (chat and text
completions, streaming or not).

It serves a folder written by `hybrid.export` (by default the embedded verifier with the chosen drafter, exported
once into the cache) with `--trust-remote-code`, so every request's `model.generate` is `hybrid.generate`, and
prints each request's tau and tokens/s. Everything else is transformers' own server, with request rules on top
(`request_rules`): every field a request may send is honoured or refused by name (`FIELDS`), a bad request is
answered 400 with OpenAI's error object, a temperature above 0 samples, a stop sequence is left out of the answer, and
the model measures what its first call would (verify costs, kernels) before the server answers /health.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import hmac
import inspect
import json
import logging
import numbers
import os
import secrets
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hybrid.custom_generate import DRAFTER_NAMES
from hybrid.custom_generate.generate import SERVED, SERVED_DEFAULTS, SERVED_REQUEST, log_each_call

SERVING_EXTRA = 'pip install -e ".[serving]" (transformers[serving]: fastapi, uvicorn, openai)'
# transformers serve options that would take requests away from model.generate, i.e. from hybrid.
BYPASSING_OPTIONS = ("--continuous-batching",)


def require_serving() -> None:
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        raise SystemExit(f"python -m hybrid serve needs the serving extra: {SERVING_EXTRA}")


EXAMPLE_MESSAGES = '[{"role": "user", "content": "hello"}]'
logger = logging.getLogger("hybrid.serving")


@contextlib.contextmanager
def request_rules(policy: StorePolicy | None = None):
    """While `transformers serve` builds its app here, give its chat, text and responses handlers hybrid's request
    rules (`add_request_rules`, which keep its clients apart as `policy` says), make the app answer what it refuses
    (`answer_failures`), read each request's client (`ClientCredential`) and warm its model up before it serves
    (`warm_up_first`)."""
    from transformers.cli.serving import server

    build_server = server.build_server
    signature = inspect.signature(build_server)

    def build_with_rules(*args, **kwargs):
        handlers = signature.bind(*args, **kwargs).arguments
        clients = policy or StorePolicy()
        for name, endpoint in (
            ("chat_handler", "chat"),
            ("completion_handler", "text"),
            ("response_handler", "responses"),
        ):
            add_request_rules(handlers[name], endpoint, clients)
        app = answer_failures(build_server(*args, **kwargs))
        app.add_middleware(ClientCredential, header=clients.header)
        return warm_up_first(app, handlers["model_manager"])

    server.build_server = build_with_rules
    try:
        yield
    finally:
        server.build_server = build_server


def add_request_rules(handler, endpoint: str, clients: StorePolicy) -> None:
    """Check each request before transformers reads it, sample where it asks for a temperature above 0, pass on its
    logit_bias, refuse tools its chat template would drop, end its answer before a stop sequence, and give its
    `generate` its client's `SERVED_REQUEST` settings (`StorePolicy.request`, from the credential `ClientCredential`
    read as the request arrived)."""
    validate = handler._validate_request

    def validate_request(body: dict) -> None:
        validate(body)  # transformers' own: unknown fields are a 422
        check_request(body, endpoint)

    handler._validate_request = validate_request
    render = handler.render_messages

    def render_messages(engine, messages: list, body: dict) -> dict:
        check_tools_rendered(body, engine.processor)
        return render(engine, messages, body)

    handler.render_messages = render_messages
    if hasattr(handler, "_build_generation_kwargs"):  # transformers >= 5.25: a request's `generate` arguments
        build_kwargs = handler._build_generation_kwargs

        def build_generation_kwargs(body: dict, model_generation_config) -> dict:
            kwargs = build_kwargs(body, model_generation_config)
            kwargs["do_sample"] = sample_as_asked(body, kwargs.get("do_sample"))
            if body.get("logit_bias"):  # OpenAI's: a bias added to each named token's logit
                kwargs["sequence_bias"] = {(int(token),): float(bias) for token, bias in body["logit_bias"].items()}
            elif body.get("logit_bias") == {}:  # asks for nothing (transformers passes it on, and generate refuses it)
                kwargs.pop("sequence_bias", None)
            kwargs[SERVED_REQUEST] = clients.request(_CREDENTIAL.get())
            return kwargs

        handler._build_generation_kwargs = build_generation_kwargs
        if endpoint != "responses":  # the Responses API has no stop sequences
            for name in ("_streaming", "_non_streaming"):
                setattr(handler, name, ending_before_stops(getattr(handler, name)))
    else:  # transformers < 5.25: a request's GenerationConfig
        build_config = handler._build_generation_config

        def build_generation_config(body: dict, model_generation_config, use_cb: bool = False):
            config = build_config(body, model_generation_config, use_cb=use_cb)
            config.do_sample = sample_as_asked(body, config.do_sample)
            setattr(config, SERVED_REQUEST, clients.request(_CREDENTIAL.get()))  # carried as an attribute
            return config

        handler._build_generation_config = build_generation_config


STORE_SCOPES = ("per-client", "shared", "off")
_CREDENTIAL: contextvars.ContextVar[str | None] = contextvars.ContextVar("hybrid_credential", default=None)


@dataclass(frozen=True)
class StorePolicy:
    """Whose earlier answers a served request drafts from, and how its stream is chunked (`python -m hybrid serve`'s
    --online-store, --client-header, --store-clients, --store-tokens, --stream-chunk).

    scope: "per-client" (a client's answers draft for that client only: its store is keyed by the value of `header`,
        by default its bearer token; a request without one drafts from no store), "shared" (every request's answers
        draft for every request: anyone can tell by the time an answer takes whether someone was recently given it),
        or "off".
    stores, store_tokens: at most `stores` client stores of `store_tokens` tokens each (the least recently used
        dropped first); "shared" keeps one store of `stores * store_tokens` tokens, the same bound.
    stream_chunk: tokens per streamed chunk (`ChunkedStreamer`); 1 sends each verify step's tokens as it commits
        them, which shows the client how many drafted tokens each step accepted.
    """

    scope: str = "per-client"
    header: str = "authorization"
    stores: int = SERVED_DEFAULTS["stores"]
    store_tokens: int = SERVED_DEFAULTS["store_tokens"]
    stream_chunk: int = SERVED_DEFAULTS["stream_chunk"]

    def __post_init__(self):
        from drafters.online_store import check_sizes

        if self.scope not in STORE_SCOPES:
            raise ValueError(f"online store scope {self.scope!r}: choose one of {', '.join(STORE_SCOPES)}")
        if self.stores < 1 or self.stream_chunk < 1:
            raise ValueError(
                f"stores={self.stores}, stream_chunk={self.stream_chunk}: give whole numbers of at least 1"
            )
        check_sizes(self.store_tokens)

    def request(self, credential: str | None) -> dict:
        """The `SERVED_REQUEST` settings of a request whose client sent `credential` (the header's value, or None)."""
        settings = {"stores": self.stores, "store_tokens": self.store_tokens, "stream_chunk": self.stream_chunk}
        if self.scope == "shared":
            return settings | {"store": "shared", "stores": 1, "store_tokens": self.stores * self.store_tokens}
        if self.scope == "off" or not credential:
            return settings | {"store": None}
        # Keyed by a salted hash, so the decoding process and its log never hold a client's credential.
        return settings | {"store": hmac.new(_SALT, credential.encode(), hashlib.sha256).hexdigest()[:32]}


_SALT = secrets.token_bytes(16)  # this server's, for `StorePolicy.request`'s keys


class ClientCredential:
    """Reads a request's `header` (its client's credential) into `_CREDENTIAL` for the request's handling; a plain
    ASGI middleware, as transformers' own are."""

    def __init__(self, app, header: str):
        self.app, self.header = app, header.lower().encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        value = next((v.decode("latin-1") for k, v in scope["headers"] if k.lower() == self.header), "")
        scheme, _, rest = value.strip().partition(" ")
        credential = rest.strip() if scheme.lower() == "bearer" else value.strip()  # "Bearer" alone is no token
        token = _CREDENTIAL.set(credential or None)
        try:
            await self.app(scope, receive, send)
        finally:
            _CREDENTIAL.reset(token)


class RequestFieldError(ValueError):
    """A request field hybrid refuses: answered 400 with OpenAI's error object, whose `param` names the field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


# Fields of OpenAI's request schemas (those transformers' handlers let through) that hybrid's server honours, per
# endpoint: read by transformers' handlers or by the rules here. Labels that ask nothing of the answer (user,
# metadata, cache keys) count as honoured.
LABELS = {"user", "metadata", "safety_identifier", "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options"}
HONOURED = {
    "chat": {
        "messages", "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stream",
        "stream_options", "stop", "generation_config", "chat_template_kwargs", "tools", "logit_bias",
    } | LABELS,
    "text": {
        "prompt", "model", "max_tokens", "temperature", "top_p", "seed", "stream", "stream_options", "stop",
        "generation_config", "logit_bias",
    } | LABELS,
    "responses": {
        "input", "model", "instructions", "max_output_tokens", "temperature", "top_p", "seed", "stream",
        "generation_config", "tools",
    } | LABELS,
}  # fmt: skip


def _zero(value) -> bool:
    return _is_number(value) and value == 0


def _is(*offs):
    return lambda value: any(value == off and type(value) is type(off) for off in offs)


# field -> (whether a value asks for nothing, what to do instead). Any other field not honoured is refused unless null.
FIELDS = {
    "n": (_is(1), "hybrid answers one choice per request: send n requests (sampled ones with different seeds)"),
    "best_of": (_is(1), "hybrid answers one choice per request: leave best_of out"),
    "logprobs": (_is(False), "hybrid's server returns no log-probabilities: leave logprobs out"),
    "top_logprobs": (_zero, "hybrid's server returns no log-probabilities: leave top_logprobs out"),
    "echo": (_is(False), "the answer does not repeat the prompt: leave echo out"),
    "presence_penalty": (
        _zero,
        "OpenAI's presence and frequency penalties are not served (transformers serve turns frequency_penalty into "
        "its multiplicative repetition_penalty, another rule): leave them at 0, or set generation_config's "
        '"repetition_penalty" for that rule',
    ),
    "response_format": (
        lambda value: value == {"type": "text"},
        'hybrid decodes no structured output: leave response_format out or give {"type": "text"}',
    ),
    "text": (
        lambda value: value == {"format": {"type": "text"}},
        'hybrid decodes no structured output: leave text out or give {"format": {"type": "text"}}',
    ),
    "tools": (lambda value: value == [], "the model's chat template renders no tools"),
    "tool_choice": (_is("auto"), 'the model calls a tool as its chat template lets it: leave tool_choice "auto"'),
    "parallel_tool_calls": (_is(True), "the model calls tools as its chat template lets it: leave it true"),
    "functions": (lambda value: value == [], "give tools instead (functions is OpenAI's deprecated form)"),
    "function_call": (_is("auto"), "give tools instead (function_call is OpenAI's deprecated form)"),
    "modalities": (lambda value: value == ["text"], 'hybrid answers text only: leave modalities out or ["text"]'),
    "store": (_is(False), "hybrid's server keeps no answers: leave store out"),
    "service_tier": (_is("auto", "default"), 'one tier is served: leave service_tier out or "auto"'),
    "background": (_is(False), "requests are answered while the client waits: leave background out"),
    "truncation": (_is("disabled"), 'a prompt too long is refused, never truncated: leave truncation "disabled"'),
    "include": (lambda value: value == [], "hybrid's server returns nothing more: leave include out"),
    "suffix": (
        lambda value: False,
        "hybrid decodes no fill-in-the-middle: the model would not see the suffix (transformers serve appends it to "
        "the answer); leave suffix out",
    ),
}
FIELDS["frequency_penalty"] = FIELDS["presence_penalty"]
FIELDS["top_logprobs"] = (FIELDS["top_logprobs"][0], FIELDS["logprobs"][1])
# A seed is torch's: any whole number from -2**63 to 2**64 - 1.
SEEDS = range(-(2**63), 2**64)
MAX_TEMPERATURE = 2  # OpenAI's bound: above it, OpenAI answers 400 (at 1e308 tokens are uniform noise)
MAX_LOGIT_BIAS = 100  # OpenAI's bound: +-100 bans or forces a token


def check_fields(body: dict, endpoint: str) -> None:
    """Refuse, by name, a field the endpoint does not honour (`HONOURED`) unless it asks for nothing (`FIELDS`)."""
    for name, value in body.items():
        if name in HONOURED[endpoint] or value is None:
            continue
        asks_nothing, fix = FIELDS.get(name, (lambda value: False, f"leave {name} out"))
        if not asks_nothing(value):
            raise RequestFieldError(name, f"{name}={json.dumps(value)[:80]} is not served by hybrid: {fix}")


def check_request(body: dict, endpoint: str) -> None:
    """Raise ValueError (answered 400) on a field hybrid does not honour (`check_fields`) and on one transformers
    would trip over with a bare 500 or decode wrongly: messages, token counts, sampling numbers, seed, stop, logit_bias,
    generation_config, stream."""
    check_fields(body, endpoint)
    if endpoint == "chat":
        check_messages(body.get("messages"))
    for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        value = body.get(name)
        if value is not None and not (_is_number(value) and float(value).is_integer() and value >= 1):
            raise RequestFieldError(name, f"{name}={value!r}: ask for a whole number of new tokens, at least 1")
    temperature = body.get("temperature")
    if temperature is not None and not (_is_number(temperature) and 0 <= temperature <= MAX_TEMPERATURE):
        raise RequestFieldError(
            "temperature",
            f"temperature={temperature!r}: give 0 (greedy) or a number above 0 up to {MAX_TEMPERATURE} (sample at it)",
        )
    top_p = body.get("top_p")
    if top_p is not None and not (_is_number(top_p) and 0 < top_p <= 1):
        raise RequestFieldError("top_p", f"top_p={top_p!r}: give a number in (0, 1] (1: no nucleus filter)")
    seed = body.get("seed")
    if seed is not None and not (isinstance(seed, int) and not isinstance(seed, bool) and seed in SEEDS):
        raise RequestFieldError("seed", f"seed={seed!r}: give a whole number from -2**63 to 2**64 - 1")
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise RequestFieldError("stream", f"stream={body['stream']!r}: give true or false")
    check_stop(body.get("stop"))
    check_logit_bias(body.get("logit_bias"))
    settings = request_settings(body)
    if SERVED_REQUEST in settings:  # where a client could name another's store
        raise RequestFieldError(
            "generation_config", f"generation_config sets {SERVED_REQUEST}: the server sets it; leave it out"
        )
    drafter = settings.get("drafter", DRAFTER_NAMES[0])
    if (
        drafter is not None and drafter not in DRAFTER_NAMES
    ):  # a folder would be read from the server's disk at a stranger's choice
        raise RequestFieldError(
            "generation_config",
            f"generation_config sets drafter={json.dumps(drafter)[:80]}: a request may choose one of "
            f"{', '.join(DRAFTER_NAMES)}; a drafter folder is the operator's (`python -m hybrid serve --drafter DIR`)",
        )


def check_stop(stop) -> None:
    stops = [stop] if isinstance(stop, str) else stop
    if stop is not None and not (isinstance(stops, list) and all(isinstance(s, str) and s for s in stops)):
        raise RequestFieldError("stop", f"stop={json.dumps(stop)[:80]}: give a non-empty string or a list of them")


def check_logit_bias(logit_bias) -> None:
    if logit_bias is None:
        return
    if not isinstance(logit_bias, dict):
        raise RequestFieldError("logit_bias", f"logit_bias={logit_bias!r}: give an object of token id -> bias")
    for token, bias in logit_bias.items():
        if not (token.isdigit() and _is_number(bias) and abs(bias) <= MAX_LOGIT_BIAS):
            raise RequestFieldError(
                "logit_bias",
                f"logit_bias {token!r}: {bias!r}: give a token id (a whole number, as a string) and a bias from "
                f"-{MAX_LOGIT_BIAS} to {MAX_LOGIT_BIAS}",
            )


def check_tools_rendered(body: dict, processor) -> None:
    """Refuse tools that the model's chat template would drop: transformers serve renders a request's tools through
    the template, which for a template that never reads `tools` decodes as if none were given."""
    template = getattr(processor, "chat_template", None) or getattr(
        getattr(processor, "tokenizer", None), "chat_template", None
    )
    templates = template.values() if isinstance(template, dict) else [template or ""]
    if body.get("tools") and not any("tools" in text for text in templates):
        raise RequestFieldError(
            "tools",
            "tools: this model's chat template renders no tools, so the model would never see them; leave "
            "tools out, or serve a model whose chat template takes tools",
        )


def check_messages(messages) -> None:
    if messages is None:
        raise ValueError(f"messages is required: the conversation so far, e.g. {EXAMPLE_MESSAGES}")
    if not isinstance(messages, list) or not messages:
        raise ValueError(
            f"messages must be a non-empty list of messages, e.g. {EXAMPLE_MESSAGES}, got {json.dumps(messages)[:80]}"
        )
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        parts_ok = isinstance(content, (str, type(None))) or (
            isinstance(content, list) and all(isinstance(part, dict) and "type" in part for part in content)
        )
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not parts_ok:
            raise ValueError(
                f"messages[{i}] must be an object with a string role and a content (a string, or a list of parts "
                f'each with a "type"), e.g. {EXAMPLE_MESSAGES[1:-1]}, got {json.dumps(message)[:80]}'
            )


def request_settings(body: dict) -> dict:
    """The settings of a request's `generation_config` field: a string holding a JSON object (or absent)."""
    text = body.get("generation_config")
    if text is None:
        return {}
    try:
        settings = json.loads(text) if isinstance(text, str) else None
    except json.JSONDecodeError as e:
        raise ValueError(f"generation_config is not valid JSON ({e}): give a JSON object as a string") from None
    if not isinstance(settings, dict):
        raise ValueError(
            f"generation_config={text!r}: give a JSON object as a string, e.g. " + json.dumps('{"do_sample": true}')
        )
    return settings


def sample_as_asked(body: dict, do_sample: bool | None) -> bool | None:
    """Whether the request samples: where it has a temperature above 0 (or, without a temperature, a top_p below 1),
    yes, as OpenAI's API does, unless its generation_config sets do_sample. transformers serve keeps the model's
    do_sample there (greedy for a model that does not set it), so where the two differ this says so in the log."""
    temperature, top_p = body.get("temperature"), body.get("top_p")
    asked = temperature > 0 if temperature is not None else top_p is not None and top_p < 1
    if asked and not do_sample and "do_sample" not in request_settings(body):
        setting = f"temperature {temperature}" if temperature is not None else f"top_p {top_p}"
        logger.info(
            "%s asks for a sample: sampling (transformers serve alone decodes this request greedily, as do_sample "
            "is not set; set generation_config's do_sample to choose)",
            setting,
        )
        return True
    return do_sample


def ending_before_stops(respond):
    """A handler's `_streaming` or `_non_streaming`, given an engine whose answers end before their first stop
    sequence: transformers serve stops at one but keeps its text, where OpenAI leaves it out."""

    def respond_without_stops(request_id, engine, inputs, generation_kwargs, *rest, **kwargs):
        stops = generation_kwargs.get("stop_strings")
        if stops:
            engine = StopsLeftOut(engine, [stops] if isinstance(stops, str) else stops)
        return respond(request_id, engine, inputs, generation_kwargs, *rest, **kwargs)

    return respond_without_stops


class StopsLeftOut:
    """A model's `EngineClient` whose answers end before the first of `stops`: a whole answer is cut there, a
    streamed one holds back text that may begin a stop sequence until the next text settles it."""

    def __init__(self, engine, stops: list[str]):
        self.engine, self.stops = engine, stops

    def __getattr__(self, name):
        return getattr(self.engine, name)

    async def generate_non_streaming(self, inputs: dict, generation_kwargs: dict):
        text, prompt_length, generated = await self.engine.generate_non_streaming(inputs, generation_kwargs)
        return text[: self.stop_at(text)], prompt_length, generated

    def generate_streaming(self, inputs: dict, generation_kwargs: dict, **kwargs):
        queue, streamer = self.engine.generate_streaming(inputs, generation_kwargs, **kwargs)
        streamer._queue = StreamedStopsLeftOut(queue, self)  # where the streamer puts each text as it decodes it
        return queue, streamer

    def stop_at(self, text: str) -> int:
        """Where the first stop sequence in `text` begins (len(text) if none does)."""
        return min((i for i in (text.find(stop) for stop in self.stops) if i >= 0), default=len(text))

    def undecided(self, text: str) -> int:
        """How many characters at the end of `text` may begin a stop sequence."""
        return max((n for stop in self.stops for n in range(1, len(stop)) if text.endswith(stop[:n])), default=0)


class StreamedStopsLeftOut:
    """The queue a stream's texts are put into, on their way to `queue`: text up to the first stop sequence, none
    after it; other items (the end, a tool call, an error) as they come, after the text held back before them."""

    def __init__(self, queue, stops: StopsLeftOut):
        self.queue, self.stops = queue, stops
        self.held, self.stopped = "", False

    def put_nowait(self, item) -> None:
        if type(item) is not str:  # the end (None), a tool call, reasoning: what was held back was no stop
            if self.held and not self.stopped:
                self.queue.put_nowait(self.held)
            self.held = ""
            self.queue.put_nowait(item)
            return
        if self.stopped:
            return
        text = self.held + item
        stop_at = self.stops.stop_at(text)
        self.stopped = stop_at < len(text)
        settled = stop_at if self.stopped else len(text) - self.stops.undecided(text)
        self.held = "" if self.stopped else text[settled:]
        if settled:
            self.queue.put_nowait(text[:settled])


def warm_up_first(app, model_manager):
    """Before the app serves (its lifespan starts before uvicorn listens, so /health waits too), run
    `hybrid.custom_generate.warm_up` in each loaded model's process: what a first call would measure (verify costs,
    kernel choice, once per machine, cached on disk) is measured here, not during a client's request."""
    from hybrid.custom_generate.generate import warm_up

    lifespan = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def warmed_lifespan(app):
        engines = getattr(model_manager, "engines", {})  # transformers >= 5.25: the model's process, loaded already
        for model_id, engine in [(m, e) for m, e in engines.items() if hasattr(e, "submit")]:
            logger.info(
                "measuring %s's verify costs and kernels before serving (once per machine, then cached on disk)",
                model_id,
            )
            start = time.perf_counter()
            await engine.submit(warm_up)
            logger.info("measured in %.1f s: ready", time.perf_counter() - start)
        async with lifespan(app) as state:
            yield state

    app.router.lifespan_context = warmed_lifespan
    return app


def answer_failures(app):
    """Answer a request that `generate` or the checks refuse (ValueError, TypeError, a cache that cannot fit) with
    400 and the reason; a body that is not a JSON object with 400 too, and transformers' own refusals (HTTPException)
    with their status; any other failure, a drafter's broken contract included, with 500 and the reason. The body is
    always OpenAI's error object, which OpenAI clients read, with the field at fault as its `param` where one is."""
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException  # FastAPI's own, and the one it raises on a body it cannot parse

    from drafters import DraftError
    from verifiers.memory import CacheMemoryError

    def error_object(status: int, kind: str, message: str, param: str | None = None):
        error = {"message": message, "type": kind, "param": param, "code": None}
        return JSONResponse({"error": error}, status_code=status)

    def answer(status: int, kind: str):
        async def respond(request, exc):
            return error_object(status, kind, str(exc), getattr(exc, "param", None))

        return respond

    def not_a_json_object(reasons: str):
        return error_object(
            400,
            "invalid_request_error",
            f"the request body is not a JSON object ({reasons}): send one, UTF-8 encoded, e.g. "
            f'{{"messages": {EXAMPLE_MESSAGES}}}',
        )

    async def body_refused(request, exc):
        return not_a_json_object(
            "; ".join(f"{e.get('msg')}: {e['ctx']['error']}" if "ctx" in e else e.get("msg") for e in exc.errors())
        )

    async def refused_by_transformers(request, exc):
        if isinstance(exc.__cause__, UnicodeDecodeError):  # FastAPI's "error parsing the body" of one not UTF-8
            return not_a_json_object(f"not UTF-8: {exc.__cause__}")
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error_object(exc.status_code, kind, str(exc.detail))

    for refused in (ValueError, TypeError, CacheMemoryError):
        app.add_exception_handler(refused, answer(400, "invalid_request_error"))
    app.add_exception_handler(RequestValidationError, body_refused)
    app.add_exception_handler(HTTPException, refused_by_transformers)
    app.add_exception_handler(DraftError, answer(500, "server_error"))
    app.add_exception_handler(Exception, answer(500, "server_error"))
    return app


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def option_value(arguments: list[str], name: str) -> str | None:
    """The value given to the command-line option `name` in `arguments` (`name V` or `name=V`; the last wins)."""
    value = None
    for i, argument in enumerate(arguments):
        if argument == name and i + 1 < len(arguments):
            value = arguments[i + 1]
        elif argument.startswith(f"{name}="):
            value = argument.split("=", 1)[1]
    return value


def served_default(drafter: str, verifier: str | Path | None = None) -> Path:
    """The served folder of `verifier` (None: the embedded default verifier) with `drafter` (a name or a drafter
    folder). The embedded verifier's is exported into the cache on first use; a verifier folder's on every start (it
    may have changed since)."""
    import hashlib

    from hybrid.export import GLUE, export_served, glue_source
    from verifiers.embedded import MODEL_NAME, cache_dir

    if verifier is None and drafter in DRAFTER_NAMES:
        out = cache_dir() / "served" / f"{MODEL_NAME}-{drafter}"
        glue = out / GLUE
        if glue.is_file() and glue.read_text() == glue_source(drafter) and (out / "config.json").is_file():
            return out
    else:
        key = hashlib.sha256(f"{verifier and Path(verifier).resolve()}|{drafter}".encode()).hexdigest()[:12]
        out = cache_dir() / "served" / f"{Path(verifier).name if verifier else MODEL_NAME}-{key}"
    print(f"hybrid: exporting {verifier or 'the default verifier'} with drafter {drafter!r} to {out}", file=sys.stderr)
    return export_served(out, verifier, drafter)


def serve(
    folder: str | Path,
    device: str,
    host: str,
    port: int,
    transformers_args: list[str],
    policy: StorePolicy | None = None,
) -> None:
    """Run `transformers serve folder --trust-remote-code` in this process (from transformers 5.25 its model decodes
    in a process the server spawns), logging each request's statistics, its clients kept apart as `policy` says."""
    require_serving()
    from hybrid.export import GLUE

    folder = Path(folder)
    if not (folder / GLUE).is_file():
        raise SystemExit(f"{folder} has no {GLUE}: write the folder with `python -m hybrid export-served {folder}`")
    bypassing = [a for a in transformers_args if a.split("=")[0] in BYPASSING_OPTIONS]
    if bypassing:
        raise SystemExit(
            f"{bypassing[0]} serves requests without model.generate, so hybrid would not run: "
            f"run `transformers serve {folder} {bypassing[0]}` for transformers' own batching instead"
        )
    api_servers = option_value(transformers_args, "--api-server-count")
    if api_servers not in (None, "1"):
        raise SystemExit(
            f"--api-server-count {api_servers}: transformers serve's API servers beyond the first are processes of "
            "their own, which hybrid's request rules do not reach (a request's temperature would not make it "
            "sample there); run one API server (the default)"
        )
    os.environ[SERVED] = "1"  # for this process and the ones transformers serve starts
    log_each_call()
    logger.info(
        "unlike plain transformers serve: a request field it would ignore is refused by name unless at its off value "
        "(logit_bias is honoured), temperature above 2 and seeds outside torch's range are refused, every refusal is "
        "OpenAI's error object, answers end before their stop sequence, a temperature above 0 samples"
    )

    from transformers.cli.transformers import app

    arguments = ["serve", str(folder), "--trust-remote-code", "--device", device, "--host", host, "--port", str(port)]
    with request_rules(policy):
        app(arguments + transformers_args, prog_name="transformers")
