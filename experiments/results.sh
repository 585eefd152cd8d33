#!/usr/bin/env bash
# Regenerates the figures of docs/results.md into docs/results (a few hours on 2 cores; nothing else may run
# meanwhile: timings need the machine to themselves). Interrupted? Run it again: the sweeps resume from runs.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -e ".[experiments]"  # matplotlib, for the plots
mkdir -p runs/verify-costs && python -m experiments.verify_costs | tee runs/verify-costs/table.txt
python -m experiments.calibration --dataset dev --num-prompts 8 --max-new-tokens 256 --out runs/calibration
# The default drafter and its lookup without the model, every fixed k against the cost-aware scheduler.
python -m experiments.acceptance --datasets mt-bench,humaneval --drafters match-store,default --schedulers fixed,cost-aware \
    --block-sizes 16 --num-prompts 6 --max-new-tokens 256 --out runs/default-v8
python -m experiments.acceptance --datasets mt-bench,humaneval --drafters default --schedulers \
    fixed-1,fixed-2,fixed-3,fixed-4,fixed-5,fixed-6,fixed-7,fixed-8,fixed-9,fixed-10,fixed-11,fixed-12,fixed-13,fixed-14,fixed-15,fixed-16,heuristic,cost-aware \
    --block-sizes 16 --num-prompts 6 --max-new-tokens 256 --out runs/schedulers-v4
# Prompt lookup, the 1-layer AR baseline and the default at one k, all verifying 16 drafts.
python -m experiments.acceptance --datasets mt-bench,humaneval --drafters lookup,ar,default --schedulers fixed --block-sizes 16 \
    --num-prompts 6 --max-new-tokens 256 --out runs/same-k
for set in mt-bench humaneval; do  # sampling at T = 0.7 under one seed per prompt: both acceptance rules
    mkdir -p runs/bench-sampling-$set && python -m experiments.bench --dataset $set --num-prompts 8 --max-new-tokens 256 \
        --repeats 1 --temperature 0.7 --top-p 0.9 \
        --methods plain,hybrid-default,hybrid-default-tree,hybrid-default+rejection,hybrid-match-store \
        --out runs/bench-sampling-$set | tee runs/bench-sampling-$set/table.txt
done
for set in humaneval mt-bench; do  # with repeats, interleaved
    mkdir -p runs/bench-default-$set && python -m experiments.bench --dataset $set --num-prompts 4 --max-new-tokens 256 --repeats 2 \
        --methods plain,hybrid-match-store,hybrid-default,hybrid-default@fixed-4,hybrid-default@fixed-11,hybrid-default@fixed-13,hybrid-default@fixed-16 \
        --out runs/bench-default-$set | tee runs/bench-default-$set/table.txt
done
for set in humaneval mt-bench; do  # the static-shape path: eager and compiled, against plain generate compiled too
    mkdir -p runs/bench-static-$set && python -m experiments.bench --dataset $set --num-prompts 4 --max-new-tokens 256 \
        --repeats 2 --methods plain,hybrid-default,hybrid-default+static,plain+compiled,hybrid-default+compiled \
        --out runs/bench-static-$set | tee runs/bench-static-$set/table.txt
done
# Token trees: the default with chains, with trees, and without its model, greedy, on each set.
for set in dev mt-bench humaneval; do
    mkdir -p runs/bench-trees-$set && python -m experiments.bench --dataset $set --num-prompts 8 --max-new-tokens 256 \
        --repeats 1 --methods plain,hybrid-default,hybrid-default-tree,hybrid-match-store \
        --out runs/bench-trees-$set | tee runs/bench-trees-$set/table.txt
done
python -m experiments.acceptance --datasets dev --drafters block-tree,default-tree --schedulers cost-aware \
    --block-sizes 8,16,32,64 --num-prompts 4 --max-new-tokens 128 --out runs/tree-budget
python -m experiments.serving --concurrency 1,2,4 --requests 4 --max-tokens 256 --out runs/serving
mkdir -p runs/batching-v9 && python -m experiments.batching --dataset mt-bench --num-prompts 8 --batch-sizes 1,2,4,8 \
    --max-new-tokens 64 --out runs/batching-v9 | tee runs/batching-v9/batching.txt
for run in calibration default-v8 schedulers-v4 same-k bench-sampling-mt-bench bench-sampling-humaneval bench-default-humaneval bench-default-mt-bench \
    bench-static-humaneval bench-static-mt-bench bench-trees-dev bench-trees-mt-bench bench-trees-humaneval \
    tree-budget verify-costs serving batching-v9; do
    mkdir -p "docs/results/$run"
    cp runs/$run/*.png runs/$run/*.md runs/$run/*.csv runs/$run/*.json runs/$run/*.txt "docs/results/$run/" 2>/dev/null || true
done
