"""The acceptance experiment: metrics on hand-made step logs, bad input, resume, sharding (tiny random model)."""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from drafters.training.parallel import started_alone_by_accelerate
from experiments import acceptance, methods, metrics, plots
from experiments.acceptance import parse_args
from experiments.acceptance.plan import make_plan, run_key
from experiments.acceptance.report import against_fixed
from experiments.acceptance.run import run_shard
from experiments.methods import DrafterEntry
from experiments.models import load_tiny_model
from schedulers.registry import fixed_k
from verifiers.prompts import encode_prompt

REPO = Path(__file__).resolve().parent.parent

# Step 0 is the prefill. Steps 1-3 draft 3, 3, 2 tokens and keep 3, 1, 0; step 4 drafts nothing; step 5 keeps 1 of 1.
DRAFTED = [0, 3, 3, 2, 0, 1]
ACCEPTED = [0, 3, 1, 0, 0, 1]
EMITTED = [1, 4, 2, 1, 1, 2]


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models, one torch thread (conftest.py)


# ---------------------------------------------------------------------------------------------------
# Metrics on synthetic step logs


def test_position_counts_and_acceptance_by_position():
    # Position 1: steps drafting >= 1 are 1, 2, 3, 5 (4 steps); accepted >= 1 in steps 1, 2, 5 -> 3/4.
    # Position 2: steps 1, 2, 3 (3); accepted >= 2 only in step 1 -> 1/3.
    # Position 3: steps 1, 2 (2); accepted >= 3 in step 1 -> 1/2 (a different set of steps than position 2).
    assert metrics.position_counts(DRAFTED, ACCEPTED) == ([4, 3, 2], [3, 1, 1])
    assert metrics.acceptance_by_position(DRAFTED, ACCEPTED) == [0.75, 1 / 3, 0.5]


def test_histogram_tau_and_rate():
    # Drafting steps accepted 3, 1, 0, 1: lengths 0, 1, 2, 3 occur 1, 2, 0, 1 times; the prefill and step 4 do not count.
    assert metrics.accepted_length_histogram(DRAFTED, ACCEPTED) == [1, 2, 0, 1]
    assert metrics.tau(EMITTED) == 11 / 6
    assert metrics.acceptance_rate(DRAFTED, ACCEPTED) == 5 / 9


def test_metrics_without_any_draft():
    assert metrics.position_counts([0, 0], [0, 0]) == ([], [])
    assert metrics.acceptance_by_position([0, 0], [0, 0]) == []
    assert metrics.accepted_length_histogram([0, 0], [0, 0]) == []
    assert math.isnan(metrics.acceptance_rate([0, 0], [0, 0]))
    assert metrics.tau([1, 1, 1]) == 1.0


def record(config: str, drafted, accepted, emitted, seconds, baseline_tokens, baseline_seconds, matches):
    return {
        "config": config,
        "drafted": drafted,
        "accepted": accepted,
        "emitted": emitted,
        "tau": metrics.tau(emitted),
        "new_tokens": sum(emitted),
        "total_time": seconds,
        "baseline_new_tokens": baseline_tokens,
        "baseline_time": baseline_seconds,
        "matches_generate": matches,
    }


def test_summarize_pools_counts_and_throughput():
    runs = [
        record("a", DRAFTED, ACCEPTED, EMITTED, 1.0, 11, 2.0, True),
        record("b", [0, 2], [0, 2], [1, 3], 1.0, 4, 1.0, None),
        record("a", [0, 4, 2], [0, 4, 0], [1, 5, 1], 1.0, 7, 2.0, False),
    ]
    a, b = metrics.summarize(runs, ("config",))
    assert (a["config"], a["runs"], b["config"], b["runs"]) == ("a", 2, "b", 1)
    assert a["mean_tau"] == pytest.approx((11 / 6 + 7 / 3) / 2)
    assert a["tokens_per_s"] == pytest.approx(18 / 2)  # 11 + 7 tokens in 1 + 1 s
    assert a["baseline_tokens_per_s"] == pytest.approx(18 / 4)
    assert a["speedup"] == pytest.approx(2.0)
    # Pooled counts: attempts [4, 3, 2] + [2, 2, 1, 1], successes [3, 1, 1] + [1, 1, 1, 1].
    assert a["acceptance_by_position"] == pytest.approx([4 / 6, 2 / 5, 2 / 3, 1 / 1])
    assert a["accepted_length_histogram"] == [2, 2, 0, 1, 1]  # [1, 2, 0, 1] + accepted 4 and 0
    assert a["acceptance_rate"] == pytest.approx((5 + 4) / (9 + 6))
    assert (a["matches_generate"], a["checked_against_generate"]) == (1, 2)
    assert (b["matches_generate"], b["checked_against_generate"]) == (None, 0)
    assert b["acceptance_by_position"] == [1.0, 1.0]


def test_adaptive_schedulers_are_compared_with_the_best_fixed_k_in_hindsight():
    row = lambda scheduler, speed, dataset="d": {  # noqa: E731
        "dataset": dataset,
        "drafter": "x",
        "block_size": 16,  # noqa: E731
        "temperature": 0.0,
        "scheduler": scheduler,
        "tokens_per_s": speed,
    }
    rows = [
        row("fixed-4", 20.0),
        row("fixed-13", 30.0),
        row("fixed", 25.0),
        row("cost-aware", 33.0),
        row("fixed-4", 10.0, "other"),
        row(None, 9.0),
    ]  # another dataset's fixed k and a drafter-less row
    assert fixed_k(rows[2]["scheduler"], rows[2]["block_size"]) == 16  # "fixed" verifies the block size
    (line,) = against_fixed(rows)
    assert line.startswith(
        "d x b=16 T=0: cost-aware 33.0 tok/s = 1.10x the best fixed k in hindsight (k = 13 of 3 swept"
    )
    assert line.endswith("1.32x fixed k = 16 (25.0)")
    assert against_fixed([row("cost-aware", 33.0)]) == []  # nothing to compare with


# ---------------------------------------------------------------------------------------------------
# Bad input: a clear error before any model loads


def no_model(name):
    raise AssertionError("a model was loaded despite bad input")


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    texts = ["abc abc abc abc", "def f(x): return x + x + x", "one two one two one", "aaaa bbbb"]
    path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    return path


@pytest.mark.parametrize(
    "args, message",
    [
        (["--datasets", "nope"], "unknown dataset 'nope'"),
        (["--datasets", "missing.jsonl"], "cannot read prompts file missing.jsonl"),
        (["--drafters", "lookup,eagle"], "unknown drafter 'eagle'"),
        (["--schedulers", "greedy"], "unknown scheduler 'greedy'"),
        (["--schedulers", "fixed-0"], "k=0 must be >= 1"),
        (["--schedulers", "fixed-8", "--block-sizes", "4"], "verifies 8 tokens but block size 4"),
        (["--block-sizes", "0"], "block size 0 must be >= 1"),
        (["--block-sizes", "2,x"], "'x' is not an integer"),
        (
            ["--drafters", "tiny-block", "--block-sizes", "8"],
            "block size 8 is above drafter 'tiny-block''s maximum of 4",
        ),
        (["--drafters", "block", "--block-sizes", "99"], "block size 99 is above drafter 'block''s maximum of"),
        (["--temperatures", "-1"], "temperature -1.0 must be >= 0"),
        (["--num-prompts", "0"], "--num-prompts 0"),
        (["--model", "no-such-model"], "--model 'no-such-model'"),
        (["--model", "tiny", "--drafters", "lookup,default"], "['default'] are trained for the default verifier"),
    ],
)
def test_bad_input_fails_before_any_model_loads(args, message, monkeypatch, capsys, tmp_path):
    # A block drafter trained for blocks of 4, registered the way a new drafter would be.
    monkeypatch.setitem(methods.DRAFTERS, "tiny-block", DrafterEntry(lambda b, ref, model: None, 4, max_block_size=4))
    with pytest.raises(SystemExit) as exit_info:
        acceptance.main(args + ["--out", str(tmp_path / "out")], load=no_model)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_chat_template_applied_when_the_tokenizer_has_one():
    _, tokenizer = load_tiny_model()
    templated = encode_prompt(tokenizer, "hi")[0].tolist()
    assert tokenizer.decode(templated) == "<user>hi\n<assistant>"
    tokenizer.chat_template = None
    assert tokenizer.decode(encode_prompt(tokenizer, "hi")[0].tolist()) == "hi"


# ---------------------------------------------------------------------------------------------------
# Resume and sharding on the tiny random model


def sweep_args(prompts_file, out, *extra):
    return [
        "--model",
        "tiny",
        "--datasets",
        str(prompts_file),
        "--drafters",
        "lookup,oracle,none",
        "--schedulers",
        "heuristic,fixed-2",
        "--block-sizes",
        "3",
        "--temperatures",
        "0,0.7",
        "--num-prompts",
        "3",
        "--max-new-tokens",
        "12",
        "--out",
        str(out),
        *extra,
    ]


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def same_decoding(a: dict, b: dict) -> bool:
    return all(a[f] == b[f] for f in ("output_ids", "drafted", "accepted", "emitted", "matches_generate"))


def test_resume_skips_finished_runs(prompts_file, tmp_path):
    out = tmp_path / "out"
    rows = acceptance.main(sweep_args(prompts_file, out))
    first = (out / "runs.jsonl").read_text().splitlines()
    assert len(first) == 3 * (2 * 2 * 2 + 2)  # prompts x (2 drafters x 2 schedulers x 2 temperatures + none x 2)
    assert sum(r["runs"] for r in rows) == len(first)
    assert (out / "summary.csv").exists() and (out / "report.md").exists()
    if plots.available():
        assert (out / "acceptance_by_position.png").exists()
        assert (out / "tau_and_speed_vs_block_size.png").exists()

    # Interrupted: 7 runs finished, the 8th cut off mid-write.
    (out / "runs.jsonl").write_text("\n".join(first[:7]) + "\n" + first[7][:40])
    loads = []
    acceptance.main(sweep_args(prompts_file, out), load=lambda name: loads.append(name) or load_tiny_model())
    lines = (out / "runs.jsonl").read_text().splitlines()
    assert lines[:7] == first[:7] and loads == ["tiny"]
    assert len(lines) == len(first)  # the fragment was cut, the 8th and later runs redone
    redone = [json.loads(line) for line in lines[7:]]
    originals = {run_key(r): r for r in map(json.loads, first)}
    assert all(same_decoding(r, originals[run_key(r)]) for r in redone)  # greedy and sampled runs redo identically

    # Everything done: no model loads, the outputs are rewritten from the file.
    rows = acceptance.main(sweep_args(prompts_file, out), load=no_model)
    assert sum(r["runs"] for r in rows) == len(first)


def test_sharded_runs_equal_unsharded(prompts_file, tmp_path):
    plan = make_plan(parse_args(sweep_args(prompts_file, tmp_path))[1])
    whole = run_shard(plan, plan.prompts, set(), tmp_path / "whole.jsonl", show_progress=False)
    shards = [
        run_shard(plan, plan.prompts[r::2], set(), tmp_path / f"rank{r}.jsonl", show_progress=False) for r in (0, 1)
    ]
    merged = {run_key(r): r for r in shards[0] + shards[1]}
    assert len(merged) == len(whole) == len(plan.prompts) * len(plan.configs)
    assert all(same_decoding(r, merged[run_key(r)]) for r in whole)
    assert all(r["matches_generate"] for r in whole if r["temperature"] == 0)
    assert any(r["tau"] > 1 for r in whole)  # the oracle's drafts are accepted: multi-token steps were exercised


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(shutil.which("accelerate") is None, reason="needs the accelerate launcher")
def test_accelerate_launch_two_processes_matches_one(prompts_file, tmp_path):
    single = tmp_path / "single"
    acceptance.main(sweep_args(prompts_file, single))
    sharded = tmp_path / "sharded"
    # --multi_gpu on a machine without GPUs starts 2 torchrun workers, which the sweep runs on the CPU
    # (`--cpu --num_processes 2` would start only one without mpirun).
    launch = [
        "accelerate",
        "launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(free_port()),
        "-m",
        "experiments.acceptance",
    ]
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        launch + sweep_args(prompts_file, sharded), cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    expected = {run_key(r): r for r in read_lines(single / "runs.jsonl")}
    got = {run_key(r): r for r in read_lines(sharded / "runs.jsonl")}
    assert got.keys() == expected.keys()
    assert all(same_decoding(got[k], expected[k]) for k in expected)
    assert (sharded / "summary.csv").read_text().count("\n") == (single / "summary.csv").read_text().count("\n")
    assert "2 process(es)" in (sharded / "report.md").read_text()


def test_warns_when_accelerate_cpu_launch_started_one_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("ACCELERATE_USE_CPU", "True")
    monkeypatch.setenv(
        "MASTER_PORT", "29500"
    )  # what `accelerate launch --cpu --num_processes 2` sets, and no WORLD_SIZE
    assert started_alone_by_accelerate()
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert not started_alone_by_accelerate()


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "holds no answers: pass a folder"),
        (["--ar", "x"], "--ar needs a --block checkpoint"),
        (["--passes", "0"], "--passes '0': every value must be >= 1"),
        (["--lookup", "7,x"], "--lookup '7,x': give comma-separated integers"),
        (["--max-ngrams", "0"], "--max-ngrams '0': every value must be >= 1"),
        (["--branch", "0,-1"], "--branch '0,-1': every value must be >= 0"),
        (["--refill-below", "0,1.5"], "--refill-below '0,1.5': give shares in [0, 1]"),
        (["--refill-below", "x"], "--refill-below 'x': give shares in [0, 1]"),
        (["--prefer-store", "0.5"], "--prefer-store needs --ngram-store"),
        (["--anchors-per-answer", "0"], "--anchors-per-answer 0: give at least 1"),
    ],
)
def test_heldout_bad_input_fails_before_any_model_loads(args, message, capsys, tmp_path):
    from experiments import heldout

    answers = tmp_path / "answers"
    answers.mkdir()
    if args:  # every case but the first has answers to read
        (answers / "gen-00000.json").write_text("[]")
    with pytest.raises(SystemExit) as exit_info:
        heldout.main(["--answers", str(answers), "--work-dir", str(tmp_path / "work")] + args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "work").exists()


@pytest.mark.slow
def test_the_shipped_scheduler_prior_is_keyed_by_the_default_pair():
    """The default scheduler of `hybrid.load_default()` starts from the prior shipped beside its drafter: the file
    names the default drafter and verifier as they fingerprint today (rerun `python -m experiments.scheduler_prior`
    after changing either)."""
    import hybrid
    from schedulers.cost_aware import default_scheduler

    model, _, drafter = hybrid.load_default()
    scheduler = default_scheduler(drafter, model)
    scheduler.start(drafter, model=model)
    assert scheduler.prior is not None


def test_architectures_judges_each_type_and_resumes(tmp_path, capsys):
    """`experiments.architectures` on a served type, one served without padding and one refused; a rerun with the
    same folder judges nothing again."""
    from experiments import architectures

    architectures.main(["--types", "llama,bart,cpmant", "--out", str(tmp_path)])
    records = {r["type"]: r for r in map(json.loads, (tmp_path / "records.jsonl").read_text().splitlines())}
    assert records["llama"] == {"type": "llama", "verdict": "equal", "detail": ""}
    assert records["bart"]["verdict"] == "equal" and "padded batch refused" in records["bart"]["detail"]
    assert records["cpmant"]["verdict"] == "refused" and "depends on the tokens after it" in records["cpmant"]["detail"]
    assert "differs 0, hybrid error 0, equal 2, refused 1, not built 0" in (tmp_path / "table.md").read_text()
    capsys.readouterr()
    architectures.main(["--types", "llama", "--out", str(tmp_path)])
    assert "[1/1]" not in capsys.readouterr().out  # already judged


def test_architectures_refuses_an_unknown_type(tmp_path):
    from experiments import architectures

    with pytest.raises(SystemExit):
        architectures.main(["--types", "llama,no_such_model", "--out", str(tmp_path)])


@pytest.mark.slow
def test_quantized_judges_each_scheme(tmp_path):
    """`experiments.quantized` judges every scheme: torch's own dynamic quantization is refused by name, and a scheme
    whose library is missing says so; none differs from `generate`."""
    from experiments import quantized

    quantized.main(["--num-prompts", "1", "--max-new-tokens", "8", "--out", str(tmp_path)])
    rows = (tmp_path / "table.md").read_text().splitlines()[2:]
    verdicts = {row.split(" | ")[0].strip("| "): row.split(" | ")[1] for row in rows}
    assert list(verdicts) == list(quantized.SCHEMES)
    assert verdicts["torch.ao dynamic int8"] == "refused"
    assert set(verdicts.values()) <= {"equal", "refused", "not installed"}
