#!/usr/bin/env bash
# The GPU recipe of the shipped drafter: data, features, the block-diffusion drafter and its AR baseline.
#
#   bash experiments/gpu_train.sh OUT_DIR     # OUT_DIR/block, OUT_DIR/ar, OUT_DIR/{block,ar}.log
#   DFLASH=1 bash experiments/gpu_train.sh OUT_DIR   # also OUT_DIR/dflash: z-lab's DFlash architecture, same data
#
# The same pipeline as the CPU recipe (python -m drafters.training.train), scaled up for one CUDA GPU:
#   - prompts: the templated ones plus 8,000 user turns sampled from the verifier itself, interleaved;
#   - data: 13 batches of 512 of them answered greedily (~1.4 M answer tokens) + 100 k tokens of documents;
#   - drafter: 2 layers, block 8, 32 answers x 128 anchors per step, 2,000 steps (at 552 the loss was still falling
#     fast, and 2,600 more CPU steps took held-out tau from 1.724 to 1.896: docs/results.md, "The shipped block
#     model"); masked positions read the nearest known token to their left, and half the blocks are given a
#     leading run of their answer (REVEAL), so later denoising passes and the tokens a lookup gives are read;
#   - baseline: the 1-layer AR drafter with the same trainable budget, on the same data (AR_STEPS steps);
#   - with DFLASH=1, a drafter in DFlash's architecture, same layers, data and steps, scored against the block
#     drafter by experiments.heldout --block OUT_DIR/block --dflash OUT_DIR/dflash.
# On an H200 sampling user turns took ~1 min, answering ~3.5 min, features ~1 min, and training ran at 4.4 steps/s
# (measured over 552 steps; 2,000 take ~7.5 min at that rate); the baseline took ~1 min for 552 steps. `python -m
# drafters.training.answer_sets restore --answers drafters/training/data/smollm2-135m-recipe --work-dir WORK` first
# skips sampling and answering. Knobs can be overridden from the environment (DEVICE=cpu SYNTHETIC=16 ... for a
# smoke run; BASELINE=0 skips the baseline).
set -euo pipefail
OUT=${1:?usage: gpu_train.sh OUT_DIR}
DEVICE=${DEVICE:-cuda}
WORK=${WORK:-${HYBRID_CACHE:-$HOME/.cache/hybrid}/drafter-gpu}
SYNTHETIC=${SYNTHETIC:-8000}
GEN_BATCH=${GEN_BATCH:-512}
GEN_SHARDS=${GEN_SHARDS:-13}
DOC_TOKENS=${DOC_TOKENS:-100000}
STEPS=${STEPS:-2000}
AR_STEPS=${AR_STEPS:-$STEPS}
SEQS=${SEQS:-32}
ANCHORS=${ANCHORS:-128}
BLOCK=${BLOCK:-8}
GAMMA=${GAMMA:-2}
EVAL_EVERY=${EVAL_EVERY:-200}
REVEAL=${REVEAL:-0.5}
BASELINE=${BASELINE:-1}
DFLASH=${DFLASH:-0}
mkdir -p "$OUT"
common=(--device "$DEVICE" --work-dir "$WORK" --gen-shards "$GEN_SHARDS" --gen-batch "$GEN_BATCH"
        --synthetic-prompts "$SYNTHETIC" --doc-tokens "$DOC_TOKENS" --feature-batch-tokens 32768
        --seqs-per-step "$SEQS" --anchors-per-seq "$ANCHORS" --block-size "$BLOCK" --layers 2 --gamma "$GAMMA"
        --lr 2e-3 --eval-every "$EVAL_EVERY" --save-every "$EVAL_EVERY" --reveal-prob "$REVEAL" --reveal-scheme prefix)
python -m drafters.training.train --arch block "${common[@]}" --masked-input nearest_known --steps "$STEPS" \
    --out "$OUT/block" 2>&1 | tee "$OUT/block.log"
if [ "$DFLASH" != 0 ]; then
    python -m drafters.training.train --arch dflash "${common[@]}" --steps "$STEPS" --out "$OUT/dflash" 2>&1 \
        | tee "$OUT/dflash.log"
fi
[ "$BASELINE" = 0 ] && exit 0
python -m drafters.training.train --arch ar "${common[@]}" --steps "$AR_STEPS" --out "$OUT/ar" 2>&1 | tee "$OUT/ar.log"
