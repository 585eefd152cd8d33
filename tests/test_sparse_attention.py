"""Sparse, compressed and chunked attention (DeepSeek-V3.2 and GLM-5's indexed attention, DeepSeek-V4's compressed
attention, Llama 4's chunked attention) decode with drafts exactly as `generate` does."""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import CompileConfig

import hybrid
from drafters import ModelDrafter, PromptLookupDrafter
from drafters.dflash import DFlashDrafter
from hybrid.testing import (
    ARCHITECTURES,
    check_batch_greedy_lossless,
    check_cache_matches_prefill,
    check_greedy_lossless,
    check_sampled_identical,
    tiny_model,
)
from schedulers import FixedScheduler
from tests.strategies import random_block_drafter
from tests.test_dflash import write_dflash_folder
from tests.test_state_layers import ScriptedDrafter
from verifiers import verifier as verifier_module
from verifiers.indexed import PromptLayout, select_as_generate
from verifiers.verifier import Verifier

VOCAB = 64
INDEXED = ("deepseek_v32", "glm_moe_dsa")
KINDS = (*INDEXED, "llama4", "deepseek_v4")
ROW_MASKED = (*INDEXED, "llama4")  # the kinds that take per-row masks: batches, trees, the static layout


def depth_check(model, seed: int, static: bool = False):
    prompt = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(seed))
    reference = model.generate(prompt, max_new_tokens=40, do_sample=False)
    return check_greedy_lossless(
        model,
        prompt,
        ScriptedDrafter(reference, depths=[0, 1, 2, 3, 4, 5, 6]),
        scheduler=FixedScheduler(6),
        max_new_tokens=40,
        hybrid_kwargs={"cache_implementation": "static" if static else None},
    )


@pytest.mark.parametrize("arch", KINDS)
@pytest.mark.parametrize("static", [False, True])
def test_every_acceptance_depth_equals_generate(arch, static, one_thread):
    """Verifies of up to 7 tokens, accepted to every depth, cross chunk boundaries, close compressed windows and
    choose among more tokens than the indexer keeps."""
    if static and arch not in ROW_MASKED:
        pytest.skip("one row per forward: no static layout")
    for seed in range(2):
        report = depth_check(tiny_model(arch, VOCAB, 2, seed=seed), seed, static)
        assert report.stats.tau > 2


@pytest.mark.parametrize("arch", ["deepseek_v32", "glm_moe_dsa"])
def test_the_indexer_breaks_ties_as_generate_steps_do(arch, monkeypatch, one_thread):
    """The indexer's ReLU scores tie at 0; a verify's top-k over rows with other queries' slots would break the ties
    otherwise. The same checks fail when each query does not choose over generate's row."""
    for seed in range(3):
        depth_check(tiny_model(arch, VOCAB, 2, seed=seed), seed)
    monkeypatch.setattr(verifier_module, "choosing_as_generate", lambda *args: contextlib.nullcontext())
    failures = 0
    for seed in range(3):
        try:
            depth_check(tiny_model(arch, VOCAB, 2, seed=seed), seed)
        except AssertionError:
            failures += 1
    assert failures > 0


def test_a_query_chooses_over_the_row_generate_gives_it():
    """Rows of a padded batch with a hole: a prefill query's row is the padded prompt, masked past it; a step's the
    sequence up to it. Ties at 0 go as `torch.topk` takes them over exactly that row."""
    masks = [torch.tensor([0, 0, 1, 1, 0, 1]), None]
    layout = PromptLayout.of(masks, [3, 6])
    positions = torch.tensor([[1, 3, 4], [5, 6, 7]])  # row 0: a prompt token, then two steps; row 1: the last prompt
    scores = torch.zeros(2, 3, 8)
    scores[:, :, 1::3] = 1.0
    chosen = select_as_generate(scores, 2, lambda b, i: _row(layout, positions, b, i))
    for b in range(2):
        for i in range(3):
            real, seen = layout.sequence(b, int(positions[b, i]))
            row = torch.full(real.shape, float("-inf"))
            row[seen] = scores[b, i, real[seen]]
            expected = real[row.topk(2).indices]
            assert set(chosen[b, i].tolist()) == set(expected[expected >= 0].tolist())


def _row(layout, positions, b, i):
    real, seen = layout.sequence(b, int(positions[b, i]))
    return torch.where(seen, real, -1)


@pytest.mark.parametrize("arch", ROW_MASKED)
def test_a_left_padded_batch_with_a_hole_equals_generate(arch, one_thread):
    model = tiny_model(arch, VOCAB, 2, seed=2)
    rows = torch.randint(1, VOCAB, (3, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(rows)
    mask[0, :4], mask[2, :2], mask[1, 5] = 0, 0, 0
    rows[mask == 0] = 0
    check_batch_greedy_lossless(
        model, rows, PromptLookupDrafter(), attention_mask=mask, max_new_tokens=24, pad_token_id=0
    )


def test_deepseek_v4_verifies_one_row_per_forward_and_refuses_padding(one_thread):
    model = tiny_model("deepseek_v4", VOCAB, 2, seed=3)
    verifier = Verifier(model, max_width=4)
    assert not verifier.batches and not verifier.takes_trees
    assert "compressors count the windows" in verifier.row_mask_problem
    rows = torch.tensor([[0, 0, 5, 6, 7], [3, 4, 5, 6, 7]])
    mask = (rows > 0).long()
    with pytest.raises(ValueError, match="depends on its padding"):
        hybrid.generate(model, rows, attention_mask=mask, drafter=PromptLookupDrafter(), max_new_tokens=4)


def test_llama4s_position_temperature_is_served_to_one_row_and_refused_to_a_batch_it_would_reach(one_thread):
    """Llama 4 scales its full-attention queries by position from `floor_scale` on, counted over a batch's padding
    by `generate`: one row is served past the first step; a batch whose positions reach it is refused by name."""
    config, model_class = ARCHITECTURES["llama4"](VOCAB, 2, None)
    config.floor_scale, config.attn_scale = 16, 3.0
    config.initializer_range = 0.3
    torch.manual_seed(4)
    model = model_class(config).eval()
    report = depth_check(model, 4)
    assert report.stats.tau > 2
    rows = torch.tensor([[0, 0, 5, 6, 7], [3, 4, 5, 6, 7]])
    with pytest.raises(ValueError, match=r"scales its queries by position past 15 tokens"):
        hybrid.generate(model, rows, attention_mask=(rows > 0).long(), drafter=None, max_new_tokens=20)


@pytest.mark.parametrize("arch", KINDS)
def test_seeded_sampling_equals_generate(arch, one_thread):
    model = tiny_model(arch, VOCAB, 2, seed=5)
    prompt = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6, 7, 5]])
    check_sampled_identical(model, prompt, PromptLookupDrafter(), 0, max_new_tokens=24)


@pytest.mark.parametrize("arch", KINDS)
def test_the_returned_cache_continues_with_generate(arch, one_thread):
    """The indexer's keys and the compressors' buffers, entries and halves leave in transformers' own cache."""
    model = tiny_model(arch, VOCAB, 2, seed=6)
    prompt = torch.tensor([[9, 8, 7, 9, 8, 7, 9, 8, 7, 9, 8]])
    out = hybrid.generate(
        model, prompt, drafter=PromptLookupDrafter(), max_new_tokens=14, do_sample=False, return_dict_in_generate=True
    )
    check_cache_matches_prefill(model, out.sequences, out.cache, prompt_length=prompt.shape[1])
    onward = model.generate(out.sequences, cache=out.cache, max_new_tokens=6, do_sample=False)
    assert torch.equal(onward, model.generate(prompt, max_new_tokens=20, do_sample=False))


@pytest.mark.parametrize("arch", KINDS)
def test_drafters_read_these_verifiers(arch, tmp_path, one_thread):
    """A model drafter of the same kind, the block drafter and a DFlash drafter in the published format, each
    reading the verifier's hidden states or cache, decode as `generate`."""
    verifier = tiny_model(arch, VOCAB, 2, seed=7)
    prompt = torch.tensor([[5, 9, 5, 9, 3, 5, 9, 5, 9]])
    drafters = [
        ModelDrafter(tiny_model(arch, VOCAB, 2, seed=8), max_draft_len=4),
        random_block_drafter(verifier, seed=0, block_size=4),
        DFlashDrafter.from_pretrained(write_dflash_folder(tmp_path / "dflash", verifier, block_size=4), verifier),
    ]
    for drafter in drafters:
        budget = getattr(drafter, "node_budget", 4)
        report = check_greedy_lossless(verifier, prompt, drafter, FixedScheduler(budget), max_new_tokens=24)
        assert sum(report.stats.drafted) > 0


def test_a_compiled_static_step_with_an_indexer_is_refused_by_name():
    with pytest.raises(ValueError, match=r"indexers choose each query's tokens.*disable_compile=True"):
        Verifier(tiny_model("deepseek_v32", VOCAB, 2, seed=9), static=True, max_width=4, compile_config=CompileConfig())
