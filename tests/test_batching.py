"""The batching benchmark at CI size: every method at every batch size, rows checked against batch 1."""

from __future__ import annotations

import json

import pytest

from experiments import batching


def test_batching_benchmark_checks_rows_against_batch_one(tmp_path, capsys):
    results = batching.main(
        [
            "--model",
            "tiny",
            "--dataset",
            "dev",
            "--num-prompts",
            "4",
            "--batch-sizes",
            "1,2,4",
            "--max-new-tokens",
            "8",
            "--out",
            str(tmp_path),
        ]
    )
    assert set(results) == {f"{m}@{b}" for m in batching.METHODS for b in (1, 2, 4)}
    for key, result in results.items():
        assert result["tok_s"] > 0
        assert result["identical"] is (None if result["method"] == "plain" else True), key
    assert json.loads((tmp_path / "batching.json").read_text())["results"] == results
    print(capsys.readouterr().out)


def test_batch_sizes_must_divide_the_prompts(tmp_path):
    with pytest.raises(SystemExit):
        batching.main(["--model", "tiny", "--num-prompts", "3", "--batch-sizes", "2", "--out", str(tmp_path)])
