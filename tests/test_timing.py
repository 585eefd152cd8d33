"""Every command that compares decoders times hybrid as it times plain `generate`: end to end, around the whole
call. A `hybrid.generate` that spends a known time before its decoding loop (argument checks, cache set-up) must
show that time in each command's figures (tiny random model)."""

from __future__ import annotations

import json
import re
import time

import pytest

import hybrid
from drafters import PromptLookupDrafter
from experiments import acceptance
from experiments.models import load_tiny_model
from hybrid import cli

SET_UP_SECONDS = 0.4


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models, one torch thread (conftest.py)


@pytest.fixture
def slow_set_up(monkeypatch):
    """`hybrid.generate` with SET_UP_SECONDS of work before it reaches the engine's loop."""
    real = hybrid.generate

    def generate(*args, **kwargs):
        time.sleep(SET_UP_SECONDS)
        return real(*args, **kwargs)

    monkeypatch.setattr(hybrid, "generate", generate)


def test_the_cli_speed_up_counts_hybrid_set_up(slow_set_up, monkeypatch, capsys):
    model, tokenizer = load_tiny_model()
    monkeypatch.setattr(
        hybrid, "load_default", lambda device, device_map=None: (model, tokenizer, PromptLookupDrafter())
    )
    assert cli.main(["generate", "abc abc abc abc", "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    hybrid_tps = float(re.search(r"hybrid \(.*\): ([\d.]+) tok/s end to end", out).group(1))
    plain_tps = float(re.search(r"plain model.generate: \d+ tokens, ([\d.]+) tok/s", out).group(1))
    speedup = float(re.search(r"speed-up ([\d.]+)x", out).group(1))
    # 8 tokens took at least the set-up time, and the speed-up is the ratio of the two end-to-end figures (each
    # printed rounded, so compared within that rounding).
    assert hybrid_tps <= 1.1 * 8 / SET_UP_SECONDS, out
    assert speedup == pytest.approx(hybrid_tps / plain_tps, rel=0.01, abs=0.006), out
    assert "identical to model.generate: yes" in out


def test_acceptance_times_hybrid_end_to_end(slow_set_up, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "abc abc abc abc"}) + "\n")
    out = tmp_path / "out"
    args = ["--model", "tiny", "--datasets", str(prompts), "--drafters", "lookup", "--num-prompts", "1"]
    acceptance.main(args + ["--max-new-tokens", "6", "--out", str(out)])
    (record,) = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    assert record["total_time"] >= SET_UP_SECONDS
    assert record["tokens_per_s"] == pytest.approx(record["new_tokens"] / record["total_time"])
    assert record["engine_time"] < record["total_time"]
