"""What a verify of m positions costs on this device, measured, not assumed.

The curve is not smooth: on the 2-core CPU this project is measured on, SmolLM2-135M costs about as much
for m = 2-4 as for m = 1, 1.2x for m = 8 and 2x for m = 16 (the few-row kernels of `verifiers.kernels` up
to 8 rows, PyTorch's beyond; `python -m experiments.verify_costs` prints both curves). So every m from 1 to
17 is timed, and tree widths up to 65 (best of 2 forwards on a 64-token context, ~3 s), once per (model,
dtype, device, threads), and cached on disk; later runs read the cache in well under a millisecond. Sizes
between are interpolated and beyond the table extrapolated linearly. During a run, observed verify times
rescale the curve (machine load changes), so the table only has to get the shape right.
"""

from __future__ import annotations

import hashlib
import json
import time

import torch
from transformers import DynamicCache

from verifiers.cache import learned_position_limit
from verifiers.embedded import cache_dir
from verifiers.kernels import cpu_linears, narrow_linears

# Every width of a chain of up to 16 drafts + the pending token, then tree widths (the curve is smooth there).
PROBE_SIZES = (*range(1, 18), 24, 33, 49, 65)
CONTEXT = 64


def device_key(model) -> str:
    """Identifies a (model, dtype, device, threads) combination for the on-disk cache."""
    config = model.config.get_text_config()
    parts = [
        type(model).__name__,
        str(config.hidden_size),
        str(config.num_hidden_layers),
        str(config.vocab_size),
        str(model.dtype),
        str(model.device),
        str(torch.get_num_threads()),
        torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else "",
        ",".join(map(str, PROBE_SIZES)),  # a table of other sizes is measured again
        "narrow-linears",  # measured through the kernels a verify uses (verifiers.kernels)
    ]
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:16]


@torch.inference_mode()
def measure_verify_costs(model, sizes=PROBE_SIZES, repeats: int = 2, narrow: bool = True) -> dict[int, float]:
    """Seconds for one forward of m tokens after a CONTEXT-token cache (shorter where a learned position table
    ends sooner), for each m in `sizes` that fits (best of `repeats`); through the few-row kernels an eager
    verify uses (`verifiers.kernels`) unless `narrow` is False."""
    vocab = model.config.get_text_config().vocab_size
    limit = learned_position_limit(model)  # a learned position table bounds context + m
    sizes = tuple(m for m in sizes if limit is None or m < limit)
    length = CONTEXT if limit is None else max(1, min(CONTEXT, limit - max(sizes)))
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(0, vocab, (1, length), generator=generator).to(model.device)
    cache = DynamicCache(config=model.config)
    cache.activate_past_recording()  # sliding-window layers keep what the crop below removes (as in Verifier)
    model(context, cache=cache, use_cache=True)
    costs = {m: float("inf") for m in sizes}
    linears = cpu_linears(model) if narrow else []
    for m in (sizes[0], *sizes * repeats):  # the first forward only warms up
        tokens = torch.randint(0, vocab, (1, m), generator=generator).to(model.device)
        positions = torch.arange(length, length + m, device=model.device)[None]
        _sync(model)
        start = time.perf_counter()
        with narrow_linears(linears):
            model(tokens, position_ids=positions, cache=cache, use_cache=True)
        _sync(model)
        costs[m] = min(costs[m], time.perf_counter() - start)  # the minimum is the least disturbed by noise
        cache.crop(-m)
    return costs


def _sync(model) -> None:
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)


class VerifyCostModel:
    """cost(m): expected seconds of a verify step that feeds m tokens (the pending one + m - 1 drafts)."""

    def __init__(self, costs: dict[int, float]):
        self.sizes = sorted(costs)
        self.table = [costs[m] for m in self.sizes]
        self.scale = 1.0  # observed / predicted, tracked online

    @classmethod
    def for_model(cls, model, use_disk_cache: bool = True) -> VerifyCostModel:
        path = cache_dir() / "costs" / f"{device_key(model)}.json"
        if use_disk_cache and path.exists():
            return cls({int(m): t for m, t in json.loads(path.read_text()).items()})
        costs = measure_verify_costs(model)
        if use_disk_cache:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(costs))
        return cls(costs)

    def cost(self, m: int) -> float:
        return self.scale * self._interpolate(m)

    def observe(self, m: int, seconds: float, weight: float = 0.05) -> None:
        """Fold one measured verify time into the scale (an exponential moving average of the ratio)."""
        predicted = self._interpolate(m)
        if predicted > 0 and seconds > 0:
            self.scale += weight * (seconds / predicted - self.scale)

    def _interpolate(self, m: int) -> float:
        sizes, table = self.sizes, self.table
        if m <= sizes[0]:
            return table[0]
        for (m0, t0), (m1, t1) in zip(zip(sizes, table), zip(sizes[1:], table[1:])):
            if m <= m1:
                return t0 + (t1 - t0) * (m - m0) / (m1 - m0)
        # Past the table (a batch feeds rows x width tokens): the mean slope of its upper half, steadier
        # than the last two noisy points.
        half = min(len(sizes) // 2, len(sizes) - 2)
        slope = (table[-1] - table[half]) / (sizes[-1] - sizes[half]) if len(sizes) > 1 else 0.0
        return table[-1] + max(slope, 0.0) * (m - sizes[-1])
