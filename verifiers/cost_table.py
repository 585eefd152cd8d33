"""What a forward of m fed tokens costs on this device, and which matrix kernel it runs, measured, not assumed.

The curve is not smooth, and which kernel serves a width best depends on the CPU: on one 2-core CPU this project
is measured on, SmolLM2-135M costs about as much for m = 2-4 as for m = 1 when its linears put the weight on the
left (`verifiers.kernels`), and twice as much through PyTorch's own kernel; on another CPU it is the other way
round, and there oneDNN's product on reordered weights runs m = 7-15 6-18% faster. So every m from 1 to 17 and
tree widths up to 65 are timed with each kernel, the kernels taking turns at each m (best of 3 forwards on a
64-token context), and each width gets the fastest kernel (PyTorch's own unless another beats it by
`KERNEL_MARGIN`), so a step never costs more than PyTorch's forward of the same width. That is 64 forwards per
kernel, about 25 s for SmolLM2-135M on a 2-core CPU, once per
(model, dtype, device, CPU or GPU model, threads), inside the first call that needs the table
(`python -m experiments.verify_costs` measures it ahead of time instead); the table and the choice are cached on
disk together and later runs read them in well under a millisecond.

A `Verifier` reads the kernel choice and the costs (`cached_kernel_choice`); a scheduler reads the costs
(`schedulers.cost_model.VerifyCostModel`), which it corrects by the verify times it observes.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import json
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import DynamicCache

from verifiers.embedded import measurements_dir
from verifiers.indexed import indexers
from verifiers.kernels import KERNELS, chosen_kernels, cpu_linears, force_kernel, prepare_linears
from verifiers.own_state import StateForwards, state_format
from verifiers.positions import rotary_state_kept
from verifiers.support import cache_feed_refusal, learned_position_limit

# Every width of a chain of up to 16 drafts + the pending token, then tree widths (the curve is smooth there).
PROBE_SIZES = (*range(1, 18), 24, 33, 49, 65)
CONTEXT = 64
# A kernel other than PyTorch's own serves a width only if it is this much faster there: within the noise of a
# shared machine PyTorch's is kept, so a misread never makes a step slower than PyTorch's forward.
KERNEL_MARGIN = 0.05


@dataclass
class CostTable:
    """costs: m -> seconds of one forward feeding m tokens, for each measured m; kernels: m -> the matrix kernel that
    forward runs (`verifiers.kernels`; "torch" wherever none was chosen). Both are kept in increasing m."""

    costs: dict[int, float]
    kernels: dict[int, str] = field(default_factory=dict)

    def __post_init__(self):
        self.costs = dict(sorted(self.costs.items()))
        self.kernels = {m: self.kernels.get(m, "torch") for m in self.costs}

    def kernel(self, m: int) -> str:
        """The kernel a forward of m fed rows runs: a probed width's choice; between two probed widths another
        kernel than PyTorch's only where both chose it; past the table PyTorch's own."""
        if m in self.kernels:
            return self.kernels[m]
        sizes = list(self.costs)
        below = [s for s in sizes if s < m]
        above = [s for s in sizes if s > m]
        if below and above and self.kernels[below[-1]] == self.kernels[above[0]]:
            return self.kernels[below[-1]]
        return "torch"

    def row_kernels(self) -> dict[int, str]:
        """Each row count whose products run another kernel than PyTorch's, and that kernel: what a `Verifier`
        takes as `row_kernels`."""
        chosen = {m: self.kernel(m) for m in range(1, list(self.costs)[-1] + 1)}
        return {m: kernel for m, kernel in chosen.items() if kernel != "torch"}


@functools.cache  # read once per process: every generate call keys its cached kernel choice with it
def cpu_name() -> str:
    """This CPU's model and vector extensions: machines of one kind differ in which kernel wins (an AMX Xeon's
    PyTorch matmuls beat the weight-left form that wins on an AVX2 one), and a cache folder can move between them."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:  # not Linux
        return f"{platform.machine()} {platform.processor()}"
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    return " ".join([model, *sorted(f for f in flags if f.startswith(("avx", "amx", "fma")))])


def device_key(model) -> str:
    """Identifies a (model, dtype, device, CPU or GPU model, threads) combination for the on-disk cache."""
    config = model.config.get_text_config()
    sizes = [getattr(config, name, None) for name in ("hidden_size", "num_hidden_layers", "vocab_size")]
    if None in sizes:  # kept in sub-configs (BLT's): the parameter count tells one size of such a model from another
        sizes.append(sum(p.numel() for p in model.parameters()))
    parts = [
        type(model).__name__,
        *map(str, sizes),
        str(model.dtype),
        str(model.device),
        str(torch.get_num_threads()),
        torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else cpu_name(),
        ",".join(map(str, PROBE_SIZES)),  # a table of other sizes is measured again
        ",".join(KERNELS),  # and one that chose among other kernels (verifiers.kernels)
    ]
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:16]


def verify_cost_table(model, use_disk_cache: bool = True) -> CostTable:
    """The cached table of this (model, dtype, device, threads), measured and cached first if there is none."""
    cached = cached_table(model) if use_disk_cache else None
    if cached is not None:
        return cached
    table = CostTable(*choose_kernels(measure_verify_costs(model)))
    if use_disk_cache:
        save_table(model, table)
    return table


def cached_table(model) -> CostTable | None:
    """The table cached for this (model, dtype, device, threads), or None; never measures."""
    path = _table_path(model)
    try:
        saved = json.loads(path.read_text())
        return CostTable(
            {int(m): t for m, t in saved["costs"].items()}, {int(m): k for m, k in saved["kernels"].items()}
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # none yet, or not a table: measure again
        return None


def save_table(model, table: CostTable) -> None:
    """Cache `table` as the one of this (model, dtype, device, threads)."""
    path = _table_path(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"costs": table.costs, "kernels": table.kernels}))


def _table_path(model) -> Path:
    return measurements_dir() / f"{device_key(model)}.json"


def cached_kernel_choice(model) -> tuple[dict[int, str], dict[int, float]]:
    """What a `Verifier` takes from the cached table of `model`, read once: the row counts it runs through another
    kernel than PyTorch's, with that kernel (`row_kernels`), and the seconds of a forward feeding n tokens, by n
    (`forward_costs`). Both empty while no table is cached: PyTorch's kernels everywhere, so a plain step is never
    slower than `generate`'s and never waits for a measurement (nothing is measured here)."""
    table = cached_table(model) if cpu_linears(model) else None
    if table is None:
        return {}, {}
    return table.row_kernels(), dict(table.costs)


def prepare_kernels(model) -> None:
    """Make what the kernels of `model`'s cached table need before any call runs them
    (`verifiers.kernels.prepare_linears`): otherwise the first call that feeds a width they serve pays for it."""
    row_kernels, _ = cached_kernel_choice(model)
    prepare_linears(cpu_linears(model), set(row_kernels.values()))


@torch.inference_mode()
def measure_verify_costs(model, sizes=PROBE_SIZES, repeats: int = 3, kernels=KERNELS) -> dict[str, dict[int, float]]:
    """kernel -> m -> seconds for one forward of m tokens after a CONTEXT-token cache (shorter where a learned
    position table ends sooner), for each m in `sizes` that fits, best of `repeats` rounds. The kernels take turns
    at each m, in alternating order, so a moment of load elsewhere hits both; only "torch" is measured where the
    model has no linears a kernel choice applies to (`verifiers.kernels.cpu_linears`). Autocast is off meanwhile: the
    table is the model's own dtype's, cached as such, and only PyTorch's kernel runs under autocast."""
    off = [torch.autocast(device, enabled=False) for device in ("cpu", "cuda") if torch.is_autocast_enabled(device)]
    with contextlib.ExitStack() as stack:
        for context in off:
            stack.enter_context(context)
        stack.enter_context(rotary_state_kept(model))  # its forwards are not a decode's
        return _measure_verify_costs(model, sizes, repeats, kernels)


def _measure_verify_costs(model, sizes, repeats: int, kernels) -> dict[str, dict[int, float]]:
    refusal = cache_feed_refusal(model, several=True)  # what it times is verifies of drafted tokens
    if refusal:
        raise ValueError(refusal)
    vocab = model.config.get_text_config().vocab_size
    limit = learned_position_limit(model)  # a learned position table bounds context + m
    sizes = tuple(m for m in sizes if limit is None or m < limit)
    length = CONTEXT if limit is None else max(1, min(CONTEXT, limit - max(sizes)))
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(0, vocab, (1, length), generator=generator).to(model.device)
    # A model with a state structure of its own is fed through it, as the verifier feeds it (`verifiers.own_state`)
    if state_format(model) is not None:
        after = _StateContext(model, context)
    elif indexers(model):
        after = _VerifierContext(model, context, sizes)
    else:
        after = _CachedContext(model, context, sizes)
    linears = cpu_linears(model)
    kernels = tuple(k for k in kernels if k == "torch" or linears)
    costs = {kernel: {m: float("inf") for m in sizes} for kernel in kernels}
    _forward_each(model, after, sizes[:1], kernels, linears, generator, costs)  # warms up
    for turn in range(repeats):
        _forward_each(model, after, sizes, kernels if turn % 2 else kernels[::-1], linears, generator, costs)
    return costs


class _CachedContext:
    """The context in a DynamicCache: `feed` runs m tokens after it, `undo` crops them off again (or, for layers that
    cannot be cropped, DeepSeek-V4's compressors, restores a copy)."""

    def __init__(self, model, context: torch.Tensor, sizes):
        self.model, self.length = model, context.shape[1]
        self.cache = DynamicCache(config=model.config)
        # Sliding-window layers keep what the crop below removes (as in Verifier), and recurrent layers the state
        # after each verified token, as a verify records it (`verifiers.state_layers`)
        self.cache.activate_past_recording(recurrent_states_to_keep=max(sizes))
        self._run(context, 0)
        croppable = all(getattr(layer, "is_croppable", True) for layer in self.cache.layers)
        self.saved = None if croppable else copy.deepcopy(self.cache)

    def _run(self, tokens: torch.Tensor, start: int) -> None:
        # Position ids as the verifier passes them: some forwards cannot derive their own (XMOD's without a pad id)
        positions = torch.arange(start, start + tokens.shape[1], device=self.model.device)[None]
        self.model(tokens, position_ids=positions, cache=self.cache, use_cache=True)

    def feed(self, tokens: torch.Tensor) -> None:
        self._run(tokens, self.length)

    def undo(self, m: int) -> None:
        if self.saved is None:
            self.cache.crop(-m)
        else:
            self.cache = copy.deepcopy(self.saved)


class _VerifierContext:
    """The context in hybrid's own cache, for a model whose verify does more than its forward (indexed attention's
    per-query choice, `verifiers.indexed`): `feed` is a verify, `undo` its rollback."""

    def __init__(self, model, context: torch.Tensor, sizes):
        from verifiers.verifier import Verifier  # which reads these tables

        self.verifier = Verifier(model, max_width=max(sizes))
        self.verifier.prefill(context, None, context.shape[1] + max(sizes))

    def feed(self, tokens: torch.Tensor) -> None:
        self.verifier.verify(tokens)

    def undo(self, m: int) -> None:
        self.verifier.rollback(m)


class _StateContext:
    """The context in the model's own state structure: `feed` runs m tokens after it, `undo` restores its copy."""

    def __init__(self, model, context: torch.Tensor):
        self.forwards = StateForwards(model)
        self.forwards(context)
        self.forwards.mark()

    def feed(self, tokens: torch.Tensor) -> None:
        self.forwards(tokens)

    def undo(self, m: int) -> None:
        self.forwards.back()


def _forward_each(model, after, sizes, kernels, linears, generator, costs) -> None:
    """One forward of m random tokens after the context per m and kernel, each kept in `costs` if the fastest yet."""
    vocab = model.config.get_text_config().vocab_size
    for m in sizes:
        for kernel in kernels:
            tokens = torch.randint(0, vocab, (1, m), generator=generator).to(model.device)
            # Installed outside the timing, as a call installs its kernels once (`Verifier.kernels`).
            with force_kernel(kernel), chosen_kernels(linears, {}):
                _sync(model)
                start = time.perf_counter()
                after.feed(tokens)
                _sync(model)
                costs[kernel][m] = min(costs[kernel][m], time.perf_counter() - start)  # the least disturbed
            after.undo(m)


def choose_kernels(curves: dict[str, dict[int, float]]) -> tuple[dict[int, float], dict[int, str]]:
    """Per width, the kernel a forward runs and what it costs: the fastest, unless it beats PyTorch's own
    ("torch", which every curve set has) by less than KERNEL_MARGIN."""
    costs, kernels = {}, {}
    for m, torch_cost in curves["torch"].items():
        best = min(curves, key=lambda kernel: curves[kernel][m])
        if curves[best][m] >= (1 - KERNEL_MARGIN) * torch_cost:
            best = "torch"
        costs[m], kernels[m] = curves[best][m], best
    return costs, kernels


def _sync(model) -> None:
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
