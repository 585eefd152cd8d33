"""`python -m hybrid serve`: hybrid behind `transformers serve`, an OpenAI-compatible server (chat and text
completions, streaming or not).

It serves a folder written by `hybrid.export` (by default the embedded verifier with the chosen drafter, exported
once into the cache) with `--trust-remote-code`, so every request's `model.generate` is `hybrid.generate`, and
prints each request's tau and tokens/s. Everything else is transformers' own server, with two request rules on
top (`request_rules`): a bad request is answered 400 with the reason, and a temperature above 0 samples.
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
    rules (`check_request`, `sample_as_asked`) and make the app answer what it refuses (`answer_failures`); keep its
    clients apart as `policy` says (`keep_clients_apart`)."""
    from transformers.cli.serving import server

    build_server = server.build_server
    signature = inspect.signature(build_server)

    def build_with_rules(*args, **kwargs):
        handlers = signature.bind(*args, **kwargs).arguments
        for name in ("chat_handler", "completion_handler", "response_handler"):
            add_request_rules(handlers[name], chat=name == "chat_handler")
        app = answer_failures(build_server(*args, **kwargs))
        return keep_clients_apart(
            app,
            [handlers[name] for name in ("chat_handler", "completion_handler", "response_handler")],
            policy or StorePolicy(),
        )

    server.build_server = build_with_rules
    try:
        yield
    finally:
        server.build_server = build_server


def add_request_rules(handler, chat: bool) -> None:
    """Check each request before transformers reads it, and sample where it asks for a temperature above 0."""
    validate = handler._validate_request

    def validate_request(body: dict) -> None:
        validate(body)  # transformers' own: unknown fields are a 422
        check_request(body, chat)

    handler._validate_request = validate_request
    if hasattr(handler, "_build_generation_kwargs"):  # transformers >= 5.25: a request's `generate` arguments
        build_kwargs = handler._build_generation_kwargs

        def build_generation_kwargs(body: dict, model_generation_config) -> dict:
            kwargs = build_kwargs(body, model_generation_config)
            kwargs["do_sample"] = sample_as_asked(body, kwargs.get("do_sample"))
            return kwargs

        handler._build_generation_kwargs = build_generation_kwargs
    else:  # transformers < 5.25: a request's GenerationConfig
        build_config = handler._build_generation_config

        def build_generation_config(body: dict, model_generation_config, use_cb: bool = False):
            config = build_config(body, model_generation_config, use_cb=use_cb)
            config.do_sample = sample_as_asked(body, config.do_sample)
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


def keep_clients_apart(app, handlers: list, policy: StorePolicy):
    """Give each request's `generate` its client's `SERVED_REQUEST` settings (`StorePolicy.request`), from the header
    the policy names, which the app reads into `_CREDENTIAL` as each request arrives. A request that sets them in its
    generation_config is refused: they are the server's to set."""

    def settings(body: dict) -> dict:
        if SERVED_REQUEST in request_settings(body):
            raise ValueError(f"generation_config sets {SERVED_REQUEST}: the server sets it; leave it out")
        return policy.request(_CREDENTIAL.get())

    for handler in handlers:
        if hasattr(handler, "_build_generation_kwargs"):  # transformers >= 5.25: a request's `generate` arguments
            build_kwargs = handler._build_generation_kwargs

            def build_generation_kwargs(body: dict, model_generation_config, build_kwargs=build_kwargs) -> dict:
                return build_kwargs(body, model_generation_config) | {SERVED_REQUEST: settings(body)}

            handler._build_generation_kwargs = build_generation_kwargs
        else:  # transformers < 5.25: a request's GenerationConfig, which carries them as an attribute
            build_config = handler._build_generation_config

            def build_generation_config(body: dict, model_generation_config, use_cb=False, build_config=build_config):
                config = build_config(body, model_generation_config, use_cb=use_cb)
                setattr(config, SERVED_REQUEST, settings(body))
                return config

            handler._build_generation_config = build_generation_config
    app.add_middleware(ClientCredential, header=policy.header)
    return app


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


def check_request(body: dict, chat: bool) -> None:
    """Raise ValueError (answered 400) on a field transformers would trip over with a bare 500: messages, token
    counts, sampling numbers, seed, generation_config, stream."""
    if chat:
        check_messages(body.get("messages"))
    for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        value = body.get(name)
        if value is not None and not (_is_number(value) and float(value).is_integer() and value >= 1):
            raise ValueError(f"{name}={value!r}: ask for a whole number of new tokens, at least 1")
    temperature = body.get("temperature")
    if temperature is not None and not (_is_number(temperature) and temperature >= 0):
        raise ValueError(f"temperature={temperature!r}: give 0 (greedy) or a number above 0 (sample at it)")
    top_p = body.get("top_p")
    if top_p is not None and not (_is_number(top_p) and 0 < top_p <= 1):
        raise ValueError(f"top_p={top_p!r}: give a number in (0, 1] (1: no nucleus filter)")
    seed = body.get("seed")
    if seed is not None and not (isinstance(seed, int) and not isinstance(seed, bool)):
        raise ValueError(f"seed={seed!r}: give a whole number")
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise ValueError(f"stream={body['stream']!r}: give true or false")
    request_settings(body)


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


def answer_failures(app):
    """Answer a request that `generate` or the checks refuse (ValueError, TypeError, a cache that cannot fit) with
    400 and the reason; any other failure, a drafter's broken contract included, with 500 and the reason. The body
    is OpenAI's error object, which OpenAI clients read."""
    from fastapi.responses import JSONResponse

    from drafters import DraftError
    from verifiers.cache import CacheMemoryError

    def answer(status: int, kind: str):
        async def respond(request, exc):
            error = {"message": str(exc), "type": kind, "param": None, "code": None}
            return JSONResponse({"error": error}, status_code=status)

        return respond

    for refused in (ValueError, TypeError, CacheMemoryError):
        app.add_exception_handler(refused, answer(400, "invalid_request_error"))
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

    from transformers.cli.transformers import app

    arguments = ["serve", str(folder), "--trust-remote-code", "--device", device, "--host", host, "--port", str(port)]
    with request_rules(policy):
        app(arguments + transformers_args, prog_name="transformers")
