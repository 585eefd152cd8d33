"""Data-parallel training: `accelerate launch --multi_gpu --num_processes 2 -m drafters.training.train` on the CPU
(2 torchrun workers talking through gloo; `--cpu --num_processes 2` would start one process without mpirun), on a
tiny Llama verifier folder: the main process generates the answers and features alone, both processes resume from a
checkpoint, each trains on its half of a step's sequences, and the main process alone logs and exports a drafter
that loads and decodes losslessly.

Two processes take the step one process takes: both build the whole step's batch from the same seeded generator
(the same sequences, anchors and reveals) and take their halves of it, and each divides its loss by the whole step's
weight. The weights still differ in the last bits, not exactly: the gradient of each half is summed by the
all-reduce instead of inside one backward, and a matmul over 2 sequences rounds differently from one over 4."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from test_any_verifier import GENERATION, PROMPTS, load, save_verifier
from test_experiments import free_port

from drafters import BlockDiffusionDrafter
from drafters.block_diffusion import verifier_fingerprint
from drafters.training import train
from hybrid.testing import check_greedy_lossless
from schedulers import FixedScheduler
from verifiers.prompts import encode_prompt

REPO = Path(__file__).resolve().parent.parent
TRAINING = ["--doc-tokens", "0", "--seqs-per-step", "4", "--anchors-per-seq", "4", "--block-size", "4"]
TRAINING += ["--draft-vocab", "64", "--save-every", "1", "--eval-every", "3"]


def launch(argv: list[str], processes: int = 2) -> subprocess.CompletedProcess:
    command = ["accelerate", "launch", "--multi_gpu", "--num_processes", str(processes), "--num_machines", "1"]
    command += ["--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port())]
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [*command, "-m", "drafters.training.train", *argv],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def run_dir(argv: list[str], work: Path) -> Path:
    """Where `train.main(argv)` keeps its checkpoint (the only train-* folder of its verifier's work folder)."""
    (folder,) = [
        p for p in work.rglob("train-block-*") if p.name.endswith(train.recipe_tag(train.parser().parse_args(argv)))
    ]
    return folder


@pytest.mark.skipif(shutil.which("accelerate") is None, reason="needs the accelerate launcher")
def test_two_processes_train_as_one_resume_and_export_a_lossless_drafter(tmp_path, one_thread):
    folder = save_verifier(tmp_path / "llama", "llama")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    common = ["--verifier", str(folder), "--prompts", str(prompts), *GENERATION, *TRAINING]
    three = [*common, "--steps", "3"]
    one, two = tmp_path / "one", tmp_path / "two"
    train.main([*three, "--work-dir", str(one)])  # the reference: one process, three steps
    # A checkpoint after two steps, put where the three-step run of `two` looks for it, so the launch resumes there.
    train.main([*common, "--steps", "2", "--work-dir", str(tmp_path / "partial")])
    partial = next((tmp_path / "partial").rglob("checkpoint.pt"))
    reference = run_dir(three, one)
    resume_at = two / reference.relative_to(one)
    resume_at.mkdir(parents=True)
    shutil.copy(partial, resume_at / "checkpoint.pt")

    result = launch([*three, "--work-dir", str(two)])
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("resumed at step 2 of 3") == 1  # the main process alone prints
    answers = sorted(one.rglob("gen-*.json"))
    assert [p.read_text() for p in answers] == [(two / p.relative_to(one)).read_text() for p in answers]
    logged = [json.loads(line) for line in (resume_at / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [3]  # written once, by the main process
    expected = [json.loads(line) for line in (reference / "log.jsonl").read_text().splitlines()][-1]
    assert logged[0]["loss"] == pytest.approx(expected["loss"], rel=1e-4)  # the whole step's loss, as one computes it

    mine = torch.load(resume_at / "checkpoint.pt", weights_only=False)
    theirs = torch.load(reference / "checkpoint.pt", weights_only=False)
    assert mine["step"] == theirs["step"] == 3
    for name, weight in theirs["model"].items():
        torch.testing.assert_close(mine["model"][name], weight, rtol=1e-5, atol=1e-6, msg=name)

    model, tokenizer = load(folder)
    out = train.verifier_work_dir(two, verifier_fingerprint(model)) / "block-drafter"
    drafter = BlockDiffusionDrafter.from_pretrained(out, model, tokenizer=tokenizer)
    prompt = encode_prompt(tokenizer, "Explain tides in one line.")
    report = check_greedy_lossless(model, prompt, drafter, FixedScheduler(drafter.node_budget), max_new_tokens=20)
    assert sum(report.stats.drafted) > 0  # every step drafts: whether that pays is the cost model's call
