"""`model.generate` through `hybrid.generate`: the function behind transformers' `custom_generate`.

transformers runs a folder's `custom_generate/generate.py` in place of `model.generate`, for
`model.generate(ids, custom_generate=DIR, trust_remote_code=True)` and for every call on a model loaded with
`from_pretrained(DIR, trust_remote_code=True)` (which is how `transformers serve DIR --trust-remote-code` loads it).
The file `python -m hybrid export-served` writes there names a drafter and calls `generate` below.
"""

from __future__ import annotations

import copy
import inspect
import json
import logging
import os
import sys
import threading
import weakref
from pathlib import Path

import torch
from transformers import GenerationMixin

import hybrid
from drafters import Drafter, PromptLookupDrafter
from drafters.online_store import OnlineStore, OnlineStores
from verifiers import CacheMemoryError

# One line per call: tokens, verifier forwards, tau and tokens/s (`python -m hybrid serve` prints them).
logger = logging.getLogger("hybrid.serving")

# Set to "1" by `python -m hybrid serve` for its process and those transformers serve starts (from 5.25 a model
# decodes in a process of its own, which inherits the environment and nothing else): there each call's line goes to
# stderr, and what hybrid refuses in a request is raised as a ValueError, which transformers serve answers 400.
SERVED = "HYBRID_SERVED"

DRAFTER_NAMES = ("default", "block", "prompt-lookup", "none")

# A served request's privacy settings, put among its generate arguments by `python -m hybrid serve`
# (`hybrid.serving.add_request_rules`), never by the client: {"store": the key of the client's online store, or None
# for none; "stores", "store_tokens": the bound on stores kept and each one's tokens; "stream_chunk": tokens per
# streamed chunk}. A served call without it (plain `transformers serve` with HYBRID_SERVED=1) gets `SERVED_DEFAULTS`.
SERVED_REQUEST = "hybrid_request"
SERVED_DEFAULTS = {"store": None, "stores": 32, "store_tokens": 1 << 16, "stream_chunk": 16}

# `model.generate`'s parameters in positional order (after self): a loaded folder's `model.generate(ids, config)`
# arrives here as `*args`.
_POSITIONAL = [
    name
    for name, parameter in inspect.signature(GenerationMixin.generate).parameters.items()
    if parameter.kind is parameter.POSITIONAL_OR_KEYWORD
][1:]

# verifier -> {drafter name: drafter}; weak, so a drafter lives as long as its verifier and no longer
# (`transformers serve` unloads an idle model).
_DRAFTERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_STORES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # verifier -> its served clients' OnlineStores
_BUILDING = threading.Lock()  # two threads' first calls on one model build its drafter once


def generate(*args, model=None, drafter: str | Drafter | None = "default", **kwargs):
    """`model.generate(*args, **kwargs)`, decoded by `hybrid.generate` with `drafter`: a name (DRAFTER_NAMES) or a
    drafter folder, built once per model; a `drafters.Drafter` as it is; None for plain decoding through the engine.

    Returns what `model.generate` returns (with `return_stats=True`, `(output, stats)` as `hybrid.generate` does)
    and logs each call's `GenerationStats.summary()` on the "hybrid.serving" logger.
    """
    if model is None:
        raise TypeError(
            "hybrid's custom_generate is a folder, not a Callable: for a Callable, transformers prepares the logits "
            "processors and a cache itself and keeps the streamer from it; pass custom_generate=DIR (a folder "
            "written by `python -m hybrid export-served DIR`) with trust_remote_code=True, or call hybrid.generate"
        )
    if len(args) > len(_POSITIONAL):
        raise TypeError(f"generate() takes at most {len(_POSITIONAL)} positional arguments ({len(args)} given)")
    for name, value in zip(_POSITIONAL, args):
        if name in kwargs:
            raise TypeError(f"generate() got multiple values for argument {name!r}")
        kwargs[name] = value
    if isinstance(drafter, Path):
        drafter = str(drafter)
    label = "no" if drafter in (None, "none") else drafter if isinstance(drafter, str) else type(drafter).__name__
    return_stats = kwargs.pop("return_stats", False)
    served = os.environ.get(SERVED) == "1"
    request = served_request(kwargs, served)
    store = None
    if isinstance(drafter, str):
        drafter = cached_drafter(model, drafter)
        # Each call drafts with its own copy (a server answers requests on several threads); the copies share the
        # weights and the online store, which is how a request learns from the ones before it. A served request's
        # copy drafts from its client's store instead (or none), never from another client's answers.
        drafter = drafter.fork() if drafter is not None else None
        if request is not None and drafter is not None:
            store = client_store(model, request)
            drafter = drafting_from(drafter, store)
    if request is not None and kwargs.get("streamer") is not None and request["stream_chunk"] > 1:
        kwargs["streamer"] = ChunkedStreamer(kwargs["streamer"], request["stream_chunk"])
    if served:
        log_each_call()
    try:
        output, stats = hybrid.generate(model, drafter=drafter, return_stats=True, **kwargs)
    except (TypeError, CacheMemoryError) as error:  # a setting of the wrong kind, a length that cannot be cached
        if not served:
            raise
        raise ValueError(str(error)) from error  # the request's fault: transformers serve passes on a ValueError
    mine = f"; this client's {store.summary()}" if store is not None else ""
    logger.info("%s drafter: %s%s", label, stats.summary(), mine)
    return (output, stats) if return_stats else output


def warm_up(model, processor=None) -> None:
    """Run now what the first call on `model`, loaded from a served folder, would pay for (as `hybrid.load_default`
    does): its drafter built, the default scheduler's verify-cost table and kernel choice (measured once per machine,
    cached on disk), what those kernels need made, and the model's probes. `python -m hybrid serve` runs it in the
    model's process before the server answers /health."""
    from hybrid.export import served_drafter
    from schedulers.cost_aware import default_scheduler
    from verifiers.cost_table import prepare_kernels
    from verifiers.support import settle_probes

    drafter = cached_drafter(model, served_drafter(model.name_or_path))
    if drafter is not None:
        default_scheduler(drafter, model).start(drafter, model=model)
    prepare_kernels(model)
    settle_probes(model)


def served_request(kwargs: dict, served: bool) -> dict | None:
    """The request's `SERVED_REQUEST` settings, taken out of `kwargs` (from transformers 5.25 a generate argument;
    before, an attribute of the request's generation_config), over `SERVED_DEFAULTS`; a call that is not served and
    has none gets None (a script's calls share the drafter's store)."""
    request = kwargs.pop(SERVED_REQUEST, None)
    config = kwargs.get("generation_config")
    if config is not None and hasattr(config, SERVED_REQUEST):
        config = copy.deepcopy(config)
        request = getattr(config, SERVED_REQUEST)
        delattr(config, SERVED_REQUEST)
        kwargs["generation_config"] = config
    if request is None and not served:
        return None
    return SERVED_DEFAULTS | (request or {})


def client_store(model, request: dict) -> OnlineStore | None:
    """The online store of the request's client (None: the request has none), one of at most `stores` per model."""
    if request["store"] is None:
        return None
    with _BUILDING:
        stores = _STORES.get(model)
        if stores is None or (stores.max_stores, stores.max_tokens) != (request["stores"], request["store_tokens"]):
            stores = _STORES[model] = OnlineStores(request["stores"], request["store_tokens"])
    return stores.get(request["store"])


def drafting_from(drafter: Drafter, store: OnlineStore | None) -> Drafter:
    """`drafter` (a fork) with each of its lookups that keeps an online store keeping `store` instead (None: none)."""
    for source in getattr(drafter, "sources", [drafter]):
        if isinstance(source, PromptLookupDrafter) and source.online_store is not None:
            source.online_store = store
    return drafter


class ChunkedStreamer:
    """Passes a streamer the committed tokens in chunks of `size` (the rest at the end), not a verify step's accepted
    tokens as they come: a stream's chunk sizes and times would tell anyone who sees them (the client, the network)
    how many drafted tokens each step accepted, which fingerprints the text and what the drafter holds (Wei et al.
    2024, arXiv 2411.01076, who propose this aggregation). The prompt and the prefill's token (one per request,
    whatever was drafted, so it tells nothing) pass at once: the first token is not held back."""

    def __init__(self, streamer, size: int):
        self.streamer, self.size = streamer, size
        self.puts = 0
        self.pending: torch.Tensor | None = None

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts <= 2:  # the prompt, then the prefill's token
            self.pending = value.new_empty(0)
            self.streamer.put(value)
            return
        self.pending = torch.cat([self.pending, value.reshape(-1)])
        while self.pending.shape[0] >= self.size:
            self.streamer.put(self.pending[: self.size])
            self.pending = self.pending[self.size :]

    def end(self) -> None:
        if self.pending is not None and self.pending.numel():
            self.streamer.put(self.pending)
        self.streamer.end()


def log_each_call() -> None:
    """Print the "hybrid.serving" lines (each call's statistics, the server's notes) to stderr, once a process."""
    if logger.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("hybrid: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def cached_drafter(model, name: str) -> Drafter | None:
    """The drafter `name` for `model`, built on its first call and kept for the model's life."""
    with _BUILDING:
        per_model = _DRAFTERS.setdefault(model, {})
        if name not in per_model:
            per_model[name] = build_drafter(name, model)
        return per_model[name]


def build_drafter(name: str, model, tokenizer=None) -> Drafter | None:
    """A drafter for the verifier `model` by name: "default" (`hybrid.drafter_for(model)`: context lookup and an online
    store of the model's outputs, kept across its requests; for the embedded default verifier also the shipped n-gram
    store and block-diffusion model), "block" (the shipped block model alone), "prompt-lookup", "none" (None); or a
    folder: a block-diffusion checkpoint (drafter_config.json) or a DFlash drafter (config.json with dflash_config),
    behind lookup and the online store as `hybrid.drafter_for(model, folder)` puts them, or a causal LM sharing the
    verifier's tokenizer (config.json), drafting autoregressively."""
    from drafters import BlockDiffusionDrafter, ModelDrafter, PromptLookupDrafter
    from hybrid.default import DRAFTER_DIR
    from hybrid.drafter_choice import drafter_for

    if name == "none":
        return None
    if name == "prompt-lookup":
        return PromptLookupDrafter()
    if name == "default":
        return drafter_for(model, tokenizer=tokenizer)
    if name == "block":
        return BlockDiffusionDrafter.from_pretrained(DRAFTER_DIR, model, tokenizer=tokenizer)
    path = Path(name)
    config = path / "config.json"
    if (path / "drafter_config.json").is_file() or (
        config.is_file() and "dflash_config" in json.loads(config.read_text())
    ):
        return drafter_for(model, path, tokenizer)
    if config.is_file():
        from transformers import AutoModelForCausalLM

        small = AutoModelForCausalLM.from_pretrained(path, dtype=model.dtype).to(model.device).eval()
        return ModelDrafter(small, tokenizer)
    raise ValueError(
        f"drafter {name!r} is neither one of {list(DRAFTER_NAMES)} nor a folder with drafter_config.json (a "
        "block-diffusion drafter) or config.json (a DFlash drafter, or a causal LM that shares the verifier's tokenizer)"
    )
