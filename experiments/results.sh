#!/usr/bin/env bash
# Regenerates every figure in the README's "Results" section into docs/results (about 2 hours on 2 cores).
# Interrupted? Run it again: the sweeps resume from their runs.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -e ".[experiments]"  # matplotlib, for the plots
python -m experiments.acceptance --datasets mt-bench,humaneval --drafters none,lookup,oracle --schedulers cost-aware \
    --block-sizes 16 --temperatures 0,0.7 --num-prompts 10 --max-new-tokens 128 --out runs/drafters
python -m experiments.acceptance --datasets mt-bench,humaneval --drafters lookup \
    --schedulers fixed-1,fixed-3,fixed-4,fixed-7,fixed-16,heuristic,cost-aware --block-sizes 16 \
    --num-prompts 10 --max-new-tokens 128 --out runs/schedulers
python -m experiments.calibration --dataset dev --num-prompts 8 --max-new-tokens 256 --out runs/calibration
# The trained drafters (issue 3): the shipped block-diffusion drafter alone and with n-gram lookup, prompt lookup,
# and the 1-layer AR baseline (trained by `bash experiments/gpu_train.sh OUT`, copied to ~/.cache/hybrid/drafter/ar-drafter).
python -m experiments.acceptance --datasets mt-bench,humaneval --drafters lookup,block,block-lookup,ar \
    --schedulers fixed,cost-aware --block-sizes 7 --num-prompts 6 --max-new-tokens 256 --out runs/trained
python -m experiments.acceptance --datasets mt-bench,humaneval --drafters lookup,block,block-lookup,ar --schedulers cost-aware \
    --temperatures 0.7 --block-sizes 7 --num-prompts 6 --max-new-tokens 256 --out runs/trained-t07
# The n-gram store (session 7): lookup + store without a model, and the block drafter with it (the default), up to 7
# and up to 15 tokens.
python -m experiments.acceptance --datasets mt-bench,humaneval --drafters lookup,lookup-store,block-lookup,block-lookup-store \
    --schedulers fixed,cost-aware --block-sizes 7 --num-prompts 6 --max-new-tokens 256 --out runs/trained-store
python -m experiments.acceptance --datasets mt-bench,humaneval --drafters lookup-store,block-long-lookup-store \
    --schedulers fixed,cost-aware --block-sizes 15 --num-prompts 6 --max-new-tokens 256 --out runs/trained-store-long
python -m experiments.acceptance --datasets mt-bench,humaneval --drafters lookup-store,block-long-lookup-store \
    --schedulers cost-aware --temperatures 0.7 --block-sizes 16 --num-prompts 6 --max-new-tokens 256 --out runs/trained-store-t07
for set in humaneval mt-bench; do  # the same drafters with repeats
    mkdir -p runs/bench-store-$set && python -m experiments.bench --dataset $set --num-prompts 4 --max-new-tokens 256 --repeats 2 \
        --methods plain,hybrid-lookup,hybrid-lookup-store,hybrid-block-lookup,hybrid-block-long-lookup-store \
        --out runs/bench-store-$set | tee runs/bench-store-$set/table.txt
done
# Session 8: the default drafter (longest context match up to 32 tokens, the store preferred over a one-token match)
# and its lookup without the model; every fixed k against the cost-aware scheduler; with repeats.
python -m experiments.acceptance --datasets mt-bench,humaneval --drafters match-store,default --schedulers fixed,cost-aware \
    --block-sizes 16 --num-prompts 6 --max-new-tokens 256 --out runs/default-v8
python -m experiments.acceptance --datasets mt-bench,humaneval --drafters default --schedulers \
    fixed-1,fixed-2,fixed-3,fixed-4,fixed-5,fixed-6,fixed-7,fixed-8,fixed-9,fixed-10,fixed-11,fixed-12,fixed-13,fixed-14,fixed-15,fixed-16,heuristic,cost-aware \
    --block-sizes 16 --num-prompts 6 --max-new-tokens 256 --out runs/schedulers-v4
# The issue-3 comparison at one k: prompt lookup, the 1-layer AR baseline and the default, all verifying 16 drafts.
python -m experiments.acceptance --datasets mt-bench,humaneval --drafters lookup,ar,default --schedulers fixed --block-sizes 16 \
    --num-prompts 6 --max-new-tokens 256 --out runs/same-k
for set in humaneval mt-bench; do
    mkdir -p runs/bench-default-$set && python -m experiments.bench --dataset $set --num-prompts 4 --max-new-tokens 256 --repeats 2 \
        --methods plain,hybrid-match-store,hybrid-default,hybrid-default@fixed-4,hybrid-default@fixed-11,hybrid-default@fixed-13,hybrid-default@fixed-16 \
        --out runs/bench-default-$set | tee runs/bench-default-$set/table.txt
done
for set in humaneval mt-bench; do  # the static-shape path: eager and compiled, against plain generate compiled too
    mkdir -p runs/bench-static-$set && python -m experiments.bench --dataset $set --num-prompts 4 --max-new-tokens 256 \
        --repeats 2 --methods plain,hybrid-default,hybrid-default+static,plain+compiled,hybrid-default+compiled \
        --out runs/bench-static-$set | tee runs/bench-static-$set/table.txt
done
# The schedulers with the session-7 default drafter, which proposes up to 16 tokens.
python -m experiments.acceptance --datasets mt-bench,humaneval --drafters block-long-lookup-store \
    --schedulers fixed-1,fixed-2,fixed-3,fixed-4,fixed-7,fixed-10,fixed-13,fixed-16,heuristic,cost-aware --block-sizes 16 \
    --num-prompts 6 --max-new-tokens 128 --out runs/schedulers-v3
# The schedulers with the earlier default drafter (block + lookup; block 7 is its largest).
python -m experiments.acceptance --datasets mt-bench,humaneval --drafters block-lookup \
    --schedulers fixed-1,fixed-2,fixed-3,fixed-4,fixed-5,fixed-6,fixed-7,heuristic,confidence,cost-aware --block-sizes 7 \
    --num-prompts 6 --max-new-tokens 128 --out runs/schedulers-v2
# Denoising passes: the shipped drafter with one and with two, and the scheduler choosing (dev prompts).
python -m experiments.acceptance --datasets dev --drafters block-lookup,block-lookup-2steps --schedulers fixed-7,cost-aware \
    --block-sizes 7 --num-prompts 6 --max-new-tokens 128 --out runs/steps-dev
mkdir -p runs/memory && python -m experiments.memory --max-new-tokens 1024 | tee runs/memory/memory.txt
mkdir -p runs/bench-mt && python -m experiments.bench --dataset mt-bench --num-prompts 4 --max-new-tokens 128 --repeats 2 \
    --methods plain,hf-lookup,hybrid-none,hybrid-lookup,hybrid-block,hybrid-block-lookup,hybrid-ar,oracle --out runs/bench-mt \
    | tee runs/bench-mt/table.txt
for set in humaneval mt-bench; do  # the scheduler against the best fixed k, with repeats
    python -m experiments.bench --dataset $set --num-prompts 4 --max-new-tokens 128 --repeats 3 \
        --methods plain,hybrid-block-lookup,hybrid-block-lookup@fixed-4,hybrid-block-lookup@fixed-7 --out runs/bench-sched-$set
done
mkdir -p runs/batching && python -m experiments.batching --dataset mt-bench --num-prompts 4 --batch-sizes 1,2,4 \
    --max-new-tokens 64 --out runs/batching | tee runs/batching/batching.txt
mkdir -p runs/batching-v9 && python -m experiments.batching --dataset mt-bench --num-prompts 8 --batch-sizes 1,2,4,8 \
    --max-new-tokens 64 --out runs/batching-v9 | tee runs/batching-v9/batching.txt  # the block drafter's rows in one forward
for run in drafters schedulers calibration trained trained-t07 trained-store trained-store-long trained-store-t07 bench-store-humaneval \
    bench-store-mt-bench default-v8 same-k schedulers-v4 bench-default-humaneval bench-default-mt-bench schedulers-v2 schedulers-v3 memory \
    bench-mt batching batching-v9 bench-static-humaneval bench-static-mt-bench; do
    mkdir -p "docs/results/$run"
    cp runs/$run/*.png runs/$run/*.md runs/$run/*.csv runs/$run/*.json runs/$run/*.txt "docs/results/$run/" 2>/dev/null || true
done
