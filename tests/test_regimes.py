"""The regime sweep end to end on the tiny random model: a 2 x 2 grid (batch sizes 1, 2 x greedy, T = 1), its
files, its identity flags, resume, and bad input."""

from __future__ import annotations

import json

import pytest

import hybrid
from experiments import plots, regimes
from experiments.models import load_tiny_model

METHODS = ["plain", "hybrid-none", "hybrid-lookup"]


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models, one torch thread (conftest.py)


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    texts = ["abc abc abc abc", "def f(x): return x + x + x", "one two one two one", "aaaa bbbb"]
    path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    return path


def grid_args(prompts_file, out, *extra):
    return [
        "--model",
        "tiny",
        "--datasets",
        str(prompts_file),
        "--methods",
        ",".join(METHODS),
        "--batch-sizes",
        "1,2",
        "--temperatures",
        "0,1",
        "--num-prompts",
        "2",
        "--max-new-tokens",
        "8",
        "--repeats",
        "2",
        "--out",
        str(out),
        *extra,
    ]


def no_model(name):
    raise AssertionError(f"no model should load, got {name!r}")


def read_records(out) -> list[dict]:
    return [json.loads(line) for line in (out / regimes.RECORDS_FILE).read_text().splitlines()]


def test_a_two_by_two_grid_end_to_end(prompts_file, tmp_path):
    out = tmp_path / "out"
    rows = regimes.main(grid_args(prompts_file, out))
    assert [(r["temperature"], r["batch_size"]) for r in rows] == [(0, 1), (0, 2), (1, 1), (1, 2)]
    records = read_records(out)
    # 2 repeats x (2 batches of 1 + 1 batch of 2) x 2 temperatures x 3 methods
    assert len(records) == 2 * 3 * 2 * 3
    for record in records:
        comparable = record["temperature"] == 0 or record["batch_size"] == 1
        assert record["identical"] is (True if comparable else None), record
    for row in rows:
        assert set(row["methods"]) == set(METHODS) and all(s["tokens_per_s"] > 0 for s in row["methods"].values())
        assert row["methods"]["hybrid-none"]["tau"] == 1 and row["methods"]["plain"]["tau"] is None
        best = max(row["methods"][m]["tokens_per_s"] for m in regimes.BASELINES)
        assert row["over_best_baseline"]["hybrid-lookup"] == row["methods"]["hybrid-lookup"]["tokens_per_s"] / best

    summary = json.loads((out / regimes.SUMMARY_FILE).read_text())
    assert summary["cells"] == rows
    table = (out / regimes.TABLE_FILE).read_text()
    lines = table.splitlines()
    assert "lookup/best" in lines[1] and len([line for line in lines if line.startswith("prompts ")]) == 4
    assert [line.split()[-1] for line in lines[2:6]] == ["yes", "yes", "yes", "n/c"]
    assert regimes.NOT_COMPARABLE in table and "hybrid-lookup is faster than both plain and hybrid-none in" in table
    if plots.available():
        assert (out / regimes.PLOT_FILE).stat().st_size > 0

    # Interleaved: within a repeat the methods take turns at running first.
    firsts = [r["method"] for r in records[:: len(METHODS)]]
    assert len(set(firsts)) == len(METHODS)

    # Interrupted: 7 measurements kept, the 8th cut mid-write; the rerun redoes only the rest.
    lines = (out / regimes.RECORDS_FILE).read_text().splitlines()
    (out / regimes.RECORDS_FILE).write_text("\n".join(lines[:7]) + "\n" + lines[7][:30])
    loads = []
    regimes.main(grid_args(prompts_file, out), load=lambda name: loads.append(name) or load_tiny_model())
    again = read_records(out)
    assert again[:7] == records[:7] and len(again) == len(records) and loads == ["tiny"]
    key = regimes.measurement_key
    originals = {key(r): r for r in records}
    assert all(r["new_tokens"] == originals[key(r)]["new_tokens"] for r in again)

    # Finished: no model loads, the same cells come back from the file.
    assert [r["methods"].keys() for r in regimes.main(grid_args(prompts_file, out), load=no_model)] == [
        r["methods"].keys() for r in rows
    ]


def test_an_output_unlike_generate_is_flagged(prompts_file, tmp_path, monkeypatch):
    real = hybrid.generate

    def off_by_one(*args, **kwargs):  # a decoder whose every last token differs from the verifier's
        out, stats = real(*args, **kwargs)
        out = out.clone()
        out[:, -1] = (out[:, -1] + 1) % 256
        return out, stats

    monkeypatch.setattr(hybrid, "generate", off_by_one)
    out = tmp_path / "out"
    rows = regimes.main(grid_args(prompts_file, out, "--repeats", "1"))
    compared = [r for r in read_records(out) if r["identical"] is not None]
    assert all(r["identical"] is (r["method"] == "plain") for r in compared)
    assert [regimes.identical_text(r).split()[0] for r in rows] == ["NO", "NO", "NO", "n/c"]


def test_min_pairs_repeats_the_cells_of_few_batches(prompts_file, tmp_path):
    _, args, prompts = regimes.parse_args(grid_args(prompts_file, tmp_path, "--repeats", "1", "--min-pairs", "3"))
    runs = regimes.schedule(args, regimes.plan_batches(args, prompts))
    pairs = {}
    for repeat, batch, method in runs:
        pairs.setdefault((batch.temperature, batch.batch_size, method), set()).add((repeat, batch.index))
    # batch size 1: two batches a repeat, so two repeats; batch size 2: one batch, so three repeats
    assert {key: len(runs) for key, runs in pairs.items()} == {
        (t, size, m): 4 if size == 1 else 3 for t in (0, 1) for size in (1, 2) for m in METHODS
    }
    _, args, _ = regimes.parse_args(grid_args(prompts_file, tmp_path, "--min-pairs", "0"))
    assert len(regimes.schedule(args, regimes.plan_batches(args, prompts))) == 2 * 3 * 2 * 3  # off: --repeats


@pytest.mark.parametrize(
    "args, message",
    [
        (["--num-prompts", "3"], "--num-prompts 3 must be a multiple of every batch size (not of [2])"),
        (["--num-prompts", "6", "--batch-sizes", "1"], "has 4 prompts: use --num-prompts 4 or fewer"),
        (["--batch-sizes", "0"], "every batch size must be >= 1"),
        (["--temperatures", "-0.5"], "temperature -0.5 must be >= 0"),
        (["--repeats", "0"], "--repeats 0 must be >= 1"),
        (["--min-pairs", "-1"], "--min-pairs -1 must be >= 0"),
        (["--methods", "plain,oracle"], "method 'oracle': batches run plain or hybrid-NAME"),
        (["--methods", "plain,hf-lookup"], "method 'hf-lookup': batches run plain or hybrid-NAME"),
        (["--methods", "plain,hybrid-lookup+static"], "method 'hybrid-lookup+static'"),
        (["--methods", "hybrid-none@fixed-2"], "only a hybrid method with a drafter takes a scheduler"),
        (["--methods", "hybrid-lookup@sometimes"], "unknown scheduler 'sometimes'"),
        (["--methods", "plain,hybrid-default"], "['hybrid-default'] are trained for the default verifier"),
        (["--datasets", "nope"], "unknown dataset 'nope'"),
        (["--model", "no-such-model"], "--model 'no-such-model'"),
    ],
)
def test_bad_input_fails_before_any_model_loads(args, message, prompts_file, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        regimes.main(grid_args(prompts_file, tmp_path / "out") + args, load=no_model)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_held_out_set_is_registered():
    texts = regimes.load_prompts("heldout")
    assert len(texts) == len(set(texts)) >= 24
    assert not set(texts) & set(regimes.load_prompts("dev"))
    assert not set(texts) & set(regimes.load_prompts("dev-chat"))
