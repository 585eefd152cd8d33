"""The head-to-head benchmark: resume, sharding and bad input, on the tiny random model."""

from __future__ import annotations

import json

import pytest

from experiments import bench
from experiments.models import load_tiny_model

METHODS = "plain,hybrid-none,hybrid-lookup,oracle"


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models, one torch thread (conftest.py)


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    texts = ["abc abc abc abc", "def f(x): return x + x + x", "one two one two one"]
    path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    return path


def bench_args(prompts_file, out, *extra):
    return [
        "--model",
        "tiny",
        "--dataset",
        str(prompts_file),
        "--methods",
        METHODS,
        "--num-prompts",
        "3",
        "--max-new-tokens",
        "10",
        "--repeats",
        "2",
        "--out",
        str(out),
        *extra,
    ]


def no_model(name):
    raise AssertionError(f"no model should load, got {name!r}")


def decoding(record: dict) -> tuple:
    """What a measurement decodes (not how long it took)."""
    return record["new_tokens"], record["tau"], record["identical"]


def test_a_method_can_name_its_scheduler(prompts_file, tmp_path):
    args = bench_args(prompts_file, tmp_path / "out")
    args[args.index("--methods") + 1] = "plain,hybrid-lookup,hybrid-lookup@fixed-2,hybrid-lookup@cost-aware"
    rows = bench.main(args)
    assert list(rows) == ["plain", "hybrid-lookup", "hybrid-lookup@fixed-2", "hybrid-lookup@cost-aware"]
    assert all(row["identical_to_plain"] for row in rows.values())


def test_a_method_can_name_its_cache_layout(prompts_file, tmp_path):
    args = bench_args(prompts_file, tmp_path / "out")
    args[args.index("--methods") + 1] = "plain,plain+static,hybrid-lookup+static@fixed-2"
    rows = bench.main(args)
    assert list(rows) == ["plain", "plain+static", "hybrid-lookup+static@fixed-2"]
    assert all(row["identical_to_plain"] for row in rows.values())
    assert all(row["warm_up_s"] is None for row in rows.values()), "only compiled methods are warmed up"


def test_resume_skips_finished_measurements(prompts_file, tmp_path):
    out = tmp_path / "out"
    rows = bench.main(bench_args(prompts_file, out))
    first = (out / "bench.jsonl").read_text().splitlines()
    assert len(first) == 2 * 3 * 4  # repeats x prompts x methods
    assert all(row["identical_to_plain"] for row in rows.values())
    assert rows["oracle"]["tau"] > 1 and rows["hybrid-none"]["tau"] == 1  # the oracle's drafts are accepted
    # Drafting's share of the time: none for plain generate, a fraction of every hybrid call's.
    assert rows["plain"]["drafting_share"] is None
    assert all(0 <= rows[m]["drafting_share"] < 1 for m in ("hybrid-none", "oracle"))
    assert json.loads((out / "summary.json").read_text())["methods"].keys() == rows.keys()

    # Interrupted: 5 measurements finished, the 6th cut off mid-write; the rerun redoes only the rest.
    (out / "bench.jsonl").write_text("\n".join(first[:5]) + "\n" + first[5][:30])
    loads = []
    bench.main(bench_args(prompts_file, out), load=lambda name: loads.append(name) or load_tiny_model())
    lines = (out / "bench.jsonl").read_text().splitlines()
    assert lines[:5] == first[:5] and len(lines) == len(first) and loads == ["tiny"]
    originals = {bench.measurement_key(r): r for r in map(json.loads, first)}
    assert all(decoding(r) == decoding(originals[bench.measurement_key(r)]) for r in map(json.loads, lines[5:]))

    # Everything done: no model loads, and the summary covers every measurement.
    rows = bench.main(bench_args(prompts_file, out), load=no_model)
    assert set(rows) == set(METHODS.split(","))


def test_sharded_measurements_equal_unsharded(prompts_file, tmp_path):
    _, args = bench.parse_args(bench_args(prompts_file, tmp_path))
    prompts = list(enumerate(bench.load_prompts(str(prompts_file))))
    whole = bench.run_shard(args, prompts, set(), tmp_path / "whole.jsonl", show_progress=False)
    shards = [
        bench.run_shard(args, prompts[r::2], set(), tmp_path / f"rank{r}.jsonl", show_progress=False) for r in (0, 1)
    ]
    merged = {bench.measurement_key(r): r for r in shards[0] + shards[1]}
    assert len(merged) == len(whole) == 2 * 3 * 4
    assert all(decoding(r) == decoding(merged[bench.measurement_key(r)]) for r in whole)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--dataset", "nope"], "unknown dataset 'nope'"),
        (["--dataset", "missing.jsonl"], "cannot read prompts file missing.jsonl"),
        (["--methods", "plain,eagle"], "unknown method(s) ['eagle']"),
        (["--model", "tiny", "--methods", "plain,hybrid-block"], "trained for the default verifier"),
        (["--repeats", "0"], "--repeats must be >= 1"),
        (["--methods", "plain,hybrid-lookup@fixed-0"], "hybrid-lookup@fixed-0: scheduler fixed-0: k=0 must be >= 1"),
        (["--methods", "plain@fixed-2"], "plain@fixed-2: only a hybrid method with a drafter takes a scheduler"),
        (["--methods", "hybrid-lookup@sometimes"], "unknown scheduler 'sometimes'"),
        (["--methods", "plain+paged"], "plain+paged: unknown cache layout 'paged': choose from static, compiled"),
        (["--methods", "hf-lookup+static"], "hf-lookup+static: assisted generation takes no cache layout"),
        (["--methods", "hybrid-nothing+static"], "unknown method(s) ['hybrid-nothing+static']"),
    ],
)
def test_bad_input_fails_before_any_model_loads(args, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(args + ["--out", str(tmp_path / "out")], load=no_model)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
