"""Acceptance-rate sweep: tau, acceptance by block position and speed-up per dataset x drafter x scheduler.

    python -m experiments.acceptance --datasets dev,humaneval --drafters lookup,none \\
        --schedulers heuristic,fixed --block-sizes 2,4,8 --temperatures 0,0.7 --num-prompts 8
    accelerate launch --multi_gpu --num_processes 2 -m experiments.acceptance ...   # prompts split across 2 processes
    torchrun --nproc_per_node 2 -m experiments.acceptance ...   # the same without accelerate's launcher

The sweep runs on the CPU; the processes talk through gloo, so `--multi_gpu` works on a machine without
GPUs (it starts N torchrun workers). `accelerate launch --cpu --num_processes N` starts ONE process
unless mpirun is installed and --mpirun_hostfile given (accelerate 1.15); this command warns when it sees that.

One run = one prompt under one configuration (dataset, drafter, scheduler, block size, temperature).
Each finished run is appended to OUT/runs.jsonl at once, so an interrupted sweep rerun with the same
--out skips what it already has. At the end the main process writes OUT/summary.csv, OUT/report.md
and, when matplotlib is installed, PNG plots. Every prompt is also decoded by plain `model.generate`
in the same process (the speed-up baseline); greedy runs are checked token for token against it.

Schedulers (schedulers.registry): `heuristic` (HF's +2/-1 rule, capped by the block size), `fixed`
(k = the block size), `fixed-K` (k = K, at most the block size), `confidence[-T]`, `cost-aware`.
The block size is the drafter's max_draft_len.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import math
import os
import shlex
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

import hybrid
from drafters import Drafter, OracleDrafter, PromptLookupDrafter
from experiments import metrics, plots, trained_drafters
from experiments.datasets import load_prompts
from schedulers import Scheduler
from schedulers.registry import NAMES_HELP, check_scheduler_name, fixed_k, make_scheduler
from verifiers.prompts import encode_prompt

RUNS_FILE, SUMMARY_FILE, REPORT_FILE = "runs.jsonl", "summary.csv", "report.md"


# ---------------------------------------------------------------------------------------------------
# What can be swept. A new drafter plugs in with one DRAFTERS entry.


@dataclass(frozen=True)
class DrafterEntry:
    """How to build a drafter for one run: make(block_size, reference, model) where `reference` is the plain
    greedy `model.generate` output for the prompt ([1, prompt + new]; only an oracle reads it) and `model`
    the verifier (drafters conditioned on it need it)."""

    make: Callable[[int, torch.Tensor, object], Drafter]
    default_block_size: int
    max_block_size: int | None = None  # the most it can propose per step (a block model's trained size); None: any


DRAFTERS: dict[str, DrafterEntry | None] = {
    "none": None,  # plain decoding through the engine: tau 1, the engine's own overhead
    "lookup": DrafterEntry(
        lambda block, reference, model: PromptLookupDrafter(max_draft_len=block), default_block_size=10
    ),
    # Prompt lookup continued by the shipped n-gram store of the verifier's training answers: no model.
    "lookup-store": DrafterEntry(
        lambda block, reference, model: PromptLookupDrafter(
            max_draft_len=block, ngram_store=trained_drafters.ngram_store()
        ),
        default_block_size=10,
    ),
    # The verifier's own greedy text at zero cost: the ceiling of speculative decoding on this machine.
    "oracle": DrafterEntry(
        lambda block, reference, model: OracleDrafter(reference, max_draft_len=block), default_block_size=16
    ),
    # The shipped block-diffusion drafter (block size here = drafted tokens; the block adds the anchor).
    "block": DrafterEntry(
        lambda block, reference, model: trained_drafters.block(model, block),
        default_block_size=trained_drafters.MAX_DRAFTED,
        max_block_size=trained_drafters.MAX_DRAFTED,
    ),
    "block-lookup": DrafterEntry(
        lambda block, reference, model: trained_drafters.block(model, block, lookup=True),
        default_block_size=trained_drafters.MAX_DRAFTED,
        max_block_size=trained_drafters.MAX_DRAFTED,
    ),
    # The shipped default: the block model, lookup and the n-gram store (hybrid.load_default()).
    "block-lookup-store": DrafterEntry(
        lambda block, reference, model: trained_drafters.block(model, block, True, store=True),
        default_block_size=trained_drafters.MAX_DRAFTED,
        max_block_size=trained_drafters.MAX_DRAFTED,
    ),
    # The same with two denoising passes (the confident leading run fixed after the first, the rest re-predicted).
    "block-lookup-2steps": DrafterEntry(
        lambda block, reference, model: trained_drafters.block(model, block, True, steps=2),
        default_block_size=trained_drafters.MAX_DRAFTED,
        max_block_size=trained_drafters.MAX_DRAFTED,
    ),
    # The trained block with lookup matches proposed up to the block size asked for (15 by default), past the block.
    "block-long-lookup": DrafterEntry(
        lambda block, reference, model: trained_drafters.block(model, block, long_lookup=True),
        default_block_size=trained_drafters.LONG_LOOKUP_TOKENS,
    ),
    "block-long-lookup-store": DrafterEntry(
        lambda block, reference, model: trained_drafters.block(model, block, long_lookup=True, store=True),
        default_block_size=trained_drafters.LONG_LOOKUP_TOKENS,
    ),
    # The default drafter (`hybrid.load_default()`): the above with the longest context match up to 32 tokens,
    # and the store preferred over a one-token match; and the same lookup without the model.
    "default": DrafterEntry(
        lambda block, reference, model: trained_drafters.default(model, block),
        default_block_size=trained_drafters.LONG_LOOKUP_TOKENS,
    ),
    "match-store": DrafterEntry(
        lambda block, reference, model: trained_drafters.match_store(block),
        default_block_size=trained_drafters.LONG_LOOKUP_TOKENS,
    ),
    # The 1-layer AR baseline of the same trainable budget (`python -m drafters.training.train --arch ar`).
    "ar": DrafterEntry(lambda block, reference, model: trained_drafters.ar(model, block), default_block_size=6),
}


@dataclass(frozen=True)
class Config:
    """One point of the sweep. scheduler and block_size are None for the `none` drafter."""

    drafter: str
    scheduler: str | None
    block_size: int | None
    temperature: float

    def make_drafter(self, reference: torch.Tensor, model) -> Drafter | None:
        entry = DRAFTERS[self.drafter]
        return None if entry is None else entry.make(self.block_size, reference, model)

    def make_scheduler(self) -> Scheduler | None:
        return None if self.scheduler is None else make_scheduler(self.scheduler, self.block_size)


@dataclass(frozen=True)
class Prompt:
    dataset: str
    index: int  # position in the dataset
    text: str

    @property
    def sha1(self) -> str:  # in the run key, so an edited prompts file does not reuse stale runs
        return hashlib.sha1(self.text.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class Plan:
    model: str
    prompts: list[Prompt]
    configs: list[Config]
    max_new_tokens: int
    seed: int


# A run is identified by these record fields; resume compares them.
KEY_FIELDS = (
    "model",
    "dataset",
    "prompt_index",
    "prompt_sha1",
    "drafter",
    "scheduler",
    "block_size",
    "temperature",
    "max_new_tokens",
    "seed",
)
CONFIG_FIELDS = ("dataset", "drafter", "scheduler", "block_size", "temperature")


def run_fields(plan: Plan, prompt: Prompt, config: Config) -> dict:
    return {
        "model": plan.model,
        "dataset": prompt.dataset,
        "prompt_index": prompt.index,
        "prompt_sha1": prompt.sha1,
        "drafter": config.drafter,
        "scheduler": config.scheduler,
        "block_size": config.block_size,
        "temperature": config.temperature,
        "max_new_tokens": plan.max_new_tokens,
        "seed": plan.seed,
    }


def run_key(record: dict) -> tuple:
    return tuple(record[field] for field in KEY_FIELDS)


# ---------------------------------------------------------------------------------------------------
# Models. `tiny` is a random Llama with a byte tokenizer: the whole command runs in seconds, for tests.


def load_default_model():
    model, tokenizer, _ = hybrid.load_default()
    return model, tokenizer


def load_tiny_model():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from hybrid.testing import tiny_model

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # one token per byte, no merges
    byte_level = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    byte_level.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=byte_level)
    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    # The tests' tiny Llama (hybrid.testing), one token per byte: the same weights in every process.
    model = tiny_model("llama", len(alphabet), 2, seed=0, max_position_embeddings=1024)
    return model, tokenizer


def load_pretrained(path: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


MODELS = {"default": load_default_model, "tiny": load_tiny_model}


def load_model(name: str):
    """(model, tokenizer) for a MODELS name or a local checkpoint folder."""
    return MODELS[name]() if name in MODELS else load_pretrained(name)


# ---------------------------------------------------------------------------------------------------
# The plan: every argument checked here, before any model loads.


def split_list(text: str, option: str) -> list[str]:
    items = list(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    if not items:
        raise ValueError(f"{option} is empty: give a comma-separated list")
    return items


def parse_numbers(text: str, option: str, kind: type) -> list:
    values = []
    for item in split_list(text, option):
        try:
            values.append(kind(item))
        except ValueError:
            raise ValueError(f"{option}: {item!r} is not {'an integer' if kind is int else 'a number'}") from None
    return values


def expand_configs(
    drafters: list[str], schedulers: list[str], block_sizes: list[int] | None, temperatures: list[float]
) -> list[Config]:
    """drafters x schedulers x block sizes x temperatures; `none` has neither scheduler nor block size."""
    for name in drafters:
        if name not in DRAFTERS:
            raise ValueError(f"unknown drafter {name!r}: choose from {sorted(DRAFTERS)}")
    for name in schedulers:
        check_scheduler_name(name)
    for size in block_sizes or []:
        if size < 1:
            raise ValueError(f"block size {size} must be >= 1")
    for t in temperatures:
        if not (math.isfinite(t) and t >= 0):
            raise ValueError(f"temperature {t} must be >= 0 (0 means greedy)")
    configs = []
    for name in drafters:
        entry = DRAFTERS[name]
        if entry is None:
            configs += [Config(name, None, None, t) for t in temperatures]
            continue
        for size in block_sizes or [entry.default_block_size]:
            if entry.max_block_size is not None and size > entry.max_block_size:
                raise ValueError(f"block size {size} is above drafter {name!r}'s maximum of {entry.max_block_size}")
            for scheduler in schedulers:
                k = fixed_k(scheduler, size)
                if k is not None and k > size:
                    raise ValueError(
                        f"scheduler {scheduler} verifies {k} tokens but block size {size} lets the drafter propose "
                        f"at most {size}: use block sizes >= {k}, or `fixed` for k = block size"
                    )
                configs += [Config(name, scheduler, size, t) for t in temperatures]
    return configs


def make_plan(args: argparse.Namespace) -> Plan:
    """Validate every argument and load the prompts; raises ValueError naming the bad value and the fix."""
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts {args.num_prompts}: need at least 1")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens}: need at least 1")
    if args.model not in MODELS and not (Path(args.model) / "config.json").is_file():
        raise ValueError(
            f"--model {args.model!r}: use {' or '.join(MODELS)}, or a local checkpoint folder with config.json"
        )
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise ValueError(f"--out {args.out} is a file; it must be a folder")
    block_sizes = parse_numbers(args.block_sizes, "--block-sizes", int) if args.block_sizes else None
    configs = expand_configs(
        split_list(args.drafters, "--drafters"),
        split_list(args.schedulers, "--schedulers"),
        block_sizes,
        parse_numbers(args.temperatures, "--temperatures", float),
    )
    prompts = []
    for dataset in split_list(args.datasets, "--datasets"):
        texts = load_prompts(dataset)[: args.num_prompts]
        if not texts:
            raise ValueError(f"dataset {dataset!r} has no prompts")
        prompts += [Prompt(dataset, i, text) for i, text in enumerate(texts)]
    return Plan(args.model, prompts, configs, args.max_new_tokens, args.seed)


# ---------------------------------------------------------------------------------------------------
# Running: one prompt at a time, every pending configuration on it, plain generate once as reference.


def decoding_settings(temperature: float, max_new_tokens: int) -> dict:
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    return {"max_new_tokens": max_new_tokens} | sampling


def seed_for(*parts) -> int:
    """A seed from the run's identity, not from its place in a shard: sharded and unsharded runs agree."""
    return zlib.crc32(json.dumps(parts).encode())


def plain_generate(model, input_ids: torch.Tensor, temperature: float, plan: Plan, prompt: Prompt):
    """(output, seconds) of plain `model.generate`: the baseline, and for greedy the reference output."""
    torch.manual_seed(
        seed_for(plan.seed, prompt.dataset, prompt.index, temperature)
    )  # generate samples from the global RNG
    start = time.perf_counter()
    out = model.generate(
        input_ids, attention_mask=torch.ones_like(input_ids), **decoding_settings(temperature, plan.max_new_tokens)
    )
    return out, time.perf_counter() - start


def run_one(model, input_ids, config: Config, fields: dict, reference, baseline, scheduler=None) -> dict:
    """Decode one prompt under one configuration; the record that goes to runs.jsonl."""
    generator = torch.Generator(device=model.device).manual_seed(seed_for(*run_key(fields)))
    out, stats = hybrid.generate(
        model,
        input_ids,
        drafter=config.make_drafter(reference, model),
        scheduler=scheduler or config.make_scheduler(),
        generator=generator,
        return_stats=True,
        **decoding_settings(config.temperature, fields["max_new_tokens"]),
    )
    baseline_out, baseline_time = baseline
    baseline_new_tokens = baseline_out.shape[1] - input_ids.shape[1]
    baseline_tokens_per_s = baseline_new_tokens / baseline_time
    return fields | {
        "prompt_tokens": input_ids.shape[1],
        "new_tokens": stats.new_tokens,
        "output_ids": out[0, input_ids.shape[1] :].tolist(),
        "tau": stats.tau,
        "verifier_forwards": stats.verifier_forwards,
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "emitted": stats.emitted,
        "acceptance_by_position": metrics.acceptance_by_position(stats.drafted, stats.accepted),
        "prefill_time": stats.prefill_time,
        "draft_time": stats.draft_time,
        "verify_time": stats.verify_time,
        "total_time": stats.total_time,
        "tokens_per_s": stats.tokens_per_second,
        "baseline_new_tokens": baseline_new_tokens,
        "baseline_time": baseline_time,
        "baseline_tokens_per_s": baseline_tokens_per_s,
        "speedup": stats.tokens_per_second / baseline_tokens_per_s,
        # Greedy: always compared with plain generate. Sampled outputs differ by design (other random draws).
        "matches_generate": bool(torch.equal(out, reference)) if config.temperature == 0 else None,
    }


def run_shard(
    plan: Plan, prompts: list[Prompt], done: set[tuple], runs_path: Path, load=load_model, show_progress: bool = True
) -> list[dict]:
    """Run every configuration not in `done` on `prompts`, appending each record to runs_path as it finishes.

    The model loads only if something is pending, so a finished sweep reruns in a second.
    """
    pending = []
    for prompt in prompts:
        todo = [(c, f) for c in plan.configs if run_key(f := run_fields(plan, prompt, c)) not in done]
        if todo:
            pending.append((prompt, todo))
    total = sum(len(todo) for _, todo in pending)
    if not total:
        return []
    model, tokenizer = load(plan.model)
    warm_up = encode_prompt(tokenizer, pending[0][0].text)
    model.generate(
        warm_up, attention_mask=torch.ones_like(warm_up), max_new_tokens=2, do_sample=False
    )  # first-call costs

    records = []
    # One scheduler per configuration for the whole shard: adaptive ones learn from every prompt so far.
    schedulers = {config: config.make_scheduler() for config in plan.configs}
    bar = tqdm(total=total, desc="acceptance", unit="run", disable=not show_progress, dynamic_ncols=True)
    for prompt, todo in pending:
        input_ids = encode_prompt(tokenizer, prompt.text).to(model.device)
        # Plain generate once per prompt and temperature; the greedy one is also the reference output.
        baselines = {0.0: plain_generate(model, input_ids, 0.0, plan, prompt)}
        reference = baselines[0.0][0]
        for config, fields in todo:
            if config.temperature not in baselines:
                baselines[config.temperature] = plain_generate(model, input_ids, config.temperature, plan, prompt)
            record = run_one(
                model, input_ids, config, fields, reference, baselines[config.temperature], schedulers[config]
            )
            append_record(runs_path, record)
            records.append(record)
            bar.update()
            tokens, seconds = sum(r["new_tokens"] for r in records), sum(r["total_time"] for r in records)
            bar.set_postfix(tau=f"{sum(r['tau'] for r in records) / len(records):.2f}", tok_s=f"{tokens / seconds:.1f}")
    bar.close()
    return records


# ---------------------------------------------------------------------------------------------------
# runs.jsonl: appended by every process, read back on resume.


def append_record(path: Path, record: dict) -> None:
    # One write() on an O_APPEND descriptor: lines from several processes never interleave, and an
    # interruption loses at most the line being written.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
    finally:
        os.close(fd)


def read_records(path: Path, key=None) -> list[dict]:
    """Records of a JSONL file, first one per `key` (default: run_key); unreadable lines (an interrupted
    write) are skipped."""
    key_of = key or run_key
    if not path.exists():
        return []
    records, seen = [], set()
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            record_key = key_of(record)
        except (json.JSONDecodeError, KeyError, TypeError):
            print(
                f"{path}:{number}: unreadable line skipped (an interrupted write?); that run is redone", file=sys.stderr
            )
            continue
        if record_key not in seen:
            seen.add(record_key)
            records.append(record)
    return records


def drop_partial_line(path: Path) -> None:
    """An interrupted write can leave the file ending mid-line: cut that fragment (its run is redone),
    so the next record starts a line of its own."""
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with open(path, "rb+") as f:
            f.truncate(data.rfind(b"\n") + 1)


# ---------------------------------------------------------------------------------------------------
# Outputs: written by the main process from every record of this plan.


def in_plan_order(plan: Plan, records: list[dict]) -> list[dict]:
    """The records of this plan (not stale ones from other settings), prompt by prompt, config by config."""
    order = {
        run_key(run_fields(plan, p, c)): i
        for i, (p, c) in enumerate((p, c) for p in plan.prompts for c in plan.configs)
    }
    mine = {run_key(r): r for r in records if run_key(r) in order}
    return sorted(mine.values(), key=lambda r: order[run_key(r)])


def fmt(x, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return ""
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def write_csv(path: Path, rows: list[dict]) -> None:
    depth = max((len(r["acceptance_by_position"]) for r in rows), default=0)
    columns = [
        *CONFIG_FIELDS,
        "runs",
        "mean_tau",
        "tokens_per_s",
        "baseline_tokens_per_s",
        "speedup",
        "acceptance_rate",
        "matches_generate",
        "checked_against_generate",
    ]
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(columns + [f"accept_pos_{i}" for i in range(1, depth + 1)])
        for r in rows:
            by_position = r["acceptance_by_position"] + [None] * (depth - len(r["acceptance_by_position"]))
            config = ["" if r[c] is None else r[c] for c in CONFIG_FIELDS]
            writer.writerow(
                config + [fmt(r[c], 4) for c in columns[len(CONFIG_FIELDS) :]] + [fmt(x, 4) for x in by_position]
            )


def config_label(row: dict) -> str:
    if row["scheduler"] is None:
        return f"{row['drafter']} T={row['temperature']:g}"
    return f"{row['drafter']} {row['scheduler']} b={row['block_size']} T={row['temperature']:g}"


def matches_text(row: dict) -> str:
    return "" if row["matches_generate"] is None else f"{row['matches_generate']}/{row['checked_against_generate']}"


def against_fixed(rows: list[dict]) -> list[str]:
    """For every adaptive scheduler run next to fixed-k runs of the same (dataset, drafter, block, T): its tokens/s
    against the best of those fixed k (chosen in hindsight) and against the largest k swept."""
    group = lambda r: (r["dataset"], r["drafter"], r["block_size"], r["temperature"])  # noqa: E731
    ks = [None if r["scheduler"] is None else fixed_k(r["scheduler"], r["block_size"]) for r in rows]
    fixed_by_group: dict[tuple, dict[int, dict]] = {}
    for r, k in zip(rows, ks):
        if k is not None:
            fixed_by_group.setdefault(group(r), {})[k] = r
    lines = []
    for r, k in zip(rows, ks):
        fixed = fixed_by_group.get(group(r))
        if k is not None or r["scheduler"] is None or not fixed:
            continue
        best_k = max(fixed, key=lambda j: fixed[j]["tokens_per_s"])
        best, largest = fixed[best_k], fixed[max(fixed)]
        lines.append(
            f"{r['dataset']} {r['drafter']} b={r['block_size']} T={r['temperature']:g}: {r['scheduler']} "
            f"{r['tokens_per_s']:.1f} tok/s = {r['tokens_per_s'] / best['tokens_per_s']:.2f}x the best fixed k in "
            f"hindsight (k = {best_k} of {len(fixed)} swept, {best['tokens_per_s']:.1f}), "
            f"{r['tokens_per_s'] / largest['tokens_per_s']:.2f}x fixed k = {max(fixed)} ({largest['tokens_per_s']:.1f})"
        )
    return lines


def report_markdown(plan: Plan, rows: list[dict], command: str, processes: int, plot_files: list[str]) -> str:
    datasets = ", ".join(
        dict.fromkeys(f"{p.dataset} ({sum(q.dataset == p.dataset for q in plan.prompts)})" for p in plan.prompts)
    )
    lines = [
        "# Acceptance rates",
        "",
        f"`{command}`",
        "",
        f"model `{plan.model}`; prompts per dataset: {datasets}; {plan.max_new_tokens} new tokens; seed {plan.seed}; "
        f"{processes} process(es), {torch.get_num_threads()} thread(s) each; {time.strftime('%Y-%m-%d %H:%M')}.",
        "",
        "| dataset | drafter | scheduler | block | T | runs | tau | tok/s | plain tok/s | speed-up | accepted/drafted "
        "| = generate |",
        "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['dataset']} | {r['drafter']} | {r['scheduler'] or '-'} | {r['block_size'] or '-'} | {r['temperature']:g} "
            f"| {r['runs']} | {r['mean_tau']:.2f} | {r['tokens_per_s']:.1f} | {r['baseline_tokens_per_s']:.1f} "
            f"| {r['speedup']:.2f}x | {fmt(r['acceptance_rate'])} | {matches_text(r) or '-'} |"
        )
    comparisons = against_fixed(rows)
    if comparisons:
        lines += ["", "## Adaptive schedulers against fixed k", ""] + [f"* {line}" for line in comparisons]
    drafting = [r for r in rows if r["acceptance_by_position"]]
    if drafting:
        depth = max(len(r["acceptance_by_position"]) for r in drafting)
        lines += [
            "",
            "## Acceptance by block position",
            "",
            "Position i: of the steps that drafted at least i tokens, the fraction whose first i were all accepted.",
            "",
            "| dataset | configuration | " + " | ".join(map(str, range(1, depth + 1))) + " |",
            "|---|---|" + "---:|" * depth,
        ]
        for r in drafting:
            cells = [fmt(x) for x in r["acceptance_by_position"]] + [""] * (depth - len(r["acceptance_by_position"]))
            lines.append(f"| {r['dataset']} | {config_label(r)} | " + " | ".join(cells) + " |")
        lines += [
            "",
            "## Accepted length per drafting step",
            "",
            "Fraction of the steps that drafted anything which accepted exactly n tokens.",
            "",
        ]
        width = max(len(r["accepted_length_histogram"]) for r in drafting)
        lines += [
            "| dataset | configuration | " + " | ".join(map(str, range(width))) + " |",
            "|---|---|" + "---:|" * width,
        ]
        for r in drafting:
            histogram = r["accepted_length_histogram"]
            cells = [f"{n / sum(histogram):.2f}" for n in histogram] + [""] * (width - len(histogram))
            lines.append(f"| {r['dataset']} | {config_label(r)} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Definitions",
        "",
        "* tau: tokens emitted per verifier forward, the prefill included (1.00 for plain decoding); mean over prompts.",
        "* tok/s: all new tokens over all seconds of the configuration's runs; plain tok/s: the same for plain "
        "`model.generate` on the same prompts in the same process (sampled with the same temperature); speed-up: their ratio.",
        "* accepted/drafted: drafted tokens kept over drafted tokens verified, pooled over steps.",
        "* = generate: greedy runs whose output equals plain `model.generate` token for token.",
    ]
    if plot_files:
        lines += ["", "## Plots", ""] + [f"![{name}]({name})" for name in plot_files]
    return "\n".join(lines) + "\n"


def write_outputs(plan: Plan, records: list[dict], out: Path, command: str, processes: int) -> list[dict]:
    rows = metrics.summarize(records, CONFIG_FIELDS)
    write_csv(out / SUMMARY_FILE, rows)
    plot_files = plots.write_plots(records, rows, out) if plots.available() else []
    (out / REPORT_FILE).write_text(report_markdown(plan, rows, command, processes, plot_files))
    return rows


def print_summary(rows: list[dict], out: Path, plotted: bool) -> None:
    d = max(len("dataset"), *(len(r["dataset"]) for r in rows)) + 2
    c = max(len("configuration"), *(len(config_label(r)) for r in rows)) + 2
    print(
        f"{'dataset':<{d}}{'configuration':<{c}}{'runs':>5}{'tau':>7}{'tok/s':>8}{'plain':>8}{'speed-up':>10}"
        f"{'accepted':>10}  = generate"
    )
    for r in rows:
        print(
            f"{r['dataset']:<{d}}{config_label(r):<{c}}{r['runs']:>5}{r['mean_tau']:>7.2f}{r['tokens_per_s']:>8.1f}"
            f"{r['baseline_tokens_per_s']:>8.1f}{r['speedup']:>9.2f}x{fmt(r['acceptance_rate']):>10}  "
            f"{matches_text(r) or '-'}"
        )
    for line in against_fixed(rows):
        print(line)
    written = [RUNS_FILE, SUMMARY_FILE, REPORT_FILE] + (["*.png"] if plotted else [])
    print(f"wrote {', '.join(str(out / name) for name in written)}")
    if not plotted:
        print("(no plots: pip install matplotlib, or pip install -e '.[experiments]')")


# ---------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(prog="python -m experiments.acceptance", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--datasets", default="dev", help="comma list of dev, mt-bench, humaneval or .jsonl prompt files"
    )
    parser.add_argument("--drafters", default="lookup,none", help=f"comma list of {', '.join(DRAFTERS)}")
    parser.add_argument("--schedulers", default="heuristic", help=f"comma list of {NAMES_HELP}")
    parser.add_argument(
        "--block-sizes", default=None, help="comma list: the drafter's max_draft_len (default: each drafter's own)"
    )
    parser.add_argument("--temperatures", default="0", help="comma list; 0 = greedy, else sampling at that temperature")
    parser.add_argument("--num-prompts", type=int, default=8, help="first N prompts of each dataset")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--model",
        default="default",
        help="default (SmolLM2-135M-Instruct), tiny (random, for tests) or a local checkpoint folder",
    )
    parser.add_argument("--out", default="runs/acceptance", help="output folder; rerun with the same one to resume")
    return parser, parser.parse_args(argv)


def started_alone_by_accelerate() -> bool:
    """accelerate's CPU launcher without mpirun: it sets MASTER_PORT (only when asked for N > 1
    processes) but starts one process, so no WORLD_SIZE reaches it."""
    asked_cpu = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
    return asked_cpu and "MASTER_PORT" in os.environ and "WORLD_SIZE" not in os.environ


def main(argv: list[str] | None = None, load=load_model) -> list[dict]:
    """Run the sweep; returns the summary rows (empty on processes other than the main one)."""
    from accelerate import PartialState
    from accelerate.utils import gather_object

    parser, args = parse_args(argv)
    try:
        plan = make_plan(args)
    except (ValueError, RuntimeError) as e:  # RuntimeError: an evaluation set's wheel could not be fetched
        parser.error(str(e))

    # cpu=True: the models run on the CPU, and gloo carries gather_object under any launcher.
    state = PartialState(cpu=True)  # one process unless started by `accelerate launch` or torchrun
    if state.num_processes == 1 and started_alone_by_accelerate():
        print(
            "warning: `accelerate launch --cpu --num_processes N` started a single process (it needs mpirun for more); "
            "running unsharded. For N processes on the CPU use `accelerate launch --multi_gpu --num_processes N` "
            "or `torchrun --nproc_per_node N`",
            file=sys.stderr,
        )
    out, runs_path = Path(args.out), Path(args.out) / RUNS_FILE
    if state.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        drop_partial_line(runs_path)
    state.wait_for_everyone()
    done = read_records(runs_path)
    state.wait_for_everyone()  # everyone has read the file before anyone appends to it

    # Striding keeps each process's prompts spread over all datasets.
    mine = plan.prompts[state.process_index :: state.num_processes]
    new = run_shard(plan, mine, {run_key(r) for r in done}, runs_path, load, show_progress=state.is_main_process)
    new = gather_object(new) if state.num_processes > 1 else new
    # Every process is done with the others: close the group now, not at interpreter exit, where gloo's threads
    # being torn down once aborted a worker ("terminate called without an active exception", SIGABRT).
    state.destroy_process_group()
    if not state.is_main_process:
        return []
    records = in_plan_order(plan, done + new)
    command = shlex.join(["python", "-m", "experiments.acceptance", *(sys.argv[1:] if argv is None else argv)])
    rows = write_outputs(plan, records, out, command, state.num_processes)
    print_summary(rows, out, plots.available())
    return rows


if __name__ == "__main__":
    main()
