"""The block-diffusion drafter: what it may see, that training and drafting compute the same thing,
persistence and its checks, and that its training pipeline runs and resumes exactly."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from strategies import random_block_drafter, tiny_model
from transformers import LogitsProcessorList

import hybrid
from drafters import BlockDiffusionDrafter, ChainDrafter, Draft, DraftContext, PromptLookupDrafter
from drafters.block_diffusion import CONFIG_NAME, CONTEXT, WEIGHTS_NAME, frozen_verifier_parts, load_model
from drafters.ngram_store import NgramStore
from drafters.training.batches import VocabMap, block_batch, block_targets
from drafters.training.distill import build_features
from drafters.training.estimate import accepted_lengths, greedy_block_drafts
from drafters.training.models import block_forward
from drafters.training.train import main as train_main
from drafters.training.train import parser, recipe_tag, train
from hybrid.testing import check_greedy_lossless
from schedulers import FixedScheduler
from verifiers.verifier import Verifier

VOCAB, BLOCK = 64, 6


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny verifier, a random drafter for it, and features of three of its greedy answers (as in training)."""
    verifier = tiny_model("llama", VOCAB, 2, seed=1)
    drafter = random_block_drafter(verifier, seed=0, block_size=BLOCK)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, VOCAB, (3, 4), generator=gen)
    answers = verifier.generate(prompts, max_new_tokens=26, do_sample=False)
    sequences = [{"ids": row.tolist(), "prompt_len": 4, "source": "generated"} for row in answers]
    root = tmp_path_factory.mktemp("features")
    store = build_features(verifier, sequences, root, drafter.hidden_layers, top_k=4, log=lambda *a: None)
    return verifier, drafter, store


def test_an_interrupted_feature_build_resumes_to_what_an_uninterrupted_one_writes(tmp_path):
    """Batches of one sequence each (batch_tokens 1), progress saved after every batch: a build stopped after its
    second batch resumes at the third, and its files equal a build that ran through."""
    verifier = tiny_model("llama", VOCAB, 2, seed=1)
    gen = torch.Generator().manual_seed(1)
    sequences = [
        {"ids": torch.randint(0, VOCAB, (n,), generator=gen).tolist(), "prompt_len": 2, "source": "generated"}
        for n in (9, 7, 12, 5)
    ]
    layers = (0, 1)

    def stop_after_two(line: str) -> None:
        if line.startswith("features: ") and int(line.split()[1].split("/")[0]) >= 5 + 7:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build_features(
            verifier, sequences, tmp_path / "a", layers, top_k=4, batch_tokens=1, log=stop_after_two, save_every=0
        )
    assert not (tmp_path / "a" / "meta.json").exists()
    lines = []
    build_features(verifier, sequences, tmp_path / "a", layers, top_k=4, batch_tokens=1, log=lines.append, save_every=0)
    assert lines[0] == "features: resumed at 12/33 tokens" and len(lines) == 3  # the two batches left
    build_features(verifier, sequences, tmp_path / "b", layers, top_k=4, batch_tokens=1, log=lambda *a: None)
    for name in ("ids.bin", "greedy.bin", "top_ids.bin", "top_probs.bin", "hidden.bin", "meta.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert not (tmp_path / "a" / "progress.json").exists()


def drafting_logits(verifier, drafter, ids: torch.Tensor, anchor: int, block=None, known=None) -> torch.Tensor:
    """What the drafter computes at draft time for `anchor`: the verifier has run ids[:anchor] only."""
    v = Verifier(verifier, hidden_layers=drafter.hidden_layers)
    v.prefill(ids[None, :anchor], None, capacity=64)
    ctx = DraftContext(ids[None, : anchor + 1], False, LogitsProcessorList(), None, v)
    drafter.reset(ctx)
    if block is None:
        block = torch.zeros(BLOCK, dtype=torch.long)
        block[0] = ids[anchor]
        known = torch.arange(BLOCK) == 0
    return drafter.block_logits(ctx, block, known)


def training_logits(drafter, verifier, store, anchors, rng=None, reveal_prob=0.0):
    vmap = VocabMap(drafter.model.draft_vocab, VOCAB)
    batch = block_batch(store, [0], rng, len(anchors), BLOCK, vmap, reveal_prob, anchors=[np.array(anchors)])
    embed, head = frozen_verifier_parts(verifier, drafter.model.draft_vocab)
    with torch.no_grad():
        return block_forward(drafter.model, embed, head, batch)[0], batch


def test_training_computes_what_drafting_computes(world):
    """Many anchors trained at once under the block mask give, per anchor, exactly the logits the drafter
    produces at draft time, when the verifier has states only up to the token before the anchor."""
    verifier, drafter, store = world
    ids = torch.tensor(store.sequence(0)["ids"], dtype=torch.long)
    anchors = [5, 12, 20, 27]
    trained, _ = training_logits(drafter, verifier, store, anchors)
    for j, a in enumerate(anchors):
        torch.testing.assert_close(drafting_logits(verifier, drafter, ids, a), trained[j], atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("arch", ["qwen3_5", "jamba"])
def test_a_verifier_with_state_layers_serves_the_states_the_drafter_trains_on(arch, tmp_path, one_thread):
    """A Qwen3.5 verifier (Gated DeltaNet, then full attention) or a Jamba one (Mamba, then attention): the block
    drafter built for its geometry reads at draft time the hidden states that training reads from a cacheless
    forward over the whole sequence, and decoding with it (after a lookup too) is lossless."""
    verifier = tiny_model(arch, VOCAB, 1, seed=1)
    drafter = random_block_drafter(verifier, seed=0, block_size=BLOCK)
    answers = verifier.generate(torch.tensor([[3, 9, 4, 1]]), max_new_tokens=26, do_sample=False)
    sequences = [{"ids": answers[0].tolist(), "prompt_len": 4, "source": "generated"}]
    store = build_features(verifier, sequences, tmp_path, drafter.hidden_layers, top_k=4, log=lambda *a: None)
    ids = torch.tensor(store.sequence(0)["ids"], dtype=torch.long)
    anchors = [5, 12, 20, 27]
    trained, _ = training_logits(drafter, verifier, store, anchors)
    for j, a in enumerate(anchors):
        torch.testing.assert_close(drafting_logits(verifier, drafter, ids, a), trained[j], atol=1e-3, rtol=1e-3)
    for each in (drafter, random_block_drafter(verifier, seed=1, block_size=BLOCK, steps=2, lookup_ngram=1)):
        report = check_greedy_lossless(
            verifier, torch.tensor([[5, 9, 5, 9, 3]]), each, FixedScheduler(each.node_budget), max_new_tokens=30
        )
        assert sum(report.stats.drafted) > 0


def test_a_block_never_sees_later_context_or_other_blocks(world):
    verifier, drafter, store = world
    vmap = VocabMap(drafter.model.draft_vocab, VOCAB)
    batch = block_batch(store, [0], None, 3, BLOCK, vmap, anchors=[np.array([6, 14, 22])])
    embed, head = frozen_verifier_parts(verifier, drafter.model.draft_vocab)
    with torch.no_grad():
        before = block_forward(drafter.model, embed, head, batch)
        batch["hidden"][0, 14:] += 5.0  # context at and after the second anchor
        batch["ids"][0, 14:] = (batch["ids"][0, 14:] + 1) % VOCAB
        batch["tokens"][0, 2] = (batch["tokens"][0, 2] + 1) % VOCAB  # the third block's tokens
        after = block_forward(drafter.model, embed, head, batch)
    torch.testing.assert_close(before[0, 0], after[0, 0])  # anchor 6: sees rows < 6 and its own block
    torch.testing.assert_close(before[0, 1], after[0, 1])  # anchor 14: rows >= 14 and block 3 are invisible to it
    assert not torch.allclose(before[0, 2], after[0, 2])  # anchor 22: its context and its tokens changed


def test_context_rows_follow_a_rollback(world):
    """The drafter's projected context is a side buffer of the verifier's shared cache: a rollback cuts it back
    with the verifier's rows, so after continuing differently the drafter recomputes exactly the rows whose
    tokens changed and computes what a fresh verifier and drafter compute."""
    verifier, drafter, store = world
    ids = torch.tensor(store.sequence(1)["ids"], dtype=torch.long)
    other = ids.clone()
    other[15:] = (other[15:] + 7) % VOCAB

    def block_for(seq, anchor):
        block = torch.zeros(BLOCK, dtype=torch.long)
        block[0] = seq[anchor]
        return block, torch.arange(BLOCK) == 0

    v = Verifier(verifier, hidden_layers=drafter.hidden_layers)
    v.prefill(ids[None, :24], None, capacity=64)
    drafter.block_logits(DraftContext(ids[None, :25], False, LogitsProcessorList(), None, v), *block_for(ids, 24))
    assert v.cache.side_lengths[CONTEXT] == [24]
    v.rollback(24 - 15)  # back to ids[:15], which other shares
    assert v.cache.side_lengths[CONTEXT] == [15]
    v.verify(other[None, 15:22])
    ctx = DraftContext(other[None, :23], False, LogitsProcessorList(), None, v)
    reused = drafter.block_logits(ctx, *block_for(other, 22))
    assert v.cache.side_lengths[CONTEXT] == [22]
    torch.testing.assert_close(reused, drafting_logits(verifier, drafter, other, 22))


@pytest.mark.parametrize("static,passes", [(False, 1), (True, 1), (False, 3), (True, 3)])
def test_rows_drafted_together_equal_rows_drafted_alone(world, static, passes):
    """propose_rows runs one forward of the block model for all rows of a batch, one per denoising pass (contexts of
    different lengths, masked per row; on the static path every slot, masked): the same logits, drafts and
    confidences as proposing row by row on the dynamic path, where a row's context is exactly its own slots."""
    verifier, _, store = world
    drafter = BlockDiffusionDrafter(world[1].model, verifier, steps=passes, threshold=1.0)  # a pass fixes one position
    seqs = [torch.tensor(store.sequence(i)["ids"], dtype=torch.long)[:n] for i, n in ((0, 20), (1, 9), (2, 14))]

    def contexts(static):
        v = Verifier(verifier, hidden_layers=drafter.hidden_layers, static=static, max_width=BLOCK)
        v.prefill_rows([seq[:-1] for seq in seqs], capacity=64)
        return [DraftContext(seq[None], False, LogitsProcessorList(), None, v, row=r) for r, seq in enumerate(seqs)]

    ctxs, reference = contexts(static), contexts(static=False)
    together = drafter.propose_rows([drafter] * 3, ctxs, [5, 3, 5])
    alone = [drafter.propose(ctx, k) for ctx, k in zip(reference, [5, 3, 5])]
    assert [len(d) for d in together] == [5, 3, 5]
    for a, b in zip(together, alone):
        assert torch.equal(a.tokens, b.tokens)
        torch.testing.assert_close(a.confidence, b.confidence)
    blocks = torch.stack([torch.cat([seq[-1:], torch.zeros(BLOCK - 1, dtype=torch.long)]) for seq in seqs])
    knowns = (torch.arange(BLOCK) == 0).expand(3, -1)
    torch.testing.assert_close(
        drafter.block_logits_rows(ctxs, blocks, knowns),
        torch.stack([drafter.block_logits(c, b, k) for c, b, k in zip(reference, blocks, knowns)]),
    )


def test_known_positions_condition_the_block_as_in_training(world):
    """A block with some positions given (a later denoising pass, a lookup prefix) computes the same in both paths."""
    verifier, drafter, store = world
    ids = torch.tensor(store.sequence(0)["ids"], dtype=torch.long)
    _, batch = training_logits(drafter, verifier, store, [9])
    batch["known"][0, 0, 1:3] = True
    batch["tokens"][0, 0, 1:3] = torch.tensor([7, 11])
    embed, head = frozen_verifier_parts(verifier, drafter.model.draft_vocab)
    with torch.no_grad():
        trained = block_forward(drafter.model, embed, head, batch)[0]
    block, known = batch["tokens"][0, 0], batch["known"][0, 0]
    torch.testing.assert_close(
        drafting_logits(verifier, drafter, ids, 9, block, known), trained[0], atol=1e-3, rtol=1e-3
    )


def test_a_masked_position_reads_the_anchor_at_its_block_index(world):
    _, drafter, _ = world
    model = drafter.model
    embeds = torch.randn(BLOCK, model.config.hidden_size)
    last = torch.randn(model.config.hidden_size)
    known = torch.tensor([True, True, True, False, True, False])
    with torch.no_grad():
        inputs = model.block_inputs(embeds, known, last)
        gate = model.feature_gate * last  # the fused feature of the token before the anchor, in every position
        torch.testing.assert_close(inputs[3], model.mask_embedding[3] + embeds[0] + gate)
        torch.testing.assert_close(inputs[5], model.mask_embedding[5] + embeds[0] + gate)
        torch.testing.assert_close(inputs[2], embeds[2] + gate)  # a known position is its own token


def test_a_masked_position_reads_the_nearest_known_token_to_its_left(world):
    """With masked_input "nearest_known", position j + 1 after known positions ..j reads x_j as position 1 reads the
    anchor: mask embedding (i - j) plus x_j's embedding; with the anchor alone known it equals "anchor" mode."""
    verifier, _, _ = world
    anchor_mode = random_block_drafter(verifier, seed=0, block_size=BLOCK).model
    model = random_block_drafter(verifier, seed=0, block_size=BLOCK, masked_input="nearest_known").model
    embeds = torch.randn(BLOCK, model.config.hidden_size)
    last = torch.randn(model.config.hidden_size)
    known = torch.tensor([True, True, True, False, True, False])
    with torch.no_grad():
        inputs = model.block_inputs(embeds, known, last)
        gate = model.feature_gate * last
        torch.testing.assert_close(inputs[3], model.mask_embedding[1] + embeds[2] + gate)
        torch.testing.assert_close(inputs[5], model.mask_embedding[1] + embeds[4] + gate)
        torch.testing.assert_close(inputs[2], embeds[2] + gate)
        only_anchor = torch.arange(BLOCK) == 0
        blocks = torch.randn(3, BLOCK, model.config.hidden_size)  # and batched blocks read within their own block
        torch.testing.assert_close(
            model.block_inputs(embeds, only_anchor, last), anchor_mode.block_inputs(embeds, only_anchor, last)
        )
        torch.testing.assert_close(
            model.block_inputs(blocks, known.expand(3, -1), last)[1], model.block_inputs(blocks[1], known, last)
        )


def test_block_targets_are_exact_only_along_the_greedy_chain():
    ids = np.array([0, 1, 2, 3, 9, 5, 6])
    greedy = np.array([1, 2, 3, 4, 5, 6, 7])  # the text leaves the chain at position 4 (9 != 4)
    full, valid, _ = block_targets({"ids": ids, "greedy": greedy}, np.array([1]), 5)
    assert full[0].tolist() == [2, 3, 4, 5]
    assert valid[0].tolist() == [True, True, True, False]  # position 4's target follows the off-chain 9
    assert accepted_lengths(torch.tensor([[2, 3, 0, 5]]), torch.tensor(full), torch.tensor(valid)).tolist() == [2]


def test_accepted_lengths_count_along_the_block_of_each_anchor():
    # [sequences, anchors, block positions]: the count runs along each anchor's block, never across anchors.
    targets = torch.tensor([[[5, 6, 7], [1, 2, 3]], [[4, 4, 4], [8, 9, 9]]])
    predicted = torch.tensor([[[5, 6, 0], [0, 2, 3]], [[4, 4, 4], [8, 0, 9]]])
    valid = torch.ones_like(targets, dtype=torch.bool)
    valid[1, 0, 2] = False  # an exact target ends the chain: no acceptance past it
    assert accepted_lengths(predicted, targets, valid).tolist() == [[2, 0], [2, 1]]


def test_save_load_round_trip_and_checks(world, tmp_path):
    verifier, drafter, _ = world
    drafter.save_pretrained(tmp_path / "ckpt")
    loaded = BlockDiffusionDrafter.from_pretrained(tmp_path / "ckpt", verifier)
    for (name, a), (_, b) in zip(drafter.model.state_dict().items(), loaded.model.state_dict().items()):
        assert torch.equal(a, b), name
    assert loaded.model.config == drafter.model.config
    # Another verifier (same shapes, other weights): refused, naming what differs.
    with pytest.raises(ValueError, match="embedding_sha256"):
        BlockDiffusionDrafter.from_pretrained(tmp_path / "ckpt", tiny_model("llama", VOCAB, 2, seed=2))
    with pytest.raises(ValueError, match="vocab_size 64 != 80"):
        BlockDiffusionDrafter.from_pretrained(tmp_path / "ckpt", tiny_model("llama", 80, 2, seed=1))
    with pytest.raises(ValueError, match="block_size 9 outside 2..6"):
        BlockDiffusionDrafter.from_pretrained(tmp_path / "ckpt", verifier, block_size=9)
    broken = tmp_path / "broken"
    shutil.copytree(tmp_path / "ckpt", broken)
    (broken / WEIGHTS_NAME).write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="corrupt"):
        load_model(broken)
    (broken / CONFIG_NAME).unlink()
    with pytest.raises(FileNotFoundError, match=CONFIG_NAME):
        load_model(broken)


@pytest.mark.parametrize("steps,lookup,lookup_tokens", [(1, 0, None), (3, 0, None), (2, 2, None), (1, 1, 15)])
def test_engine_with_block_drafter_matches_generate(steps, lookup, lookup_tokens):
    verifier = tiny_model("qwen2", VOCAB, 2, seed=7)
    drafter = random_block_drafter(
        verifier,
        seed=1,
        draft_vocab_size=40,
        block_size=8,
        steps=steps,
        threshold=0.2,
        lookup_ngram=lookup,
        lookup_tokens=lookup_tokens,
    )
    # Every step verifies the whole block: whether drafting pays on a tiny model is the cost model's call, not this test's.
    report = check_greedy_lossless(
        verifier, torch.tensor([[5, 9, 5, 9, 3]]), drafter, FixedScheduler(7), max_new_tokens=40
    )
    assert sum(report.stats.drafted) > 0


def test_a_lookup_match_longer_than_the_block_is_proposed_whole(world):
    verifier, _, _ = world
    ids = torch.tensor(
        [7, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 7]
    )  # the last token, 7, was seen before: 1, 2, ... followed it
    v = Verifier(verifier, hidden_layers=(1,))
    v.prefill(ids[None, :-1], None, capacity=64)
    ctx = DraftContext(ids[None], False, LogitsProcessorList(), None, v)
    long = random_block_drafter(verifier, seed=0, block_size=4, lookup_ngram=1, lookup_tokens=9)
    short = random_block_drafter(verifier, seed=0, block_size=4, lookup_ngram=1)
    assert long.max_draft_len == 9 and short.max_draft_len == 3
    assert long.propose(ctx, 9).tokens.tolist() == [1, 2, 3, 4, 5, 6, 8, 9, 10]
    assert long.propose(ctx, 5).tokens.tolist() == [1, 2, 3, 4, 5]  # the scheduler's k still caps it
    assert short.propose(ctx, 9).tokens.tolist() == [1, 2, 3]


def test_the_block_model_fills_in_what_the_lookup_leaves():
    """In the chain, a lookup shorter than the block gives the first positions and the model the rest, exactly as
    the model drafts a block with those positions known; one as long as the block leaves the model nothing to do."""
    verifier = tiny_model("llama", VOCAB, 1, seed=4)
    block = random_block_drafter(verifier, seed=0, block_size=6)
    chain = ChainDrafter([PromptLookupDrafter(max_ngram=3, max_draft_len=5), block])
    ids = torch.tensor([5, 3, 4, 8, 9, 3, 4])  # "3, 4" was followed by 8, 9, 3, 4: a 2-token match (confidence 2/3)
    v = Verifier(verifier, hidden_layers=block.hidden_layers)
    v.prefill(ids[None, :-1], None, capacity=64)
    ctx = DraftContext(ids[None], False, LogitsProcessorList(), None, v)
    assert chain.max_draft_len == 5 and chain.hidden_layers == block.hidden_layers
    given = Draft(torch.tensor([8, 9]), confidence=torch.tensor([2 / 3, 2 / 3]))
    block_tokens = torch.cat([ids[-1:], given.tokens, torch.zeros(3, dtype=torch.long)])
    logits = block.block_logits(ctx, block_tokens, torch.arange(BLOCK) < 3)
    draft = chain.propose(ctx, 2)  # the lookup reaches as far as asked: the model adds nothing
    assert draft.tokens.tolist() == [8, 9]
    draft = chain.propose(ctx, 5)  # asked for more: the lookup gives 4 (8, 9, 3, 4), the model the fifth
    assert draft.tokens[:4].tolist() == [8, 9, 3, 4] and len(draft) == 5
    assert draft.confidence[:4].tolist() == pytest.approx([2 / 3] * 4)
    filled = block.fill(ctx, given, 5)  # the model alone, given two
    assert filled.tokens[:2].tolist() == [8, 9]
    assert filled.tokens[2:].tolist() == block.model.draft_vocab[logits[2:].argmax(-1)].tolist()
    with pytest.raises(ValueError, match="different vocabularies"):
        ChainDrafter([PromptLookupDrafter(ngram_store=NgramStore.build([([1, 2], 0)], VOCAB + 1), min_ngram=0), block])
    with pytest.raises(TypeError, match="list of drafters.Drafter"):
        ChainDrafter([block, "lookup"])


def test_the_block_model_branches_off_the_lookup_with_its_own_guess():
    """With branch k, the block model's own first k tokens (drafted from the committed sequence alone) join the
    lookup's draft as a second path from where they leave it, best first and within the nodes asked for; under the
    rejection rule, which verifies chains, there is no branch."""
    verifier = tiny_model("llama", VOCAB, 1, seed=4)
    block = random_block_drafter(verifier, seed=0, block_size=6)
    lookup = PromptLookupDrafter(max_ngram=3, max_draft_len=5)
    ids = torch.tensor([5, 3, 4, 8, 9, 3, 4])  # the lookup drafts 8, 9, 3, 4 (confidence 2/3 each)
    v = Verifier(verifier, hidden_layers=block.hidden_layers)
    v.prefill(ids[None, :-1], None, capacity=64)
    ctx = DraftContext(ids[None], False, LogitsProcessorList(), None, v)
    own = block.propose(ctx, 2)
    assert own.tokens[0] != 8, "the random block model must disagree with the lookup for this test to mean much"
    chain = ChainDrafter([lookup, block], branch=2)
    assert chain.max_nodes == 5 and chain.fingerprint.endswith("| branch 2")
    draft = chain.propose(ctx, 8)
    paths = {tuple(draft.tokens[node].item() for node in path_to(draft, leaf)) for leaf in range(len(draft))}
    assert (8, 9, 3, 4) in paths and tuple(own.tokens.tolist()) in paths
    assert sorted(draft.stage_list()) == [0, 0, 0, 0, 1, 1, 1]  # the lookup's 4, the fill's 1, the branch's 2
    assert len(chain.propose(ctx, 3)) == 3  # cut to the nodes asked for
    sampled = DraftContext(ids[None], True, LogitsProcessorList(), torch.Generator().manual_seed(0), v)
    assert chain.propose(sampled, 8).is_chain
    with pytest.raises(ValueError, match="branch must be an int >= 0"):
        ChainDrafter([lookup, block], branch=-1)
    with pytest.raises(ValueError, match="needs two sources or more"):
        ChainDrafter([block], branch=2)


def path_to(draft: Draft, node: int) -> list[int]:
    parents, path = draft.parent_list(), []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


@pytest.mark.parametrize("chosen", [1, 2, 3])
def test_the_scheduler_chooses_the_denoising_passes(chosen):
    verifier = tiny_model("llama", VOCAB, 1, seed=2)
    drafter = random_block_drafter(verifier, seed=1, block_size=6, steps=3, threshold=1.0)  # never fixes a run early
    passes = []
    drafter.model.register_forward_hook(lambda *args: passes.append(1))  # one forward of the block model a pass
    _, stats = hybrid.generate(
        verifier,
        torch.tensor([[3, 4, 5]]),
        drafter=drafter,
        max_new_tokens=12,
        do_sample=False,
        scheduler=FixedScheduler(5, steps=chosen),
        return_stats=True,
    )
    drafting_steps = sum(1 for k in stats.drafted[1:] if k)
    assert drafting_steps and len(passes) == chosen * drafting_steps
    assert len(stats.passes) == len(stats.drafted) - 1 and set(stats.passes) == {chosen}  # the stats say so too
    assert stats.mean_passes == chosen


def test_a_run_with_another_step_plan_is_another_run():
    """The step plan sets the learning-rate schedule: a rerun resumes its own run, never one of another length."""
    tag = lambda *argv: recipe_tag(parser().parse_args(list(argv)))  # noqa: E731
    assert tag("--steps", "300") == tag("--steps", "300")
    assert len({tag("--steps", "300"), tag("--steps", "1800"), tag("--minutes", "10"), tag("--minutes", "20")}) == 4


@pytest.mark.parametrize("arch", ["block", "ar"])
def test_training_runs_and_resumes_exactly(world, tmp_path, arch):
    """A few steps on a tiny verifier; 2 steps + resume to 4 gives the very weights of 4 steps in one go."""
    verifier, _, store = world
    args = lambda steps: parser().parse_args(  # noqa: E731
        [
            "--arch",
            arch,
            "--steps",
            str(steps),
            "--seqs-per-step",
            "2",
            "--anchors-per-seq",
            "4",
            "--block-size",
            str(BLOCK),
            "--draft-vocab",
            "48",
            "--save-every",
            "1",
            "--eval-every",
            "2",
        ]
    )
    straight = train(args(4), verifier, store, tmp_path / "a-out", tmp_path / "a-run")
    train(args(2), verifier, store, tmp_path / "b-out", tmp_path / "b-run")
    resumed = train(args(4), verifier, store, tmp_path / "b-out", tmp_path / "b-run")
    assert straight["steps"] == resumed["steps"] == 4 and np.isfinite(straight["tau"])
    a = torch.load(tmp_path / "a-run" / "checkpoint.pt", weights_only=False)["model"]
    b = torch.load(tmp_path / "b-run" / "checkpoint.pt", weights_only=False)["model"]
    for name in a:
        torch.testing.assert_close(a[name], b[name], msg=name)
    if arch == "block":  # the exported drafter loads for its verifier
        BlockDiffusionDrafter.from_pretrained(tmp_path / "a-out", verifier)


def test_training_can_start_from_a_checkpoint(world, tmp_path):
    verifier, drafter, store = world
    drafter.save_pretrained(tmp_path / "base")
    args = parser().parse_args(
        [
            "--init-from",
            str(tmp_path / "base"),
            "--steps",
            "1",
            "--seqs-per-step",
            "2",
            "--anchors-per-seq",
            "4",
            "--eval-every",
            "1",
            "--lr",
            "0",
            "--masked-input",
            "nearest_known",
            "--reveal-prob",
            "0.5",
        ]
    )
    train(args, verifier, store, tmp_path / "out", tmp_path / "run")
    tuned = BlockDiffusionDrafter.from_pretrained(tmp_path / "out", verifier)
    assert tuned.model.config.block_size == BLOCK
    assert tuned.model.config.masked_input == "nearest_known"  # what masked positions read may change; weights stay
    # lr 0: the weights are the checkpoint's (saved in bfloat16), the draft vocabulary and feature statistics too.
    for (name, a), (_, b) in zip(drafter.model.state_dict().items(), tuned.model.state_dict().items()):
        torch.testing.assert_close(a.to(torch.bfloat16).to(a.dtype), b, msg=name)
    with pytest.raises(SystemExit):  # the AR baseline has no block checkpoint to start from
        train_main(["--arch", "ar", "--init-from", str(tmp_path / "base")])


def test_a_fine_tune_told_to_keep_its_start_stays_closer_to_it_on_blocks_given_nothing(world, tmp_path):
    """--keep-weight: where a block is given no token, the fine-tune also matches the checkpoint it started from."""
    verifier, drafter, store = world
    drafter.save_pretrained(tmp_path / "base")
    start = BlockDiffusionDrafter.from_pretrained(tmp_path / "base", verifier)

    def fine_tune(keep_weight: str) -> BlockDiffusionDrafter:
        argv = ["--init-from", str(tmp_path / "base"), "--steps", "24", "--seqs-per-step", "2", "--anchors-per-seq"]
        argv += ["6", "--eval-every", "24", "--lr", "3e-2", "--reveal-prob", "0.5", "--keep-weight", keep_weight]
        out = tmp_path / f"out-{keep_weight}"
        train(parser().parse_args(argv), verifier, store, out, tmp_path / f"run-{keep_weight}")
        return BlockDiffusionDrafter.from_pretrained(out, verifier)

    def drift(tuned) -> float:  # KL(start || tuned) on blocks given nothing
        start_logits, _ = training_logits(start, verifier, store, [5, 12, 20])
        tuned_logits, _ = training_logits(tuned, verifier, store, [5, 12, 20])
        logp, logq = start_logits.log_softmax(-1), tuned_logits.log_softmax(-1)
        return float((logp.exp() * (logp - logq)).sum(-1).mean())

    assert drift(fine_tune("20")) < 0.5 * drift(fine_tune("0"))  # here about 0.2 against 1.7
    with pytest.raises(SystemExit):  # it keeps a starting checkpoint: there must be one
        train_main(["--keep-weight", "1"])


@pytest.mark.parametrize("passes", [1, 3, BLOCK])
def test_the_held_out_estimate_scores_what_the_drafter_proposes(world, passes):
    """The estimate of the training logs and experiments.heldout drafts, anchor by anchor, exactly the tokens the
    drafter proposes at draft time with one more leading position fixed per pass (threshold 1)."""
    verifier, _, store = world
    drafter = random_block_drafter(verifier, seed=3, block_size=BLOCK, steps=passes, threshold=1.0)
    with torch.no_grad():  # what attention carries made loud: a random block model's fixed positions then matter
        for layer in drafter.model.layers:
            layer.v_proj.weight.mul_(10)
            layer.o_proj.weight.mul_(3)
    ids = torch.tensor(store.sequence(0)["ids"], dtype=torch.long)
    anchors = [5, 12, 20, 27]
    _, batch = training_logits(drafter, verifier, store, anchors)
    embed, head = frozen_verifier_parts(verifier, drafter.model.draft_vocab)
    with torch.no_grad():
        drafted = greedy_block_drafts(drafter.model, embed, head, drafter.model.draft_vocab, batch, passes)[0]
    for j, a in enumerate(anchors):
        v = Verifier(verifier, hidden_layers=drafter.hidden_layers)
        v.prefill(ids[None, :a], None, capacity=64)
        ctx = DraftContext(ids[None, : a + 1], False, LogitsProcessorList(), None, v)
        drafter.reset(ctx)
        assert drafter.propose(ctx, BLOCK - 1).tokens.tolist() == drafted[j].tolist()
    if passes > 1:  # the passes matter: one pass drafts otherwise
        with torch.no_grad():
            one_pass = greedy_block_drafts(drafter.model, embed, head, drafter.model.draft_vocab, batch, 1)[0]
        assert not torch.equal(one_pass, drafted)
