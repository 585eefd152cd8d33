"""What a verify of m positions costs on this device, and which matrix kernel it runs, measured, not assumed.

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
disk together and later runs read them in well under a millisecond. Sizes between are interpolated and beyond the
table extrapolated linearly.
During a run, observed verify times correct it two ways (`VerifyCostModel.observe_step`): one scale for the whole
curve (machine load changes), and a factor per batch size, since a batch of 8 rows 2 wide is not a forward of 16
positions of one sequence (each row attends to its own cache). Widths keep the table's relative costs: a factor per
width would lock in a noisy reading of a width that, costed too high, is never chosen and so never observed again.
A batch size never observed takes the factor of the nearest one observed. The two kinds of step (plain, and verifies
of drafts) can still lock in that way: a kind a scheduler has not chosen for a while is `stale`, so that it can be
tried again (`schedulers.adaptive.CostAwareScheduler`), and its next observation corrects it further than usual.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import platform
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from verifiers.cache import cache_feed_refusal, learned_position_limit
from verifiers.embedded import measurements_dir
from verifiers.kernels import KERNELS, chosen_kernels, cpu_linears, force_kernel, prepare_linears
from verifiers.positions import rotary_state_kept

# Every width of a chain of up to 16 drafts + the pending token, then tree widths (the curve is smooth there).
PROBE_SIZES = (*range(1, 18), 24, 33, 49, 65)
CONTEXT = 64
# A kernel other than PyTorch's own serves a width only if it is this much faster there: within the noise of a
# shared machine PyTorch's is kept, so a misread never makes a step slower than PyTorch's forward.
KERNEL_MARGIN = 0.05


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
    cache = DynamicCache(config=model.config)
    cache.activate_past_recording()  # sliding-window layers keep what the crop below removes (as in Verifier)
    # Position ids as the verifier passes them: some forwards cannot derive their own (XMOD's without a pad id)
    model(context, position_ids=torch.arange(length, device=model.device)[None], cache=cache, use_cache=True)
    linears = cpu_linears(model)
    kernels = tuple(k for k in kernels if k == "torch" or linears)
    costs = {kernel: {m: float("inf") for m in sizes} for kernel in kernels}
    _forward_each(model, cache, length, sizes[:1], kernels, linears, generator, costs)  # warms up
    for turn in range(repeats):
        _forward_each(model, cache, length, sizes, kernels if turn % 2 else kernels[::-1], linears, generator, costs)
    return costs


def _forward_each(model, cache, length, sizes, kernels, linears, generator, costs) -> None:
    """One forward of m random tokens after the cache per m and kernel, each kept in `costs` if the fastest yet."""
    vocab = model.config.get_text_config().vocab_size
    for m in sizes:
        for kernel in kernels:
            tokens = torch.randint(0, vocab, (1, m), generator=generator).to(model.device)
            positions = torch.arange(length, length + m, device=model.device)[None]
            # Installed outside the timing, as a call installs its kernels once (`Verifier.kernels`).
            with force_kernel(kernel), chosen_kernels(linears, {}):
                _sync(model)
                start = time.perf_counter()
                model(tokens, position_ids=positions, cache=cache, use_cache=True)
                _sync(model)
                costs[kernel][m] = min(costs[kernel][m], time.perf_counter() - start)  # the least disturbed
            cache.crop(-m)


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


class VerifyCostModel:
    """cost(m): expected seconds of a verify step that feeds m tokens (the pending one + m - 1 drafts);
    step_cost(rows, width): of a batched one; kernel(m): the matrix kernel a step feeding m rows in all runs
    (`verifiers.kernels`; "torch" wherever none was chosen)."""

    SCALE_RATE = 0.05
    FACTOR_RATE = 0.2
    MAX_MISS = 1.5
    STALE_STEPS = 16  # steps of a batch size after which a kind of step not observed among them is `stale`
    STALE_RATE = 0.5  # how far a stale factor moves toward its next observation (in log space)
    STALE_MISS = 2.0  # and the most that observation's miss counts, either way

    def __init__(self, costs: dict[int, float], kernels: dict[int, str] | None = None):
        self.sizes = sorted(costs)
        self.table = [costs[m] for m in self.sizes]
        self.kernels = {m: (kernels or {}).get(m, "torch") for m in self.sizes}
        self.scale = 1.0  # observed / predicted, tracked online
        # (rows, drafts verified) -> that step kind's own factor (`observe_step`)
        self.factors: dict[tuple[int, bool], float] = {}
        self.steps: dict[int, int] = {}  # rows -> steps of that batch size observed
        self.last_seen: dict[tuple[int, bool], int] = {}  # (rows, kind) -> its batch size's steps when last observed

    @classmethod
    def for_model(cls, model, use_disk_cache: bool = True) -> VerifyCostModel:
        """The cached table of this (model, dtype, device, threads), measured and cached first if there is none."""
        cached = cls.cached(model) if use_disk_cache else None
        if cached is not None:
            return cached
        table = cls(*choose_kernels(measure_verify_costs(model)))
        if use_disk_cache:
            table.save(model)
        return table

    @classmethod
    def cached(cls, model) -> VerifyCostModel | None:
        """The table cached for this (model, dtype, device, threads), or None; never measures."""
        path = _table_path(model)
        try:
            saved = json.loads(path.read_text())
            return cls({int(m): t for m, t in saved["costs"].items()}, {int(m): k for m, k in saved["kernels"].items()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError):  # none yet, or not a table: measure again
            return None

    def save(self, model) -> None:
        """Cache this table as the one of this (model, dtype, device, threads)."""
        path = _table_path(model)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"costs": dict(zip(self.sizes, self.table)), "kernels": self.kernels}))

    def cost(self, m: int) -> float:
        """Seconds of a verify of one sequence feeding m positions."""
        return self.step_cost(1, m)

    def step_cost(self, rows: int, width: int) -> float:
        """Seconds of a verify of `rows` sequences, each fed `width` positions (short rows padded)."""
        return self.scale * self.batch_factor(rows, width) * self._interpolate(rows * width)

    def batch_factor(self, rows: int, width: int) -> float:
        """What observed steps of this many rows took against the scaled table, kept apart for plain steps (width 1)
        and verifies of drafts: a batch's plain step, one token a row, runs other shapes than one sequence's forward
        of as many tokens and can measure far cheaper than it where the batch's verifies run as the table says, so
        one factor for both would make every verify look cheaper, or every plain step dearer, than it is. Where this
        (rows, kind) was never observed: the nearest observed batch size of the same kind, else of the other; 1
        before any."""
        if not self.factors:
            return 1.0
        drafted = width > 1
        same = [key for key in self.factors if key[1] == drafted] or list(self.factors)
        return self.factors[min(same, key=lambda key: (abs(key[0] - rows), key[0]))]

    def stale(self, rows: int, drafted: bool) -> bool:
        """Whether this batch size's steps of this kind (verifies of drafts, or plain steps) were last observed more
        than STALE_STEPS of its steps ago (or never, where steps of the batch size were). Each kind's factor is
        corrected only by its own steps, so a kind not chosen lately is costed from what it cost then: under other
        load, or in a call whose rows held other lengths of context. Costed too high, it would never be chosen again
        to be corrected."""
        steps = self.steps.get(rows, 0)
        return steps > 0 and steps - self.last_seen.get((rows, drafted), 0) > self.STALE_STEPS

    def kernel(self, m: int) -> str:
        """The kernel a forward of m fed rows runs: a probed width's choice; between two probed widths another
        kernel than PyTorch's only where both chose it; past the table PyTorch's own."""
        if m in self.kernels:
            return self.kernels[m]
        below = [s for s in self.sizes if s < m]
        above = [s for s in self.sizes if s > m]
        if below and above and self.kernels[below[-1]] == self.kernels[above[0]]:
            return self.kernels[below[-1]]
        return "torch"

    def row_kernels(self) -> dict[int, str]:
        """Each row count whose products run another kernel than PyTorch's, and that kernel: what a `Verifier`
        takes as `row_kernels`."""
        chosen = {m: self.kernel(m) for m in range(1, self.sizes[-1] + 1)}
        return {m: kernel for m, kernel in chosen.items() if kernel != "torch"}

    def observe(self, m: int, seconds: float) -> None:
        """Fold one measured verify of one sequence feeding m positions (`observe_step`)."""
        self.observe_step(1, m, seconds)

    def observe_step(self, rows: int, width: int, seconds: float) -> None:
        """Fold one measured verify time into the scale and the factor of this batch size and kind of step. Both
        move toward the observation in log space, the scale by SCALE_RATE of the miss (load is shared by every shape)
        and the factor by FACTOR_RATE (what is left is this step shape's own), the miss clipped to MAX_MISS either
        way so that one disturbed step moves neither far. A `stale` factor moves by STALE_RATE of a miss clipped to
        STALE_MISS: what it was last corrected to says little of now."""
        predicted = self.step_cost(rows, width)
        if predicted <= 0 or seconds <= 0:
            return
        kind = rows, width > 1
        stale = self.stale(*kind)
        limit, rate = (self.STALE_MISS, self.STALE_RATE) if stale else (self.MAX_MISS, self.FACTOR_RATE)
        miss = seconds / predicted
        if not stale:  # a stale factor's miss is its own error more than the machine's load
            self.scale *= min(max(miss, 1 / self.MAX_MISS), self.MAX_MISS) ** self.SCALE_RATE
        self.factors[kind] = self.batch_factor(rows, width) * min(max(miss, 1 / limit), limit) ** rate
        self.steps[rows] = self.steps.get(rows, 0) + 1
        self.last_seen[kind] = self.steps[rows]

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


def _table_path(model) -> Path:
    return measurements_dir() / f"{device_key(model)}.json"


def cached_kernel_choice(model) -> tuple[dict[int, str], dict[int, float]]:
    """What a `Verifier` takes from the cached table of `model`, read once: the row counts it runs through another
    kernel than PyTorch's, with that kernel (`row_kernels`), and the seconds of a forward feeding n tokens, by n
    (`forward_costs`). Both empty while no table is cached: PyTorch's kernels everywhere, so a plain step is never
    slower than `generate`'s and never waits for a measurement (nothing is measured here)."""
    table = VerifyCostModel.cached(model) if cpu_linears(model) else None
    if table is None:
        return {}, {}
    return table.row_kernels(), dict(zip(table.sizes, table.table))


def prepare_kernels(model) -> None:
    """Make what the kernels of `model`'s cached table need before any call runs them
    (`verifiers.kernels.prepare_linears`): otherwise the first call that feeds a width they serve pays for it."""
    row_kernels, _ = cached_kernel_choice(model)
    prepare_linears(cpu_linears(model), set(row_kernels.values()))
