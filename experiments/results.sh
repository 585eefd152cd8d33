#!/usr/bin/env bash
# Regenerates the figures of docs/results.md into docs/results (a few hours on 2 cores; nothing else may run
# meanwhile: timings need the machine to themselves). Interrupted? Run it again: the sweeps resume from runs.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -e ".[experiments]"  # matplotlib, for the plots
# docs/results/machine-33ms holds what the verify-costs, first-call and regimes commands below printed on a
# machine whose one-token step costs 33 ms, and docs/results/machine-45ms what verify-costs, first-call, the
# shipped block's bench, the 8-pair sweeps and the 24-pair cells printed on one whose step costs 43-49 ms (copied
# there by hand from runs/).
mkdir -p runs/verify-costs && python -m experiments.verify_costs | tee runs/verify-costs/table.txt  # caches the kernel choice
python -m experiments.scheduler_prior --num-prompts 8 --max-new-tokens 256  # the prior shipped beside the drafter
for t in 0.7 1.0; do  # and its entries for sampled decoding
    python -m experiments.scheduler_prior --num-prompts 8 --max-new-tokens 256 --temperature $t
done
# The default against plain generate and its lookup and store alone, greedy, on each set (heldout: ours, never tuned on).
for set in heldout mt-bench humaneval dev; do
    mkdir -p runs/bench-$set && python -m experiments.bench --dataset $set --num-prompts 8 --max-new-tokens 256 \
        --repeats 1 --methods plain,hybrid-default,hybrid-match-store --out runs/bench-$set | tee runs/bench-$set/table.txt
done
for set in mt-bench heldout; do  # sampling at T = 0.7 under one seed per prompt
    mkdir -p runs/bench-sampling-$set && python -m experiments.bench --dataset $set --num-prompts 8 --max-new-tokens 256 \
        --repeats 1 --temperature 0.7 --top-p 0.9 --methods plain,hybrid-default \
        --out runs/bench-sampling-$set | tee runs/bench-sampling-$set/table.txt
done
# machine-45ms/shipped-block/bench-sampling-SET: the same with the lookup and store alone beside the default
# (--methods plain,hybrid-default,hybrid-match-store); its bench-SET is the branch loop below on all four sets.
# Which causal LM types of the installed transformers hybrid serves (tiny random models, no timing; about 25 minutes).
python -m experiments.architectures --out runs/architectures
# Which quantization schemes hybrid serves on the embedded verifier (those whose library is installed:
# pip install torchao bitsandbytes); no timing.
python -m experiments.quantized --num-prompts 3 --max-new-tokens 48 --out runs/quantized
mkdir -p runs/first-call && python -m experiments.first_call --dataset mt-bench --num-prompts 3 --max-new-tokens 128 \
    --warm-prompts 3 --out runs/first-call | tee runs/first-call/table.txt
mkdir -p runs/online-store && python -m experiments.online_store --model default --num-prompts 4 --max-new-tokens 128 \
    --out runs/online-store/summary.json | tee runs/online-store/table.txt
# Where the drafts pay: plain generate, the engine without drafts and the default, over the four prompt sets x
# batch sizes 1, 2, 4, 8, greedy, T 0.7 and T 1.0, at least 4 paired runs a cell (table.txt, regimes.png; about
# 30-40 minutes a temperature on 2 cores).
python -m experiments.regimes --datasets heldout,dev,mt-bench,humaneval --batch-sizes 1,2,4,8 --temperatures 0,0.7,1.0 \
    --num-prompts 8 --max-new-tokens 64 --repeats 1 --min-pairs 4 --out runs/regimes
# The cells again with at least 8 paired runs a cell, as a cell of 4 moves by a few percent between runs: greedy
# (machine-33ms/regimes-greedy and machine-45ms/regimes-greedy; about 30-36 minutes on 2 cores) and sampled
# (machine-33ms/regimes and machine-45ms/regimes-sampled; about 50-80 minutes).
python -m experiments.regimes --datasets heldout,dev,mt-bench,humaneval --batch-sizes 1,2,4,8 --temperatures 0 \
    --num-prompts 8 --max-new-tokens 64 --repeats 1 --min-pairs 8 --out runs/regimes-greedy
python -m experiments.regimes --datasets heldout,dev,mt-bench,humaneval --batch-sizes 1,2,4,8 --temperatures 0.7,1.0 \
    --num-prompts 8 --max-new-tokens 64 --repeats 1 --min-pairs 8 --out runs/regimes-sampled
# The cells of those that read below 0.97x on the 45 ms machine, with at least 24 paired runs a cell
# (machine-45ms/regimes-floor/sampled-t1, greedy-mt-bench-b2, greedy-heldout-b8; about 24, 5 and 7 minutes).
F="python -m experiments.regimes --num-prompts 8 --max-new-tokens 64 --repeats 1 --min-pairs 24"
$F --datasets heldout,mt-bench --batch-sizes 2,4 --temperatures 1.0 --out runs/regimes-floor/sampled-t1
$F --datasets mt-bench --batch-sizes 2 --temperatures 0 --out runs/regimes-floor/greedy-mt-bench-b2
python -m experiments.regimes --datasets mt-bench --batch-sizes 2 --temperatures 0 --num-prompts 8 --max-new-tokens 64 \
    --repeats 1 --min-pairs 48 --out runs/regimes-floor/greedy-mt-bench-b2-48  # the one below at 24 (11 minutes)
$F --datasets heldout --batch-sizes 8 --temperatures 0 --out runs/regimes-floor/greedy-heldout-b8
# The same greedy cells of dev and HumanEval with a fixed number of drafted nodes a row: what the default's choices
# could reach at batch 2 and 8 (machine-33ms/regimes-fixed).
python -m experiments.regimes --datasets dev,humaneval --batch-sizes 2,8 --temperatures 0 \
    --methods plain,hybrid-none,hybrid-default,hybrid-default@fixed-1,hybrid-default@fixed-2,hybrid-default@fixed-4,hybrid-match-store@fixed-2 \
    --num-prompts 8 --max-new-tokens 64 --repeats 2 --min-pairs 2 --out runs/regimes-fixed
# The block model reading known tokens: four fine-tunes of the shipped checkpoint at one CPU budget (the same 11
# shards of answers to prompts the GPU recipe never answered, 30 k document tokens, steps and seed), masked positions
# reading the anchor or the nearest known token, half the blocks given a prefix; scored on the shipped held-out answers.
W=~/.cache/hybrid/drafter
python -m drafters.training.answer_sets finetune --out $W/finetune-prompts.jsonl
FT="python -m drafters.training.train --init-from drafters/checkpoints/smollm2-135m-block-gpu --work-dir $W \
    --prompts $W/finetune-prompts.jsonl --gen-batch 16 --gen-shards 11 --doc-tokens 30000 --seqs-per-step 4 \
    --anchors-per-seq 64 --lr 1e-3 --steps 240 --save-every 20 --eval-every 240 --eval-seqs 64 --threads 1"
$FT --masked-input anchor --reveal-prob 0.5 --reveal-scheme prefix --out $W/ft-anchor-prefix05
$FT --masked-input nearest_known --reveal-prob 0.5 --reveal-scheme prefix --out $W/ft-nk-prefix05
for keep in 2 8; do  # the same, keeping the shipped checkpoint's drafts where a block is given nothing
    $FT --masked-input nearest_known --reveal-prob 0.5 --reveal-scheme prefix --keep-weight $keep \
        --out $W/ft-nk-prefix05-keep$keep
done
mkdir -p runs/heldout && python -m experiments.heldout --block drafters/checkpoints/smollm2-135m-block-gpu \
    --block $W/ft-anchor-prefix05 --block $W/ft-nk-prefix05 --block $W/ft-nk-prefix05-keep2 \
    --block $W/ft-nk-prefix05-keep8 --passes 1,2,3 --reveal --fill \
    --ngram-store drafters/checkpoints/smollm2-135m-ngram --max-ngrams 32 --prefer-store 0.5 --lookup 7 \
    --anchors-per-answer 16 | tee runs/heldout/finetune.md
python -m experiments.heldout --block drafters/checkpoints/smollm2-135m-block-gpu --masked-input nearest_known \
    --passes 1,2,3 --reveal --lookup 7 --anchors-per-answer 16 | tee runs/heldout/shipped-nearest-known.md
for run in ft-anchor-prefix05 ft-nk-prefix05 ft-nk-prefix05-keep2 ft-nk-prefix05-keep8; do cp $W/$run/training.json runs/heldout/$run-training.json; done
# The same reading on the GPU recipe's own answers (restored from the token ids of a GPU run): the shipped checkpoint
# fine-tuned with nearest_known, half or a quarter of the blocks given a prefix, and half keeping its drafts.
W=~/.cache/hybrid/drafter-gpu
python -m drafters.training.answer_sets restore --answers drafters/training/data/smollm2-135m-recipe --work-dir $W
RT="python -m drafters.training.train --arch block --init-from drafters/checkpoints/smollm2-135m-block-gpu --work-dir $W \
    --gen-shards 1 --gen-batch 512 --synthetic-prompts 8000 --doc-tokens 20000 --seqs-per-step 8 --anchors-per-seq 64 \
    --block-size 8 --layers 2 --gamma 2 --lr 1e-3 --steps 300 --eval-every 100 --save-every 100 \
    --masked-input nearest_known --reveal-scheme prefix --threads 2"
$RT --reveal-prob 0.5 --out $W/ft-recipe-nk
$RT --reveal-prob 0.25 --out $W/ft-recipe-nk-r025
$RT --reveal-prob 0.5 --keep-weight 4 --out $W/ft-recipe-nk-keep4
python -m experiments.heldout --block drafters/checkpoints/smollm2-135m-block-gpu --block $W/ft-recipe-nk \
    --block $W/ft-recipe-nk-keep4 --block $W/ft-recipe-nk-r025 --passes 1,2,3,7 --reveal --fill \
    --ngram-store drafters/checkpoints/smollm2-135m-ngram --max-ngrams 32 --prefer-store 0.5 --lookup 7 \
    --anchors-per-answer 16 | tee runs/heldout/recipe-data.md
$RT --reveal-prob 0.5 --keep-weight 4 --gen-shards 3 --out $W/ft-recipe-nk-keep4-g3  # three times the answers
python -m experiments.heldout --block $W/ft-recipe-nk-keep4-g3 --passes 1,2,3,7 --reveal --fill \
    --ngram-store drafters/checkpoints/smollm2-135m-ngram --max-ngrams 32 --prefer-store 0.5 --lookup 7 \
    --anchors-per-answer 16 | tee runs/heldout/recipe-data-g3.md
for run in ft-recipe-nk ft-recipe-nk-r025 ft-recipe-nk-keep4 ft-recipe-nk-keep4-g3; do
    cp $W/$run/training.json runs/heldout/$run-training.json
done
# The shipped block model: the GPU base trained on in three stages on 2 cores (2,600 steps on three shards of answers,
# then 2,000 on six, then 2,000 on all thirteen with features recorded in bfloat16), reading the nearest known token;
# its prior rebuilt (one entry per drafter setting); scored offline on the held-out answers and on the answers to our
# dev-chat questions (novel text), then in the bench.
mkdir -p runs/shipped-block
python -m drafters.training.train --arch block --init-from drafters/checkpoints/smollm2-135m-block-gpu --work-dir $W \
    --gen-shards 3 --gen-batch 512 --synthetic-prompts 8000 --doc-tokens 20000 --seqs-per-step 8 --anchors-per-seq 64 \
    --block-size 8 --layers 2 --gamma 2 --lr 1e-3 --steps 2600 --eval-every 650 --save-every 100 \
    --masked-input nearest_known --reveal-scheme prefix --reveal-prob 0.5 --threads 2 --out $W/ft-recipe-nk-long-g3 \
    | tee runs/shipped-block/training-stage1.log
python -m drafters.training.train --arch block --init-from $W/ft-recipe-nk-long-g3 --work-dir $W \
    --gen-shards 6 --gen-batch 512 --synthetic-prompts 8000 --doc-tokens 20000 --seqs-per-step 8 --anchors-per-seq 64 \
    --block-size 8 --layers 2 --gamma 2 --lr 5e-4 --steps 2000 --eval-every 500 --save-every 100 \
    --masked-input nearest_known --reveal-scheme prefix --reveal-prob 0.5 --threads 2 --out $W/ft-recipe-nk-cont-g6 \
    | tee runs/shipped-block/training-stage2.log
python -m drafters.training.train --arch block --init-from $W/ft-recipe-nk-cont-g6 --work-dir $W \
    --gen-shards 13 --gen-batch 512 --synthetic-prompts 8000 --doc-tokens 20000 --feature-dtype bfloat16 \
    --seqs-per-step 8 --anchors-per-seq 64 --block-size 8 --layers 2 --gamma 2 --lr 3e-4 --steps 2000 \
    --eval-every 500 --save-every 100 --masked-input nearest_known --reveal-scheme prefix --reveal-prob 0.5 \
    --threads 2 --out $W/ft-recipe-nk-g13 \
    | tee runs/shipped-block/training.log  # copy it to drafters/checkpoints/smollm2-135m-block to ship it
rm -f drafters/checkpoints/smollm2-135m-block/scheduler_prior.json
python -m experiments.scheduler_prior --num-prompts 8 --max-new-tokens 256
python -m experiments.scheduler_prior --refill-below 0.3 --num-prompts 8 --max-new-tokens 256
python -m experiments.heldout --block $W/ft-recipe-nk-cont-g6 --block drafters/checkpoints/smollm2-135m-block \
    --passes 1,2,3,4,7 --reveal --fill --refill-below 0,0.3 --ngram-store drafters/checkpoints/smollm2-135m-ngram \
    --max-ngrams 32 --prefer-store 0.5 --lookup 7 --anchors-per-answer 16 | tee runs/shipped-block/heldout.md
python -m drafters.training.answer_sets prompts --prompts experiments/prompts/dev-chat.jsonl \
    --out drafters/checkpoints/smollm2-135m-dev-chat --batch-size 16 --max-new-tokens 256
python -m experiments.heldout --answers drafters/checkpoints/smollm2-135m-dev-chat \
    --block $W/ft-recipe-nk-cont-g6 --block drafters/checkpoints/smollm2-135m-block --passes 1,3,7 --fill \
    --refill-below 0,0.3 --ngram-store drafters/checkpoints/smollm2-135m-ngram --max-ngrams 32 --prefer-store 0.5 \
    --lookup 7 --anchors-per-answer 48 | tee runs/shipped-block/dev-chat.md
python -m experiments.heldout --answers drafters/checkpoints/smollm2-135m-dev-chat \
    --block drafters/checkpoints/smollm2-135m-block-gpu --passes 1,7 --fill --branch 0,2 \
    --ngram-store drafters/checkpoints/smollm2-135m-ngram --max-ngrams 32 --prefer-store 0.5 --lookup 7 \
    --anchors-per-answer 48 | tee runs/shipped-block/dev-chat-base.md
# Its own first 2 and 7 tokens verified beside the default's chain: the branch, and the longer of the two drafts.
python -m experiments.heldout --block drafters/checkpoints/smollm2-135m-block --passes 3 --fill --branch 0,2,7 \
    --ngram-store drafters/checkpoints/smollm2-135m-ngram --max-ngrams 32 --prefer-store 0.5 --lookup 7 \
    --anchors-per-answer 16 | tee runs/shipped-block/branch-heldout.md
python -m experiments.heldout --answers drafters/checkpoints/smollm2-135m-dev-chat \
    --block drafters/checkpoints/smollm2-135m-block --passes 3 --fill --branch 0,2,7 \
    --ngram-store drafters/checkpoints/smollm2-135m-ngram --max-ngrams 32 --prefer-store 0.5 --lookup 7 \
    --anchors-per-answer 48 | tee runs/shipped-block/branch-dev-chat.md
python -m experiments.verify_costs | tee runs/shipped-block/verify-costs.txt
for set in heldout mt-bench humaneval dev; do
    mkdir -p runs/shipped-block/bench-$set && python -m experiments.bench --dataset $set --num-prompts 8 \
        --max-new-tokens 256 --repeats 1 --methods plain,hybrid-default,hybrid-match-store \
        --out runs/shipped-block/bench-$set | tee runs/shipped-block/bench-$set/table.txt
done
for set in heldout mt-bench; do
    mkdir -p runs/shipped-block/bench-sampling-$set && python -m experiments.bench --dataset $set --num-prompts 8 \
        --max-new-tokens 256 --repeats 1 --temperature 0.7 --top-p 0.9 --methods plain,hybrid-default \
        --out runs/shipped-block/bench-sampling-$set | tee runs/shipped-block/bench-sampling-$set/table.txt
done
# The block model's own first tokens verified beside the default's chain (drafters.ChainDrafter's branch): offline,
# every node verified, and in the bench against the default and its lookup and store alone.
python -m experiments.heldout --block drafters/checkpoints/smollm2-135m-block-gpu --passes 1 --fill --branch 0,1,2,3,7 \
    --ngram-store drafters/checkpoints/smollm2-135m-ngram --max-ngrams 32 --prefer-store 0.5 --lookup 7 \
    --anchors-per-answer 16 | tee runs/heldout/branch.md
python -m experiments.scheduler_prior --branch 2 --num-prompts 8 --max-new-tokens 256
for set in dev heldout mt-bench humaneval; do
    mkdir -p runs/branch/bench-$set && python -m experiments.bench --dataset $set --num-prompts 8 --max-new-tokens 256 \
        --repeats 1 --methods plain,hybrid-default,hybrid-default-branch2,hybrid-match-store \
        --out runs/branch/bench-$set | tee runs/branch/bench-$set/table.txt
done
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
for run in verify-costs bench-heldout bench-mt-bench bench-humaneval bench-dev bench-sampling-mt-bench bench-sampling-heldout \
    first-call online-store regimes heldout extras branch/bench-dev branch/bench-heldout shipped-block \
    shipped-block/bench-dev shipped-block/bench-heldout shipped-block/bench-mt-bench shipped-block/bench-humaneval shipped-block/bench-sampling-heldout \
    shipped-block/bench-sampling-mt-bench shipped-block/passes-heldout shipped-block/passes-mt-bench \
    shipped-block/passes-humaneval shipped-block/passes-dev; do
    mkdir -p "docs/results/$run"
    cp runs/$run/*.png runs/$run/*.md runs/$run/*.csv runs/$run/*.json runs/$run/*.txt "docs/results/$run/" 2>/dev/null || true
done
cp runs/regimes/regimes.jsonl docs/results/regimes/  # each run's seconds and verifier forwards
