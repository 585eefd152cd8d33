"""The drafter pipeline's lasting prompt sets: held-out answers stored as token ids, fine-tune prompts, reveals."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from drafters.training import answer_sets
from drafters.training.answer_sets import (
    RECIPE_BATCH,
    RECIPE_FOLDER,
    RECIPE_TURNS,
    fine_tune_prompts,
    load_answers,
    pack_recipe,
    recipe_split,
    restore_recipe,
    save_answers,
)
from drafters.training.batches import revealed
from drafters.training.corpus import prompt_file
from drafters.training.losses import position_weights


def test_held_out_trained_and_unanswered_prompts_are_disjoint_and_cover_the_templated_ones():
    held, trained, fresh = recipe_split()
    assert held and trained and fresh
    assert not (set(held) & set(trained)) and not (set(held) & set(fresh)) and not (set(trained) & set(fresh))
    assert not set(held) & set(fine_tune_prompts())  # a fine-tune never sees a held-out prompt


def test_answers_round_trip_as_token_ids(tmp_path):
    rows = [{"ids": [5, 6, 7, 65535], "prompt_len": 2}, {"ids": [1, 2, 3], "prompt_len": 1}]
    save_answers(rows, tmp_path / "set", {"what": "test"})
    loaded = load_answers(tmp_path / "set")
    assert [(r["ids"], r["prompt_len"], r["source"]) for r in loaded] == [
        ([5, 6, 7, 65535], 2, "generated"),
        ([1, 2, 3], 1, "generated"),
    ]
    with pytest.raises(ValueError, match="uint16"):
        save_answers([{"ids": [70000], "prompt_len": 0}], tmp_path / "big", {})
    with pytest.raises(FileNotFoundError, match="answer_sets heldout"):
        load_answers(tmp_path / "missing")


def test_a_recipe_run_packs_and_restores_as_its_generate_stage_left_it(tmp_path):
    run, restored = tmp_path / "run", tmp_path / "restored"
    (run / RECIPE_FOLDER).mkdir(parents=True)
    rows = [{"ids": [i, i + 1, i + 2], "prompt_len": 1 + i % 2} for i in range(RECIPE_BATCH + 3)]  # two shards
    shards = [rows[:RECIPE_BATCH], rows[RECIPE_BATCH:]]
    for index, shard in enumerate(shards):
        (run / RECIPE_FOLDER / f"gen-{index:05d}.json").write_text(json.dumps(shard))
    (run / RECIPE_TURNS).write_text('["a sampled user turn"]')

    pack_recipe(run, tmp_path / "packed")
    restore_recipe(tmp_path / "packed", restored)
    written = sorted((restored / RECIPE_FOLDER).glob("gen-*.json"))
    assert [p.name for p in written] == ["gen-00000.json", "gen-00001.json"]
    assert [json.loads(p.read_text()) for p in written] == shards
    assert (restored / RECIPE_TURNS).read_text() == '["a sampled user turn"]'
    with pytest.raises(FileNotFoundError, match="gpu_train.sh"):
        pack_recipe(tmp_path / "empty", tmp_path / "nothing")


def test_a_prompt_file_names_its_bad_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"text": "b"}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:3"):
        prompt_file(path)
    path.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    assert prompt_file(path) == ["a", "b"]


def test_a_prefix_reveal_gives_a_leading_run_and_leaves_something_to_draft():
    rng = np.random.default_rng(0)
    valid = torch.ones(4, 50, 7, dtype=torch.bool)
    valid[0, :, 3:] = False  # an answer leaving the greedy chain: nothing past it is revealed
    known = revealed(rng, valid, 1.0, "prefix")
    run = known.int().cumprod(-1).sum(-1)
    assert torch.equal(run, known.sum(-1))  # a leading run, never a gap
    assert int(run.min()) >= 1 and int(run.max()) <= 6 and not known[0, :, 3:].any()
    assert len(set(run[1:].flatten().tolist())) == 6  # every length 1..6 occurs
    assert not revealed(rng, valid, 0.0, "prefix").any()
    with pytest.raises(ValueError, match="prefix, mixed"):
        revealed(rng, valid, 0.5, "random")


def test_position_weights_start_at_the_first_position_left_to_draft():
    assert torch.allclose(position_weights(5, 2.0), torch.exp(-torch.arange(4.0) / 2))
    weights = position_weights(5, 2.0, torch.tensor([0, 2]))
    assert torch.allclose(weights[1], torch.exp(-torch.tensor([0.0, 0.0, 0.0, 1.0]) / 2))
    assert torch.allclose(weights[0], position_weights(5, 2.0))


@pytest.mark.parametrize(
    "args, message",
    [
        (["prompts", "--out", "x"], "prompts needs --prompts FILE"),
        (
            ["prompts", "--out", "x", "--prompts", "bad.jsonl"],
            'bad.jsonl:1: each line must be a JSON object with a "prompt"',
        ),
        (["heldout", "--out", "x", "--prompts", "good.jsonl"], "--prompts is for the prompts set"),
    ],
)
def test_answering_a_prompt_file_refuses_bad_input_before_the_verifier_loads(
    args, message, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.jsonl").write_text('{"text": "no prompt"}\n')
    (tmp_path / "good.jsonl").write_text('{"prompt": "a"}\n')
    monkeypatch.setattr(answer_sets, "answer_prompts", lambda *a: pytest.fail("answered bad input"))
    monkeypatch.setattr(answer_sets, "answer_held_out", lambda *a: pytest.fail("answered bad input"))
    with pytest.raises(SystemExit) as exit_info:
        answer_sets.main(args + ["--work-dir", str(tmp_path / "work")])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
