"""Whether a batch's cache fits this machine's free memory: sized before anything is allocated, so that a batch too
large is refused with the number of rows that fits instead of failing inside a forward."""

from __future__ import annotations

import torch

from verifiers.cache_layers import cache_fingerprint


class CacheMemoryError(MemoryError):
    """The cache for this batch does not fit: the message names the batch size that does."""


def shape_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = 1
    for size in shape:
        n *= size
    return n * torch.finfo(dtype).bits // 8 if dtype.is_floating_point else n * 8


def bytes_per_row(model, capacity: int, hidden_width: int = 0) -> int:
    """Cache bytes one row needs: keys and values of every layer plus the kept hidden states."""
    layers = cache_fingerprint(model)["layers"]
    per_token = sum(heads * (key + value) for heads, key, value in layers) + hidden_width
    return shape_bytes((capacity, per_token), model.dtype)


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


def check_fits(model, batch_size: int, capacity: int, hidden_width: int = 0) -> None:
    """Raise `CacheMemoryError` naming the batch size that fits when `batch_size` rows cannot be cached."""
    free = free_memory_bytes(torch.device(model.device))
    per_row = bytes_per_row(model, capacity, hidden_width)
    if free is None or batch_size * per_row <= free:
        return
    fits = free // per_row
    raise CacheMemoryError(
        f"a batch of {batch_size} rows of up to {capacity} tokens needs {batch_size * per_row / 2**30:.2f} GiB of "
        f"cache ({per_row / 2**20:.1f} MiB per row) but {free / 2**30:.2f} GiB is free on {model.device}: "
        + (f"pass at most {fits} rows per call" if fits else "even one row does not fit; lower max_new_tokens")
        + " (or free memory)"
    )
