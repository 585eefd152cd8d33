"""The sweep's outputs, written by the main process from every record of the plan: summary.csv, report.md,
the plots, and the table printed at the end."""

from __future__ import annotations

import csv
import math
import time
from pathlib import Path

import torch

from experiments import metrics, plots
from experiments.acceptance.plan import CONFIG_FIELDS, Plan
from schedulers.registry import fixed_k

RUNS_FILE, SUMMARY_FILE, REPORT_FILE = "runs.jsonl", "summary.csv", "report.md"


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


def config_table(rows: list[dict], columns, cells_of) -> list[str]:
    """Markdown lines of a table with a line per configuration: its dataset, its label, then `cells_of(row)`
    under `columns` (right-aligned; a row with fewer cells leaves the last ones blank)."""
    columns = list(map(str, columns))
    lines = ["| dataset | configuration | " + " | ".join(columns) + " |", "|---|---|" + "---:|" * len(columns)]
    for r in rows:
        cells = cells_of(r)
        cells += [""] * (len(columns) - len(cells))
        lines.append(f"| {r['dataset']} | {config_label(r)} | " + " | ".join(cells) + " |")
    return lines


def histogram_shares(row: dict) -> list[str]:
    histogram = row["accepted_length_histogram"]
    return [f"{n / sum(histogram):.2f}" for n in histogram]


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
        ]
        lines += config_table(drafting, range(1, depth + 1), lambda r: [fmt(x) for x in r["acceptance_by_position"]])
        lines += [
            "",
            "## Accepted length per drafting step",
            "",
            "Fraction of the steps that drafted anything which accepted exactly n tokens.",
            "",
        ]
        width = max(len(r["accepted_length_histogram"]) for r in drafting)
        lines += config_table(drafting, range(width), histogram_shares)
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
