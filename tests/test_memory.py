"""The memory benchmark at CI size: both methods decode the same number of tokens in processes of their own."""

from __future__ import annotations

from experiments import memory


def test_memory_benchmark_runs_each_method_in_its_own_process(capsys):
    result = memory.main(["--model", "tiny", "--max-new-tokens", "16"])
    runs = result["runs"]
    assert set(runs) == {"plain", "hybrid"}
    for run in runs.values():
        assert run["new_tokens"] == 16  # min_new_tokens: the same work for both
        assert run["peak_bytes"] > 0 and run["loaded_bytes"] > 0
    assert result["ratio"] == runs["hybrid"]["peak_bytes"] / runs["plain"]["peak_bytes"]
    print(capsys.readouterr().out)  # the figures, in the test log
