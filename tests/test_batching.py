"""The batching benchmark at CI size: every method at every batch size, interleaved and repeated, every output
checked against `model.generate`'s on the same batch, and what the drafts add said against hybrid-none."""

from __future__ import annotations

import json

import pytest

from experiments import batching

METHODS = ["plain", "hybrid-none", "hybrid-lookup"]


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models, one torch thread (conftest.py)


def batching_args(out, *extra):
    return [
        "--model",
        "tiny",
        "--dataset",
        "dev",
        "--methods",
        ",".join(METHODS),
        "--num-prompts",
        "4",
        "--batch-sizes",
        "1,2,4",
        "--max-new-tokens",
        "8",
        "--repeats",
        "2",
        "--out",
        str(out),
        *extra,
    ]


def test_every_method_is_checked_against_generate_and_the_drafts_against_none(tmp_path, capsys):
    rows = batching.main(batching_args(tmp_path))
    assert [r["batch_size"] for r in rows] == [1, 2, 4]
    for row in rows:
        assert set(row["methods"]) == set(METHODS)
        batches = 4 // row["batch_size"]
        for method, summary in row["methods"].items():
            assert summary["tokens_per_s"] > 0
            assert summary["identical"] == summary["compared"] == 2 * batches, (method, row["batch_size"])
    records = [json.loads(line) for line in (tmp_path / batching.RECORDS_FILE).read_text().splitlines()]
    assert len(records) == 2 * (4 + 2 + 1) * len(METHODS)  # repeats x batches x methods
    assert all(r["new_tokens"] == 8 * r["batch_size"] for r in records)  # every row decodes exactly 8 tokens
    firsts = [r["method"] for r in records[:: len(METHODS)]]
    assert len(set(firsts)) == len(METHODS), "the methods take turns at running first"
    assert json.loads((tmp_path / batching.SUMMARY_FILE).read_text())["batches"] == rows

    out = capsys.readouterr().out
    assert "lookup/none" in out and "x plain" in out
    assert "what hybrid-lookup's drafts add (against hybrid-none, the engine without drafts):" in out
    for row in rows:
        with_drafts, without = (row["methods"][m]["tokens_per_s"] for m in ("hybrid-lookup", "hybrid-none"))
        assert f"batch {row['batch_size']}: {with_drafts:.1f} against {without:.1f} tok/s without them" in out


def test_without_hybrid_none_the_drafts_are_not_judged(tmp_path, capsys):
    args = batching_args(tmp_path, "--repeats", "1", "--batch-sizes", "2")
    args[args.index("--methods") + 1] = "plain,hybrid-lookup"
    batching.main(args)
    assert "(no hybrid-none in --methods: what hybrid-lookup's drafts add is not measured)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--num-prompts", "3", "--batch-sizes", "2"], "--num-prompts 3 must be a multiple of every batch size"),
        (["--methods", "plain,hybrid-default"], "['hybrid-default'] are trained for the default verifier"),
        (["--repeats", "0"], "--repeats 0 must be >= 1"),
    ],
)
def test_bad_input_fails_before_any_model_loads(args, message, tmp_path, capsys):
    def no_model(name):
        raise AssertionError(f"no model should load, got {name!r}")

    with pytest.raises(SystemExit) as exit_info:
        batching.main(batching_args(tmp_path / "out") + args, load=no_model)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
