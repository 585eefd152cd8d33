#!/usr/bin/env bash
# Regenerates the figures of docs/results.md into docs/results (a few hours on 2 cores; nothing else may run
# meanwhile: timings need the machine to themselves). Interrupted? Run it again: the sweeps resume from runs.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -e ".[experiments]"  # matplotlib, for the plots
mkdir -p runs/verify-costs && python -m experiments.verify_costs | tee runs/verify-costs/table.txt
python -m experiments.calibration --dataset dev --num-prompts 8 --max-new-tokens 256 --out runs/calibration
# Prompt lookup, the 1-layer AR baseline and the default at one k, all verifying 16 drafts.
python -m experiments.acceptance --datasets mt-bench,humaneval --drafters lookup,ar,default --schedulers fixed --block-sizes 16 \
    --num-prompts 6 --max-new-tokens 256 --out runs/same-k
for set in mt-bench humaneval; do  # sampling at T = 0.7 under one seed per prompt: both acceptance rules
    mkdir -p runs/bench-sampling-$set && python -m experiments.bench --dataset $set --num-prompts 8 --max-new-tokens 256 \
        --repeats 1 --temperature 0.7 --top-p 0.9 \
        --methods plain,hybrid-default,hybrid-default-tree,hybrid-default+rejection,hybrid-match-store \
        --out runs/bench-sampling-$set | tee runs/bench-sampling-$set/table.txt
done
# Token trees: the default with chains, with trees, and without its model, greedy, on each set.
for set in dev mt-bench humaneval; do
    mkdir -p runs/bench-trees-$set && python -m experiments.bench --dataset $set --num-prompts 8 --max-new-tokens 256 \
        --repeats 1 --methods plain,hybrid-default,hybrid-default-tree,hybrid-match-store \
        --out runs/bench-trees-$set | tee runs/bench-trees-$set/table.txt
done
# The block model's share: the default against its lookup and store alone, two repeats.
for set in dev mt-bench humaneval; do
    mkdir -p runs/bench-block-share-$set && python -m experiments.bench --dataset $set --num-prompts 8 \
        --max-new-tokens 256 --repeats 2 --methods hybrid-default,hybrid-match-store \
        --out runs/bench-block-share-$set | tee runs/bench-block-share-$set/table.txt
done
python -m experiments.acceptance --datasets dev --drafters block-tree,default-tree --schedulers cost-aware \
    --block-sizes 8,16,32,64 --num-prompts 4 --max-new-tokens 128 --out runs/tree-budget
python -m experiments.serving --concurrency 1,2,4 --requests 8 --max-tokens 256 --out runs/serving
mkdir -p runs/batching && python -m experiments.batching --dataset mt-bench --num-prompts 8 --batch-sizes 1,2,4,8 \
    --max-new-tokens 64 --out runs/batching | tee runs/batching/batching.txt
# Where the drafts pay: plain generate, the engine without drafts and the default, over the four prompt sets x
# temperatures 0, 0.7, 1.0 x batch sizes 1, 2, 4, 8 (table.txt, regimes.png).
python -m experiments.regimes --num-prompts 8 --max-new-tokens 64 --repeats 2 --out runs/regimes
# DFlash's architecture against the block drafter's on one small data set (2 shards of answers + 30 k document
# tokens): the same steps (300 each), and the block drafter at DFlash's compute (1800 steps); held-out tau of each.
W=~/.cache/hybrid/drafter-extras
TRAIN="python -m drafters.training.train --work-dir $W --gen-shards 2 --gen-batch 64 --doc-tokens 30000 \
    --anchors-per-seq 32 --layers 1 --threads 2 --eval-seqs 64 --save-every 50"
$TRAIN --arch dflash --steps 300 --eval-every 100 --out $W/dflash-drafter-a32
$TRAIN --arch block --steps 300 --eval-every 100 --out $W/block-drafter-a32
$TRAIN --arch block --steps 1800 --eval-every 600 --out $W/block-drafter-a32-1800
mkdir -p runs/extras && python -m experiments.heldout --answers $W/generated --block $W/block-drafter-a32 \
    --block $W/block-drafter-a32-1800 --dflash $W/dflash-drafter-a32 --anchors-per-answer 200 --lookup 7 \
    --work-dir $W | tee runs/extras/heldout.txt
for run in dflash-drafter-a32 block-drafter-a32 block-drafter-a32-1800; do
    cp $W/$run/training.json runs/extras/$run-training.json
done
for run in calibration same-k bench-sampling-mt-bench bench-sampling-humaneval bench-trees-dev bench-trees-mt-bench bench-trees-humaneval \
    bench-block-share-dev bench-block-share-mt-bench bench-block-share-humaneval tree-budget verify-costs serving batching regimes extras; do
    mkdir -p "docs/results/$run"
    cp runs/$run/*.png runs/$run/*.md runs/$run/*.csv runs/$run/*.json runs/$run/*.txt "docs/results/$run/" 2>/dev/null || true
done
