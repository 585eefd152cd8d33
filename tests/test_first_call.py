"""experiments.first_call end to end on the tiny model: a fresh process per prompt, both calls checked."""

import json

import pytest

from experiments import first_call


def test_first_call_runs_each_prompt_in_its_own_process_and_resumes(tmp_path, capsys):
    argv = ["--model", "tiny", "--method", "hybrid-lookup", "--num-prompts", "1", "--max-new-tokens", "8"]
    argv += ["--warm-prompts", "1", "--out", str(tmp_path)]
    summary = first_call.main(argv)
    assert summary["first"]["identical"] and summary["warmed"]["identical"]
    assert summary["first"]["speedup"] > 0 and summary["first_over_warmed"] > 0
    (record,) = [json.loads(line) for line in (tmp_path / first_call.RECORDS_FILE).read_text().splitlines()]
    assert record["first"]["new_tokens"] == record["warmed"]["new_tokens"] == 8
    again = first_call.main(argv)  # resumes: nothing is measured twice
    assert again["first"] == summary["first"]
    assert len((tmp_path / first_call.RECORDS_FILE).read_text().splitlines()) == 1


def test_first_call_refuses_a_method_without_a_drafter_name():
    with pytest.raises(SystemExit):
        first_call.parse_args(["--method", "plain"])
