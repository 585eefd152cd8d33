"""`model.generate` through `hybrid.generate`: the function behind transformers' `custom_generate`.

transformers runs a folder's `custom_generate/generate.py` in place of `model.generate`, for
`model.generate(ids, custom_generate=DIR, trust_remote_code=True)` and for every call on a model loaded with
`from_pretrained(DIR, trust_remote_code=True)` (which is how `transformers serve DIR --trust-remote-code` loads it).
The file `python -m hybrid export-served` writes there names a drafter and calls `generate` below.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import sys
import threading
import weakref
from pathlib import Path

from transformers import GenerationMixin

import hybrid
from drafters import Drafter
from verifiers import CacheMemoryError

# One line per call: tokens, verifier forwards, tau and tokens/s (`python -m hybrid serve` prints them).
logger = logging.getLogger("hybrid.serving")

# Set to "1" by `python -m hybrid serve` for its process and those transformers serve starts (from 5.25 a model
# decodes in a process of its own, which inherits the environment and nothing else): there each call's line goes to
# stderr, and what hybrid refuses in a request is raised as a ValueError, which transformers serve answers 400.
SERVED = "HYBRID_SERVED"

DRAFTER_NAMES = ("default", "block", "prompt-lookup", "none")

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
    if isinstance(drafter, str):
        drafter = cached_drafter(model, drafter)
        # Each call drafts with its own copy (a server answers requests on several threads); the copies share the
        # weights and the online store, which is how a request learns from the ones before it.
        drafter = drafter.fork() if drafter is not None else None
    return_stats = kwargs.pop("return_stats", False)
    served = os.environ.get(SERVED) == "1"
    if served:
        log_each_call()
    try:
        output, stats = hybrid.generate(model, drafter=drafter, return_stats=True, **kwargs)
    except (TypeError, CacheMemoryError) as error:  # a setting of the wrong kind, a length that cannot be cached
        if not served:
            raise
        raise ValueError(str(error)) from error  # the request's fault: transformers serve passes on a ValueError
    logger.info("%s drafter: %s", label, stats.summary())
    return (output, stats) if return_stats else output


def warm_up(model, processor=None) -> None:
    """Run now what the first call on `model`, loaded from a served folder, would pay for (as `hybrid.load_default`
    does): its drafter built, the default scheduler's verify-cost table and kernel choice (measured once per machine,
    cached on disk), what those kernels need made, and the model's probes. `python -m hybrid serve` runs it in the
    model's process before the server answers /health."""
    from hybrid.export import served_drafter
    from schedulers.adaptive import default_scheduler
    from schedulers.cost_model import prepare_kernels
    from verifiers.verifier import settle_probes

    drafter = cached_drafter(model, served_drafter(model.name_or_path))
    if drafter is not None:
        default_scheduler(drafter, model).reset(drafter, model)
    prepare_kernels(model)
    settle_probes(model)


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
