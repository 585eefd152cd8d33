"""Whether a batch's cache fits this machine's free memory: sized before anything is allocated, so that a batch too
large is refused with the number of rows that fits instead of failing inside a forward."""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from verifiers.cache_layers import cache_fingerprint
from verifiers.state_layers import layer_states
from verifiers.verdicts import probe_tokens, probed


class CacheMemoryError(MemoryError):
    """The cache for this batch does not fit: the message names the batch size that does."""


def shape_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = 1
    for size in shape:
        n *= size
    return n * torch.finfo(dtype).bits // 8 if dtype.is_floating_point else n * 8


def bytes_per_row(model, capacity: int, hidden_width: int = 0, verify_width: int = 1) -> int:
    """Cache bytes one row needs: keys and values of every layer plus the kept hidden states, and the recurrent and
    convolution states of a model with state layers, with those a verify of `verify_width` tokens records."""
    layers = cache_fingerprint(model)["layers"]
    per_token = sum(heads * (key + value) for heads, key, value in layers) + hidden_width
    live, recorded = state_bytes(model)
    return shape_bytes((capacity, per_token), model.dtype) + live + (verify_width if verify_width > 1 else 0) * recorded


def state_bytes(model) -> tuple[int, int]:
    """(bytes of one row's recurrent and convolution states, bytes a verify records per fed token of one row): the
    state after each fed token (`verifiers.state_layers`). (0, 0) for a model without state layers. Read off the
    states one forward of two tokens leaves in a transformers cache, once per model."""
    if not any(states for states, _ in layer_states(model.config.get_text_config())):
        return 0, 0
    live, recorded = probed(model, _state_bytes, failed=[0, 0])
    return live, recorded


@torch.inference_mode()
def _state_bytes(model) -> list[int]:
    tokens, _ = probe_tokens(model, 2)
    cache = DynamicCache(config=model.config)
    model(tokens, cache=cache, use_cache=True)
    live = recorded = 0
    for layer in cache.layers:
        if not isinstance(layer, LinearAttentionCacheLayerMixin):
            continue
        for conv in layer.conv_states.values():
            if conv is not None:  # [1, channels, kernel]: a verify's window grows by a column per fed token
                live += conv.numel() * conv.element_size()
                recorded += conv.shape[1] * conv.element_size()
        for state in layer.recurrent_states.values():
            if state is not None:  # the state after each fed token
                live += state.numel() * state.element_size()
                recorded += state.numel() * state.element_size()
    return [live, recorded]


def free_memory_bytes(device: torch.device) -> int | None:
    """Free memory where the cache goes: CUDA's free bytes, or the OS's MemAvailable for the CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_fits(model, batch_size: int, capacity: int, hidden_width: int = 0, verify_width: int = 1) -> None:
    """Raise `CacheMemoryError` naming the batch size that fits when `batch_size` rows cannot be cached (with
    `verify_width`: and verified that wide)."""
    free = free_memory_bytes(torch.device(model.device))
    per_row = bytes_per_row(model, capacity, hidden_width, verify_width)
    if free is None or batch_size * per_row <= free:
        return
    fits = free // per_row
    raise CacheMemoryError(
        f"a batch of {batch_size} rows of up to {capacity} tokens needs {batch_size * per_row / 2**30:.2f} GiB of "
        f"cache ({per_row / 2**20:.1f} MiB per row) but {free / 2**30:.2f} GiB is free on {model.device}: "
        + (f"pass at most {fits} rows per call" if fits else "even one row does not fit; lower max_new_tokens")
        + " (or free memory)"
    )
