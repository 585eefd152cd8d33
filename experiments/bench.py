"""Head-to-head tokens/s on the same prompts, same process, methods interleaved to cancel machine noise.

    python -m experiments.bench --dataset mt-bench --num-prompts 8 --max-new-tokens 128 --repeats 3
    accelerate launch --multi_gpu --num_processes 2 -m experiments.bench ...   # prompts split across 2 processes

Methods: plain `model.generate`; HF assisted generation with prompt lookup (`hf-lookup`); hybrid with each
named drafter of experiments.methods at its default block size, as `hybrid-NAME` (`hybrid-none`: no drafter,
`hybrid-lookup`, `hybrid-default`: what `hybrid.load_default()` builds, `hybrid-ar`: the 1-layer AR baseline,
...); and `oracle`, hybrid with a drafter that proposes the verifier's own greedy continuation at zero cost
(the ceiling of speculative decoding for this verifier on this machine: every method is also reported as a
fraction of it). Greedy by default; `--temperature T [--top-p P]` samples, each prompt after the same
`torch.manual_seed` in every method and repeat. Every output is checked against plain `generate`'s (under the
same seed when sampling: hybrid's default acceptance rule makes them identical). A hybrid method takes a
scheduler after `@` (`hybrid-block-lookup@fixed-4`, names as in schedulers.registry); without one it uses
`generate`'s default (cost-aware, learning across the prompts). Plain and hybrid methods take a cache layout
after `+`: `+static` (`cache_implementation="static"`, run eagerly) or `+compiled` (static and compiled as
`model.generate` compiles a static cache: CUDA graphs on a GPU, inductor on a CPU), e.g.
`plain+compiled,hybrid-default+compiled@fixed-8`. `+rejection` runs a hybrid method under
`acceptance="rejection"` (min(1, p/q)) instead of the default match rule: exact in distribution, not identical. A compiled method runs each prompt once untimed first
(compiling what its shapes need); those warm-up seconds are printed and kept in summary.json.

Every (repeat, prompt, method) measurement is appended to OUT/bench.jsonl as it finishes; rerunning the
same command resumes, skipping what is there. A method's tokens/s in one repeat is its tokens over its
seconds summed over the prompts; the table shows the median over repeats and the spread (min-max), and for a
hybrid method the share of its seconds its drafter took.
Sharded runs (as in experiments.acceptance) split the prompts across processes and gather on the main
one; each process times its own prompts, so tokens/s is comparable only between runs with the same
number of processes on the same machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import CompileConfig

import hybrid
from experiments.datasets import load_prompts
from experiments.methods import METHODS, check_fits_model, make_drafter, method_drafter
from experiments.models import MODEL_HELP, load_model
from experiments.runs import append_record, resume_sharded
from hybrid.stats import GenerationStats, timed
from schedulers import FixedScheduler
from schedulers.registry import NAMES_HELP, check_scheduler_name, make_scheduler
from verifiers.prompts import encode_prompt

DEFAULT_METHODS = ("plain", "hf-lookup", "hybrid-none", "hybrid-lookup", "hybrid-default", "oracle")
RECORDS_FILE = "bench.jsonl"
_SCHEDULERS: dict[str, object] = {}  # one per "method+layout@scheduler", kept across prompts as the default one is
WARM_UP: dict[str, float] = {}  # compiled method -> seconds of its warm-up call in this process
LAYOUTS = ("static", "compiled", "rejection")  # what a method may add after "+": a cache layout, or hybrid's rule


def parse_method(method: str) -> tuple[str, str | None, str | None]:
    """ "hybrid-default+compiled@fixed-4" -> ("hybrid-default", "compiled", "fixed-4"); a part left out is None."""
    name, _, scheduler = method.partition("@")
    base, _, layout = name.partition("+")
    return base, layout or None, scheduler or None


def layout_settings(layout: str | None) -> dict:
    """The `generate` arguments of a cache layout (the same for plain and hybrid methods)."""
    if layout is None:
        return {}
    if layout == "rejection":  # not a layout: hybrid's other acceptance rule, min(1, p/q), when sampling
        return {"acceptance": "rejection"}
    if layout == "static":
        return {"cache_implementation": "static", "disable_compile": True}
    config = CompileConfig()  # transformers' default: CUDA graphs on a GPU
    config._compile_all_devices = True  # compile on a CPU too, where model.generate would not by default
    return {"cache_implementation": "static", "compile_config": config}


def sampling_settings(temperature: float | None, top_p: float | None) -> dict:
    """`generate`'s sampling arguments for a bench run: greedy when temperature is None."""
    if temperature is None:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": temperature} | ({} if top_p is None else {"top_p": top_p})


def run_method(
    method: str, model, input_ids, reference, settings: dict, seed: int = 0
) -> tuple[torch.Tensor, float, GenerationStats | None]:
    """(output, seconds, hybrid's stats or None) for one method on `input_ids` (one prompt or a left-padded batch),
    decoded with `generate`'s arguments `settings` (max_new_tokens, attention_mask, sampling); sampled runs start
    from `torch.manual_seed(seed)`. Every method is timed the same way, end to end around its `generate` call."""
    base, layout, scheduler_name = parse_method(method)
    settings = settings | layout_settings(layout)
    drafter_name = method_drafter(base)
    drafter = None if drafter_name is None else make_drafter(drafter_name, None, reference, model)
    scheduler = FixedScheduler(16) if base == "oracle" and scheduler_name is None else None
    if scheduler_name is not None:
        scheduler = _SCHEDULERS.setdefault(method, make_scheduler(scheduler_name, drafter.node_budget))
    torch.manual_seed(seed)
    (out, stats), seconds = timed(lambda: decode(base, model, input_ids, drafter, scheduler, settings), model.device)
    return out, seconds, stats


def decode(
    base: str, model, input_ids, drafter, scheduler, settings: dict
) -> tuple[torch.Tensor, GenerationStats | None]:
    """One `generate` call of a method (its name without layout or scheduler): (output, hybrid's stats or None)."""
    if base == "plain":
        return model.generate(input_ids, **settings), None
    if base == "hf-lookup":
        return model.generate(input_ids, prompt_lookup_num_tokens=10, **settings), None
    return hybrid.generate(model, input_ids, drafter=drafter, scheduler=scheduler, return_stats=True, **settings)


def decoding_settings(input_ids: torch.Tensor, max_new_tokens: int, sampling: dict) -> dict:
    """`generate`'s arguments for one unpadded prompt."""
    return {"max_new_tokens": max_new_tokens, "attention_mask": torch.ones_like(input_ids)} | sampling


def prompt_sha(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def measurement_key(record: dict) -> tuple:
    fields = ("model", "dataset", "prompt_sha", "max_new_tokens", "repeat", "method")
    return (*(record[f] for f in fields), record.get("sampling", "greedy"))


def identity(args, text: str, repeat: int, method: str) -> dict:
    """The fields that name one measurement (what `measurement_key` reads)."""
    return {
        "model": args.model,
        "dataset": args.dataset,
        "prompt_sha": prompt_sha(text),
        "max_new_tokens": args.max_new_tokens,
        "repeat": repeat,
        "method": method,
        "sampling": sampling_label(args),
    }


def sampling_label(args) -> str:
    return "greedy" if args.temperature is None else f"T={args.temperature} top_p={args.top_p}"


def schedule(args, prompts: list[tuple[int, str]]) -> list[tuple[int, int, str, str]]:
    """(repeat, prompt index, prompt, method) in run order: repeat by repeat, prompt by prompt, the methods
    rotated so that none always runs first (after another method has warmed the caches)."""
    order = []
    for r in range(args.repeats):
        for i, text in prompts:
            shift = (r + i) % len(args.methods)
            order += [(r, i, text, m) for m in args.methods[shift:] + args.methods[:shift]]
    return order


def run_shard(
    args, prompts: list[tuple[int, str]], done: set[tuple], path: Path, load=load_model, show_progress: bool = True
) -> list[dict]:
    """Measure every pending (repeat, prompt, method) of `prompts`, appending each record to `path`."""
    pending = [
        (r, i, text, m)
        for r, i, text, m in schedule(args, prompts)
        if measurement_key(identity(args, text, r, m)) not in done
    ]
    if not pending:
        return []
    model, tokenizer = load(args.model)
    model = model.to(args.device)
    with torch.inference_mode():
        return _measure(args, model, tokenizer, pending, path, show_progress)


def _measure(args, model, tokenizer, pending, path: Path, show_progress: bool) -> list[dict]:
    warm_up = encode_prompt(tokenizer, pending[0][2]).to(model.device)
    model.generate(warm_up, attention_mask=torch.ones_like(warm_up), max_new_tokens=2, do_sample=False)
    references: dict[int, torch.Tensor] = {}
    records = []
    warmed: set[tuple[int, str]] = set()
    bar = tqdm(total=len(pending), desc="bench", unit="run", disable=not show_progress, dynamic_ncols=True)
    for r, i, text, method in pending:
        input_ids = encode_prompt(tokenizer, text).to(model.device)
        settings = decoding_settings(input_ids, args.max_new_tokens, sampling_settings(args.temperature, args.top_p))
        if i not in references:  # the output every method must reproduce (and the oracle proposes)
            torch.manual_seed(i)
            references[i] = model.generate(input_ids, **settings)
        if parse_method(method)[1] == "compiled" and (i, method) not in warmed:
            # Compile what this prompt's shapes need before timing it (model.generate's static cache is sized
            # per prompt, so it may recompile for each; hybrid's capacity is rounded up, so it rarely does).
            _, seconds, _ = run_method(method, model, input_ids, references[i], settings, i)
            WARM_UP[method] = WARM_UP.get(method, 0.0) + seconds
            warmed.add((i, method))
        out, seconds, stats = run_method(method, model, input_ids, references[i], settings, i)
        tau = None if stats is None else stats.tau
        record = dict(
            identity(args, text, r, method),
            prompt_index=i,
            new_tokens=out.shape[1] - input_ids.shape[1],
            seconds=seconds,
            tau=tau,
            draft_seconds=None if stats is None else stats.draft_time,
            pass_steps=None if stats is None else dict(Counter(p for p in stats.passes if p)),
            identical=bool(torch.equal(out, references[i])),
        )
        append_record(path, record)
        records.append(record)
        bar.update()
        postfix = {"method": method, "tok_s": f"{record['new_tokens'] / seconds:.1f}"}
        bar.set_postfix(postfix | ({"tau": f"{tau:.2f}"} if tau is not None else {}))
    bar.close()
    return records


def summarize(args, records: list[dict]) -> dict[str, dict]:
    """Per method: median tokens/s over repeats (with min and max), mean tau, speed-up, fraction of the oracle, and
    the share of its time spent drafting."""
    per_repeat: dict[str, dict[int, list[float]]] = {m: {} for m in args.methods}
    drafting: dict[str, list[float]] = {m: [0.0, 0.0] for m in args.methods}  # drafting seconds, all seconds
    taus: dict[str, dict[str, float]] = {m: {} for m in args.methods}
    identical = {m: True for m in args.methods}
    passes: dict[str, Counter] = {m: Counter() for m in args.methods}  # passes -> steps that ran a multi-pass stage
    for rec in records:
        tokens_seconds = per_repeat[rec["method"]].setdefault(rec["repeat"], [0, 0.0])
        tokens_seconds[0] += rec["new_tokens"]
        tokens_seconds[1] += rec["seconds"]
        if rec["tau"] is not None:
            taus[rec["method"]][rec["prompt_sha"]] = rec["tau"]  # one seed per prompt: the same in every repeat
        identical[rec["method"]] &= rec["identical"]
        passes[rec["method"]].update({int(p): n for p, n in (rec.get("pass_steps") or {}).items()})
        if rec.get("draft_seconds") is not None:
            drafting[rec["method"]][0] += rec["draft_seconds"]
            drafting[rec["method"]][1] += rec["seconds"]
    tps = {m: [t / s for t, s in per_repeat[m].values()] for m in args.methods}
    base = statistics.median(tps["plain"]) if "plain" in tps else None
    ceiling = statistics.median(tps["oracle"]) if "oracle" in tps else None
    rows = {}
    for m in args.methods:
        med = statistics.median(tps[m])
        rows[m] = {
            "tokens_per_s": med,
            "min": min(tps[m]),
            "max": max(tps[m]),
            "tau": statistics.mean(taus[m].values()) if taus[m] else None,
            "speedup": med / base if base else None,
            "fraction_of_oracle": med / ceiling if ceiling else None,
            "identical_to_plain": identical[m],
            "drafting_share": drafting[m][0] / drafting[m][1] if drafting[m][1] else None,
            "pass_steps": {p: passes[m][p] for p in sorted(passes[m])},
            "warm_up_s": WARM_UP.get(m),
        }
    return rows


def print_table(args, rows: dict[str, dict], num_prompts: int, processes: int) -> None:
    def fmt(x, spec):
        return "-" if x is None else format(x, spec)

    print(
        f"\n{args.dataset}: {num_prompts} prompts, {args.max_new_tokens} new tokens, {args.repeats} repeats, {sampling_label(args)}, "
        f"{processes} process(es) x {torch.get_num_threads()} threads"
    )
    print(
        f"{'method':<28}{'tok/s':>8}{'spread':>14}{'tau':>7}{'speed-up':>10}{'of oracle':>11}{'drafting':>10}  identical"
    )
    for m, row in rows.items():
        spread = f"{row['min']:.1f}-{row['max']:.1f}"
        share = row.get("drafting_share")
        speedup = "-" if row["speedup"] is None else f"{row['speedup']:.2f}x"
        print(
            f"{m:<28}{row['tokens_per_s']:>8.1f}{spread:>14}{fmt(row['tau'], '.2f'):>7}{speedup:>10}"
            f"{fmt(row['fraction_of_oracle'], '.2f'):>11}{'-' if share is None else f'{share:.1%}':>10}  "
            f"{'yes' if row['identical_to_plain'] else 'NO'}"
        )
    for m, row in rows.items():
        if row.get("pass_steps"):
            counts = ", ".join(f"{p}: {n}" for p, n in row["pass_steps"].items())
            print(
                f"{m}: denoising passes the scheduler chose, steps each among those that ran the block model's stage: {counts}"
            )
    for m, row in rows.items():
        if row["warm_up_s"] is not None:
            print(f"{m}: {row['warm_up_s']:.1f} s of untimed warm-up (compiling) over the prompts this process ran")


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m experiments.bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--dataset", default="dev", help="dev, dev-chat, mt-bench, humaneval, heldout or a .jsonl file of prompts"
    )
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--methods",
        default=",".join(DEFAULT_METHODS),
        help=f"comma-separated subset of {METHODS}; a hybrid one may add @SCHEDULER ({NAMES_HELP})",
    )
    parser.add_argument(
        "--model",
        default="default",
        help=MODEL_HELP,
    )
    parser.add_argument("--device", default="cpu", help="where the verifier and drafters run (cpu, cuda, cuda:1)")
    parser.add_argument("--temperature", type=float, default=None, help="sample at this temperature (default: greedy)")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus sampling with --temperature")
    parser.add_argument("--out", default="runs/bench", help="folder for bench.jsonl and summary.json; rerun to resume")
    args = parser.parse_args(argv)
    args.methods = list(dict.fromkeys(m.strip() for m in args.methods.split(",") if m.strip()))
    parsed = [parse_method(m) for m in args.methods]
    bases = [base for base, _, _ in parsed]
    unknown = [m for m, base in zip(args.methods, bases) if base not in METHODS]
    if unknown or not args.methods:
        parser.error(f"unknown method(s) {unknown}: choose from {', '.join(METHODS)}")
    for method, (base, layout, scheduler) in zip(args.methods, parsed):
        if layout is not None and layout not in LAYOUTS:
            parser.error(f"{method}: unknown cache layout {layout!r}: choose from {', '.join(LAYOUTS)}")
        if layout is not None and base == "hf-lookup":
            parser.error(f"{method}: assisted generation takes no cache layout; use plain+{layout} or a hybrid method")
        if layout == "rejection" and method_drafter(base) in (None, "none"):
            parser.error(f"{method}: +rejection is hybrid's acceptance rule: give it a hybrid method with a drafter")
        if scheduler is not None:
            if method_drafter(base) in (None, "none"):
                parser.error(f"{method}: only a hybrid method with a drafter takes a scheduler")
            try:
                check_scheduler_name(scheduler)
            except ValueError as error:
                parser.error(f"{method}: {error}")
    try:
        check_fits_model(args.model, bases, method_drafter)
    except ValueError as error:
        parser.error(str(error))
    if args.top_p is not None and args.temperature is None:
        parser.error("--top-p samples: give --temperature too")
    if args.temperature is not None and args.temperature <= 0:
        parser.error(f"--temperature {args.temperature} must be > 0 (leave it out for greedy)")
    for name in ("num_prompts", "max_new_tokens", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return parser, args


def main(argv=None, load=load_model) -> dict[str, dict]:
    """Run (or resume) the benchmark; returns the summary rows (empty on processes other than the main one)."""
    parser, args = parse_args(argv)
    try:
        prompts = load_prompts(args.dataset)[: args.num_prompts]  # before any model loads: bad names fail fast
    except (ValueError, RuntimeError) as e:
        parser.error(str(e))
    out = Path(args.out)
    indexed = list(enumerate(prompts))

    def run_mine(rank: int, processes: int, done: set[tuple], show_progress: bool) -> list[dict]:
        return run_shard(args, indexed[rank::processes], done, out / RECORDS_FILE, load, show_progress)

    records, processes = resume_sharded(out / RECORDS_FILE, measurement_key, run_mine)
    if records is None:  # not the main process
        return {}
    wanted = {measurement_key(identity(args, t, r, m)) for r, _, t, m in schedule(args, indexed)}
    records = [r for r in {measurement_key(r): r for r in records}.values() if measurement_key(r) in wanted]
    rows = summarize(args, records)
    print_table(args, rows, len(prompts), processes)
    command = ["python", "-m", "experiments.bench", *(sys.argv[1:] if argv is None else argv)]
    summary = {
        "command": command,
        "processes": processes,
        "threads": torch.get_num_threads(),
        "methods": rows,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
