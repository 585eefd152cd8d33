"""What a probe finds about a model, found once: kept per model in memory and, for a model whose computation its
class and config decide, per kind of model on disk, so that a later process reads it instead of probing inside its
first call.

Some things hybrid must know about a verifier no signature tells: whether its forward takes several tokens on top of
its cache, whether an output depends on the tokens after it or on the forward's width, whether `generate` lets a
padded row's text depend on its padding. A probe runs a few tiny forwards to tell (`probed`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import weakref

import torch
import transformers

from verifiers.embedded import measurements_dir
from verifiers.positions import rotary_state_kept

# Where the classes of a model's own modules live: torch's layers, transformers' models, activations and GPT-2's Conv1D.
OWN_MODULES = ("torch.nn.", "transformers.models.", "transformers.activations", "transformers.pytorch_utils")

# model -> {(probe, args): verdict}; weak, so a verdict lives as long as its model
_VERDICTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def built_of_own_modules(model) -> bool:
    """Whether every module is torch.nn's or a transformers model's own class and every parameter a plain one: its
    class and config then decide what it computes. Layers from elsewhere (quantization libraries, adapters, remote
    code) or quantized weight tensors may compute otherwise, by state no config holds."""
    return all(type(m).__module__.startswith(OWN_MODULES) for m in model.modules()) and all(
        type(p) is torch.nn.Parameter for p in model.parameters()
    )


@torch.inference_mode()
def probed(model, probe, *args, failed=None):
    """`probe(model, *args)`'s verdict (a JSON value), run in eval mode (dropout would change every output and draw
    from the RNG a sampled call's tokens come from) once per model, and read from disk where it was kept
    (`_verdict_path`). A probe that raises (a model that needs more than tokens fails in its own call, with its own
    message) gives `failed`, kept for this model only: the failure may be this process's. A memory error is this
    machine's limit, not the model's: it is raised."""
    verdicts = _VERDICTS.setdefault(model, {})
    key = (probe, args)
    if key in verdicts:
        return verdicts[key]
    path = _verdict_path(model, probe, args)
    with contextlib.suppress(AttributeError, OSError, ValueError, KeyError, TypeError):  # none kept, or unreadable
        verdicts[key] = json.loads(path.read_text())["verdict"]
        return verdicts[key]
    training = model.training
    model.eval()
    try:
        with rotary_state_kept(model):
            verdicts[key] = probe(model, *args)
    except (MemoryError, torch.OutOfMemoryError):
        raise
    except Exception:
        verdicts[key] = failed
        return failed
    finally:
        model.train(training)
    if path is not None:
        with contextlib.suppress(OSError):  # a read-only cache only costs the next process the probe
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"verdict": verdicts[key]}))
    return verdicts[key]


def probe_tokens(model, n: int) -> tuple[torch.Tensor, int]:
    """`n` token ids [1, n] for a probe's forwards, counting up from the middle of the vocabulary (clear of the
    special tokens at either end) and wrapping round within it, and one id before them (another token, or padding)."""
    vocab = model.get_input_embeddings().num_embeddings
    middle = vocab // 2
    return (middle + torch.arange(n, device=model.device))[None] % vocab, middle - 1


def least_precise_dtype(model) -> torch.dtype:
    """The least precise floating dtype `model` computes in: its parameters' and buffers', a module's declared
    `compute_dtype` (bitsandbytes' 4-bit layers), and autocast's where it is on."""
    dtypes = {t.dtype for t in [*model.parameters(), *model.buffers()] if t.is_floating_point()}
    dtypes |= {m.compute_dtype for m in model.modules() if isinstance(getattr(m, "compute_dtype", None), torch.dtype)}
    if model.device.type in ("cpu", "cuda") and torch.is_autocast_enabled(model.device.type):
        dtypes.add(torch.get_autocast_dtype(model.device.type))
    return max(dtypes or {torch.float32}, key=lambda dtype: torch.finfo(dtype).eps)


def _verdict_path(model, probe, args: tuple):
    """Where `probe(model, *args)`'s verdict is kept: keyed by the probe's code and the numbers it reads, its
    arguments, the model's class, config, dtype, device type and module classes, the least precise dtype it computes
    in (autocast's included) and the torch and transformers versions, which together decide what a model built of
    its own modules computes. None (probe in each process) for any other model, whose layers may compute by state no
    key here holds (a quantized weight's scheme, a layer's threshold), for one whose modules carry hooks or a forward
    of their own (accelerate's offloading, a wrapper's patch), and for one whose config does not serialize."""
    modules = list(model.modules())
    if not built_of_own_modules(model) or any(
        m._forward_hooks or m._forward_pre_hooks or "forward" in vars(m) for m in modules
    ):
        return None
    try:
        config = model.config.to_json_string(use_diff=False)
    except (TypeError, ValueError):
        return None
    parts = [
        _code_key(probe),
        repr(args),
        f"{type(model).__module__}.{type(model).__qualname__}",
        config,
        str(model.dtype),
        model.device.type,
        ",".join(sorted({f"{type(m).__module__}.{type(m).__qualname__}" for m in modules})),
        str(least_precise_dtype(model)),
        torch.__version__,
        transformers.__version__,
    ]
    return measurements_dir() / "verdicts" / f"{hashlib.sha1('|'.join(parts).encode()).hexdigest()[:16]}.json"


def _code_key(function) -> str:
    """`function`'s name, code and the numbers and strings it reads (its constants and module-level thresholds):
    a changed probe keys a new verdict."""
    code = function.__code__
    read = [function.__globals__.get(name) for name in code.co_names]
    scalars = [v for v in (*code.co_consts, *read) if isinstance(v, (int, float, str)) and not isinstance(v, bool)]
    return "|".join([function.__qualname__, code.co_code.hex(), repr(scalars)])
