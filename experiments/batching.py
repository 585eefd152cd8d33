"""Batched decoding: tokens/s of plain `model.generate`, hybrid without drafts and hybrid with the default drafter
on left-padded batches, and what the drafts add at each batch size.

    python -m experiments.batching --dataset mt-bench --num-prompts 8 --batch-sizes 1,2,4,8 --max-new-tokens 64
    python -m experiments.batching --model tiny --methods plain,hybrid-none,hybrid-lookup --num-prompts 4 \\
        --batch-sizes 1,2 --max-new-tokens 8 --repeats 1   # CI size

The same prompts (chat template, left-padded) are decoded greedily in batches of each size, every row exactly
--max-new-tokens tokens (min_new_tokens), so every method emits the same tokens. It is experiments.regimes on one
prompt set at temperature 0: the methods interleaved batch by batch in each of --repeats repeats, each timed end
to end, tokens/s the median over repeats. Every method's output on every batch is checked against
`model.generate`'s on the same batch ("= generate"). Each method is reported against plain `generate`, and each
drafting method against `hybrid-none`, the same engine without drafts: that ratio is what the drafts add.

Measurements go to OUT/batching.jsonl (rerunning the same command resumes), the summary to OUT/batching.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from experiments import regimes
from experiments.arguments import parse_numbers, split_list
from experiments.models import MODEL_HELP, load_model

RECORDS_FILE, SUMMARY_FILE = "batching.jsonl", "batching.json"


def parse_args(argv) -> tuple[argparse.Namespace, dict[str, list[str]]]:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.batching", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="default", help=MODEL_HELP)
    parser.add_argument(
        "--dataset", default="mt-bench", help="dev, dev-chat, mt-bench, humaneval, heldout or a .jsonl file"
    )
    parser.add_argument("--num-prompts", type=int, default=4, help="a multiple of every batch size")
    parser.add_argument("--batch-sizes", default="1,2,4")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--methods",
        default=regimes.DEFAULT_METHODS,
        help="comma list of plain and hybrid-NAME[@SCHEDULER] (experiments.bench's names; hybrid-none: no drafter)",
    )
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    parser.add_argument("--out", default="runs/batching", help="folder for batching.jsonl and batching.json")
    args = parser.parse_args(argv)
    args.datasets, args.temperatures, args.min_new_tokens = [args.dataset], [0.0], args.max_new_tokens
    args.min_pairs = 0  # every batch size runs --repeats times
    try:
        args.methods = split_list(args.methods, "--methods")
        args.batch_sizes = parse_numbers(args.batch_sizes, "--batch-sizes", int)
        prompts = regimes.checked_prompts(args)
    except (ValueError, RuntimeError) as error:
        parser.error(str(error))
    return args, prompts


def main(argv=None, load=load_model) -> list[dict]:
    """Run (or resume) the measurements; returns one summary row per batch size (empty on processes other than
    the main one)."""
    args, prompts = parse_args(argv)
    out = Path(args.out)
    records, processes = regimes.collect(args, regimes.plan_batches(args, prompts), out / RECORDS_FILE, load)
    if records is None:
        return []
    rows = regimes.summarize(args, records)
    print("\n" + report(args, rows, processes), end="")
    command = ["python", "-m", "experiments.batching", *(sys.argv[1:] if argv is None else argv)]
    summary = {"command": command, "processes": processes, "threads": torch.get_num_threads(), "batches": rows}
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    return rows


def speed(row: dict, method: str) -> float | None:
    return row["methods"].get(method, {}).get("tokens_per_s")


def ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None else f"{a / b:.2f}x"


def against_plain(row: dict, method: str) -> str:
    return "" if method == "plain" else ratio(speed(row, method), speed(row, "plain"))


def report(args, rows: list[dict], processes: int) -> str:
    drafting = regimes.drafting_methods(args.methods)
    widths = {m: max(len(m), 6) + 2 for m in args.methods}
    lines = [
        f"{args.dataset}: {args.num_prompts} prompts, every row {args.max_new_tokens} new tokens, greedy, "
        f"{args.repeats} repeat(s), {processes} process(es) x {torch.get_num_threads()} threads; tok/s = median "
        "over repeats, x plain = against plain generate",
        f"{'batch':>5}"
        + "".join(f"{m:>{widths[m]}}{'' if m == 'plain' else 'x plain':>9}" for m in args.methods)
        + "".join(f"{regimes.short(m) + '/none':>{len(regimes.short(m)) + 7}}{'paired':>8}" for m in drafting)
        + "  = generate",
    ]
    for r in rows:
        lines.append(
            f"{r['batch_size']:>5}"
            + "".join(f"{speed(r, m):>{widths[m]}.1f}{against_plain(r, m):>9}" for m in args.methods)
            + "".join(
                f"{ratio(speed(r, m), speed(r, 'hybrid-none')):>{len(regimes.short(m)) + 7}}"
                f"{ratio(regimes.paired_median(r, m, 'hybrid-none'), 1.0):>8}"
                for m in drafting
            )
            + f"  {regimes.identical_text(r)}"
        )
    lines.append(
        "paired: the median over batches and repeats of NAME's tok/s over hybrid-none's on the same batch, run back to "
        "back (what compares on a machine whose speed drifts)"
    )
    for m in drafting:
        lines += drafts_add(rows, m)
    return "\n".join(lines) + "\n"


def drafts_add(rows: list[dict], method: str) -> list[str]:
    """What `method`'s drafts add at each batch size, said plainly: its tokens/s against hybrid-none's, the same
    engine without drafts."""
    if not any(speed(r, "hybrid-none") for r in rows):
        return [f"(no hybrid-none in --methods: what {method}'s drafts add is not measured)"]
    lines = [f"what {method}'s drafts add (against hybrid-none, the engine without drafts):"]
    for r in rows:
        with_drafts, without = speed(r, method), speed(r, "hybrid-none")
        change = with_drafts / without - 1
        verdict = f"the drafts add {change:.0%}" if change > 0 else f"the drafts cost {-change:.0%}"
        lines.append(
            f"  batch {r['batch_size']}: {with_drafts:.1f} against {without:.1f} tok/s without them: {verdict}"
            + ("" if change > 0 else f"; {method} is slower than hybrid-none here")
        )
    return lines


if __name__ == "__main__":
    main()
