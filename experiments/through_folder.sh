#!/usr/bin/env bash
# Issue 29: the embedded verifier saved as a plain transformers folder and trained through `--verifier DIR` gives
# the same drafter as the built-in path (no --verifier), on the same data with the same seed.
#
#   bash experiments/through_folder.sh [OUT_DIR]     # default /tmp/folder-demo; about 12 min on one CPU core
#
# It saves the embedded SmolLM2-135M-Instruct (float32, as verifiers.embedded loads it) with save_pretrained
# into OUT/smollm2-folder, then runs drafters.training.train twice with the same small settings (24 templated
# prompts, 64-token answers, 2000 document tokens, 30 steps, seed 0), each in its own --work-dir so neither
# reads the other's cached answers or features: OUT/builtin (no --verifier) and OUT/folder (--verifier
# OUT/smollm2-folder). Each stage is timed (generate, features, train). It then compares the answers' token ids,
# the feature arrays, the float32 training checkpoints, the exported (bfloat16) drafters and the held-out tau,
# and loads both drafters with BlockDiffusionDrafter.from_pretrained for the embedded verifier (the fingerprint
# check). A rerun into the same OUT_DIR reuses its cached stages, so its stage times are those of loading
# them (delete OUT_DIR to redo them).
# CORES (default 1) and THREADS (default 1) pin the runs: taskset -c $CORES, --threads $THREADS.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/folder-demo}
CORES=${CORES:-1}
THREADS=${THREADS:-1}
export OMP_NUM_THREADS=$THREADS MKL_NUM_THREADS=$THREADS TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
PIN=(taskset -c "$CORES")
# Progress bars (tqdm's carriage-return updates) dropped from what is printed; the other lines pass as they come.
quiet() { tr '\r' '\n' | grep --line-buffered -Ev '(it/s|s/it)(, loss=[0-9.]+)?\] *$|^ *$' || true; }
SETTINGS=(--gen-shards 3 --gen-batch 8 --max-new-tokens 64 --doc-tokens 2000 --steps 30 --save-every 30
  --eval-every 30 --seed 0 --threads "$THREADS")

echo "== 1. the embedded verifier saved as a plain folder: $OUT/smollm2-folder"
"${PIN[@]}" python - "$OUT/smollm2-folder" "$THREADS" <<'PY' 2>&1 | quiet
import sys
from pathlib import Path

import torch

from verifiers.embedded import load_verifier

out, threads = Path(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(threads)
if (out / "config.json").exists():
    print(f"already there: {sorted(p.name for p in out.iterdir())}")
else:
    model, tokenizer = load_verifier("cpu", dtype=torch.float32)
    tmp = out.with_name(out.name + ".part")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)
    print(f"saved {type(model).__name__} ({model.dtype}): {sorted(p.name for p in out.iterdir())}")
PY

# One path's three stages, each timed: generate and features through train.py's own stage functions, then
# train.main (which finds both cached and only trains).
run_path() {
  local name=$1
  shift
  echo "== 2. train through the $name path: ${*:-no --verifier}"
  "${PIN[@]}" python - "$OUT/$name" "$@" "${SETTINGS[@]}" <<'PY' 2>&1 | quiet | tee "$OUT/$name.log"
import json
import sys
import time
from pathlib import Path

from drafters.training import train

work, argv = Path(sys.argv[1]), sys.argv[2:]
argv += ["--work-dir", str(work), "--out", str(work / "block-drafter")]
args = train.parser().parse_args(argv)
train.torch.set_num_threads(args.threads)
t = time.time()
verifier, tokenizer, stage_work = train.load_training_verifier(args)
print(f"verifier: {type(verifier).__name__} in {verifier.dtype}, stages in {stage_work} ({time.time() - t:.1f}s)")
times = {}
t = time.time()
train.generate_stage(args, verifier, tokenizer, stage_work)
times["generate_s"] = round(time.time() - t, 1)
t = time.time()
train.data_stages(args, verifier, tokenizer, stage_work)  # the answers are cached: this is the features stage
times["features_s"] = round(time.time() - t, 1)
del verifier
t = time.time()
sys.argv = ["train", *argv]  # what training.json records as the command
train.main(argv)
times["train_s"] = round(time.time() - t, 1)
(work / "stage-times.json").write_text(json.dumps(times) + "\n")
print(f"stage times: {times}")
PY
}
run_path builtin
run_path folder --verifier "$OUT/smollm2-folder"

echo "== 3. comparison"
"${PIN[@]}" python - "$OUT" "$THREADS" <<'PY' 2>&1 | quiet
import json
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from drafters.block_diffusion import BlockDiffusionDrafter
from verifiers.embedded import load_verifier

out, threads = Path(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(threads)
a, b = out / "builtin", out / "folder"


def only(folder: Path, pattern: str) -> Path:
    found = sorted(folder.glob(pattern))
    assert len(found) == 1, f"{folder}/{pattern}: {found}"
    return found[0]


for name in ("builtin", "folder"):
    print(f"{name}: stage times {json.loads((out / name / 'stage-times.json').read_text())}")
# (a) the answers
gen_a, gen_b = only(a, "generated-*"), only(b, "generated-*")
print(f"answer folders: {gen_a.name} / {gen_b.name}")
shards_a, shards_b = sorted(gen_a.glob("gen-*.json")), sorted(gen_b.glob("gen-*.json"))
rows_a = [r for s in shards_a for r in json.loads(s.read_text())]
rows_b = [r for s in shards_b for r in json.loads(s.read_text())]
same = [x == y for x, y in zip(rows_a, rows_b)]
tokens = sum(len(r["ids"]) - r["prompt_len"] for r in rows_a)
print(
    f"(a) answers: {len(rows_a)} vs {len(rows_b)}, {sum(same)} identical (prompt and answer token ids), "
    f"{tokens} answer tokens"
)
# (b) the features
feat_a, feat_b = only(a, "features-*"), only(b, "features-*")
meta_a, meta_b = (json.loads((f / "meta.json").read_text()) for f in (feat_a, feat_b))
print(f"(b) features: {feat_a.name} / {feat_b.name}; meta.json equal: {meta_a == meta_b}")
for file in sorted(p.name for p in feat_a.glob("*.bin")):
    x, y = np.fromfile(feat_a / file, dtype=np.uint8), np.fromfile(feat_b / file, dtype=np.uint8)
    print(f"    {file}: {x.size} bytes, byte-identical: {x.size == y.size and bool((x == y).all())}")
# (c) the drafters: the float32 training checkpoints and the exported bfloat16 weights
ck_a, ck_b = (torch.load(only(w, "train-block-*") / "checkpoint.pt", weights_only=False) for w in (a, b))
diffs = {k: (ck_a["model"][k].float() - ck_b["model"][k].float()).abs().max().item() for k in ck_a["model"]}
assert ck_a["model"].keys() == ck_b["model"].keys()
print(
    f"(c) float32 checkpoints (step {ck_a['step']} / {ck_b['step']}): {len(diffs)} tensors, "
    f"{sum(d == 0 for d in diffs.values())} identical, max abs difference {max(diffs.values()):.3g}"
)
w_a, w_b = (load_file(only(w / "block-drafter", "*.safetensors")) for w in (a, b))
assert w_a.keys() == w_b.keys()
diffs = {k: (w_a[k].float() - w_b[k].float()).abs().max().item() for k in w_a}
print(
    f"    exported safetensors: {len(diffs)} tensors, {sum(d == 0 for d in diffs.values())} identical, "
    f"max abs difference {max(diffs.values()):.3g}"
)
for k, d in sorted(diffs.items(), key=lambda kv: -kv[1])[:3]:
    print(f"      {k}: {d:.3g}")
for w in (a, b):
    log = [json.loads(line) for line in only(w, "train-block-*").joinpath("log.jsonl").read_text().splitlines()]
    summary = json.loads((w / "block-drafter" / "training.json").read_text())
    print(
        f"    {w.name}: last loss {log[-1]['loss']}, held-out tau {summary.get('tau')}, "
        f"accept by position {summary.get('accept_by_position')}"
    )
# (d) both load for the embedded verifier (from_pretrained checks the verifier's fingerprint)
verifier, _ = load_verifier("cpu", dtype=torch.float32)
for w in (a, b):
    drafter = BlockDiffusionDrafter.from_pretrained(w / "block-drafter", verifier)
    print(
        f"(d) {w.name}: BlockDiffusionDrafter.from_pretrained for the embedded verifier: loaded "
        f"({type(drafter).__name__}, draft vocabulary {drafter.model.config.draft_vocab_size})"
    )
PY
