"""The shared cache: rollback is exact, rows share forwards and leave them when done, bad caches are refused."""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import BATCHES_UNLIKE_ROWS_ALONE, padded_batches, tiny_model, verifiers
from transformers import DynamicCache

import hybrid
import verifiers.memory as memory_module
import verifiers.support as support_module
from drafters import PromptLookupDrafter
from verifiers import Verifier
from verifiers.cache import SharedCache
from verifiers.cost_table import verify_cost_table
from verifiers.memory import CacheMemoryError
from verifiers.support import keeps_states, row_mask_problem
from verifiers.verifier import main_stream

PROPERTY = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(data=st.data())
def test_rollback_leaves_every_row_equal_to_a_fresh_prefill(data):
    """Random verifies of uneven width and random per-row rollbacks: each row's keys, values and hidden
    states then equal a fresh forward over that row's committed tokens, and so do its next logits."""
    model = data.draw(verifiers(fresh_forward_reference=True), label="verifier")
    vocab = model.config.vocab_size
    token = st.integers(0, vocab - 1)
    per_row_masks = row_mask_problem(model) is None  # else one row per forward, and no static layout
    batches = per_row_masks and model.config.model_type not in BATCHES_UNLIKE_ROWS_ALONE
    rows = [
        torch.tensor(data.draw(st.lists(token, min_size=1, max_size=8), label="prompt"))
        for _ in range(data.draw(st.integers(1, 3 if batches else 1), label="rows"))
    ]
    # static: every slot read through the mask, verifies padded
    static = per_row_masks and not keeps_states(model) and data.draw(st.booleans(), label="static")
    verifier = Verifier(model, hidden_layers=(0, -1), static=static, max_width=5)
    verifier.prefill_rows(rows, capacity=4)  # small on purpose: the dynamic cache must grow
    committed = [row.clone() for row in rows]
    for _ in range(data.draw(st.integers(1, 4), label="steps")):
        width = data.draw(st.integers(1, 5), label="fed")
        fed = torch.tensor([data.draw(st.lists(token, min_size=width, max_size=width)) for _ in rows])
        verifier.verify_rows(fed)
        keep = [data.draw(st.integers(1, width), label="kept") for _ in rows]
        verifier.rollback_rows([width - k for k in keep])
        committed = [torch.cat([c, f[:k]]) for c, f, k in zip(committed, fed, keep)]

    probe = torch.tensor([[data.draw(token)] for _ in rows])
    logits = verifier.verify_rows(probe)[:, -1]
    for b, seq in enumerate(committed):
        # No config: every attention layer keeps all its tokens, as the shared cache does; state layers need theirs
        fresh = DynamicCache(config=model.config) if keeps_states(model) else DynamicCache()
        with torch.inference_mode():
            out = model(torch.cat([seq, probe[b]])[None], cache=fresh, use_cache=True, output_hidden_states=True)
        n = seq.shape[0]
        for i, layer in enumerate(verifier.cache.layers):
            # A layer that stores nothing (KV sharing: it reads another layer's), or states only (the logits tell)
            if not layer.is_initialized or not hasattr(layer, "keys"):
                continue
            for name in ("keys", "values"):
                mine, theirs = getattr(layer, name)[b, :, :n], getattr(fresh.layers[i], name)[0, :, :n]
                torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4, msg=f"row {b} layer {i} {name}")
        states = torch.cat([main_stream(out.hidden_states[0]), main_stream(out.hidden_states[-1])], dim=-1)[0, :n]
        torch.testing.assert_close(verifier.hidden_states(b)[0, :n], states, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(logits[b], out.logits[0, -1].float(), atol=1e-4, rtol=1e-4)


def test_side_buffers_roll_back_leave_and_grow_with_the_rows():
    """A side buffer's valid length per row is cut back by a rollback, follows the rows a batch keeps and survives
    growth with its contents, as the keys/values do; the kept hidden states are one, valid for every cached token."""
    verifier = Verifier(tiny_model("llama", 48, 1, seed=0), hidden_layers=(1,))
    verifier.prefill_rows([torch.tensor([1, 2, 3]), torch.tensor([4, 5])], capacity=4)
    cache = verifier.cache
    buffer = cache.side_buffer("state", (2,), torch.float32, "cpu")
    assert buffer.shape == (2, 4, 2) and [cache.side_length("state", r) for r in (0, 1)] == [0, 0]
    buffer[0, :3], buffer[1, :2] = 1.0, 2.0
    cache.mark_computed("state", 0, 3)
    cache.mark_computed("state", 1, 2)
    with pytest.raises(ValueError, match="side state 'state' for 3 tokens of row 1, which caches 2"):
        cache.mark_computed("state", 1, 3)
    with pytest.raises(ValueError, match="side buffer 'state' holds"):
        cache.side_buffer("state", (3,), torch.float32, "cpu")
    verifier.verify_rows(torch.tensor([[6, 7, 8], [9, 10, 11]]))  # 6 slots needed: the buffers grow
    grown = cache.side_buffer("state", (2,), torch.float32, "cpu")
    assert grown.shape[1] == cache.capacity > 4 and bool((grown[0, :3] == 1).all()) and bool((grown[1, :2] == 2).all())
    assert cache.side_lengths == {"hidden": [6, 5], "state": [3, 2]}
    verifier.rollback_rows([4, 1])
    assert cache.lengths == [2, 4] and cache.side_lengths == {"hidden": [2, 4], "state": [2, 2]}
    assert verifier.hidden_states(1).shape == (1, 4, 32)
    verifier.select_rows([1])
    assert cache.side_lengths == {"hidden": [4], "state": [2]}
    assert bool((cache.side_buffer("state", (2,), torch.float32, "cpu")[0, :2] == 2).all())


@PROPERTY
@given(data=st.data())
def test_finished_rows_stop_costing_work(data):
    """Every row is in exactly as many verifier forwards as it took steps: a finished row is never fed again
    (models that take per-row masks; the others decode row by row, below)."""
    model = data.draw(verifiers(batches=True).filter(lambda m: row_mask_problem(m) is None), label="verifier")
    vocab = model.config.vocab_size
    input_ids, mask, rows = data.draw(padded_batches(vocab, pad=0), label="batch")
    eos = data.draw(st.integers(1, vocab - 1), label="eos")  # rows stop at different steps
    fed_rows = []

    def count(_, args, kwargs):  # the verifier's forwards only (the default scheduler also probes the model)
        if isinstance(kwargs.get("cache"), SharedCache):
            fed_rows.append(kwargs["input_ids"].shape[0])

    # The default scheduler's cost table is measured first: for a model with an indexer it times verifies too
    verify_cost_table(model)
    hook = model.register_forward_pre_hook(count, with_kwargs=True)
    try:
        _, stats = hybrid.generate(
            model,
            input_ids,
            attention_mask=mask,
            drafter=PromptLookupDrafter(),
            max_new_tokens=data.draw(st.integers(1, 16)),
            eos_token_id=eos,
            pad_token_id=0,
            do_sample=False,
            return_stats=True,
        )
    finally:
        hook.remove()
    # One prefill for the whole batch; with recurrent states, one per prompt length (no padding enters a state)
    prefills = len({len(row) for row in rows}) if keeps_states(model) else 1
    assert sum(fed_rows[:prefills]) == len(rows), "every row prefilled once"
    assert sum(fed_rows) == stats.verifier_forwards, (fed_rows, stats.verifier_forwards)
    steps = fed_rows[prefills:]
    assert steps == sorted(steps, reverse=True) and (not steps or steps[0] <= len(rows)), "the batch only shrinks"


def test_without_per_row_masks_rows_run_one_at_a_time(monkeypatch):
    """An attention implementation that takes no per-row masks (flash_attention_2) decodes row by row,
    with the same output as the batched path."""
    model = tiny_model("llama", 48, 2, seed=3)
    input_ids = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    kwargs = dict(
        attention_mask=mask, drafter=PromptLookupDrafter(), max_new_tokens=12, do_sample=False, pad_token_id=0
    )
    batched = hybrid.generate(model, input_ids, **kwargs)
    monkeypatch.setattr(support_module, "MASKED_ATTENTION", ())
    assert not Verifier(model).batches
    assert torch.equal(hybrid.generate(model, input_ids, **kwargs), batched)


def test_batch_that_does_not_fit_names_the_batch_that_does(monkeypatch):
    model = tiny_model("llama", 48, 2, seed=0)
    # No verify padded by a position (whose slot the capacity would add) on whatever table this machine cached.
    monkeypatch.setattr(importlib.import_module("hybrid.generate"), "cached_kernel_choice", lambda model: ({}, {}))
    per_row = memory_module.bytes_per_row(model, capacity=5 + 20 + PromptLookupDrafter().max_draft_len + 1)
    monkeypatch.setattr(memory_module, "free_memory_bytes", lambda device: 3 * per_row + 1)
    prompts = torch.randint(1, 48, (5, 5))
    with pytest.raises(CacheMemoryError, match=r"batch of 5 rows.*pass at most 3 rows per call"):
        hybrid.generate(model, prompts, drafter=PromptLookupDrafter(), max_new_tokens=20, do_sample=False)
    assert hybrid.generate(
        model, prompts[:3], drafter=PromptLookupDrafter(), max_new_tokens=20, do_sample=False
    ).shape == (3, 25)
    monkeypatch.setattr(memory_module, "free_memory_bytes", lambda device: per_row // 2)
    with pytest.raises(CacheMemoryError, match=r"even one row does not fit; lower max_new_tokens"):
        hybrid.generate(model, prompts[:1], drafter=PromptLookupDrafter(), max_new_tokens=20, do_sample=False)


def test_cache_from_another_model_is_refused():
    model = tiny_model("llama", 48, 2, seed=0)  # 2 layers of 2 key/value heads of size 8
    foreign = DynamicCache()
    with torch.inference_mode():
        tiny_model("llama", 48, 1, seed=1)(torch.tensor([[1, 2, 3]]), cache=foreign, use_cache=True)
    with pytest.raises(
        ValueError, match=r"past_key_values was built for another model \(it has 1 layers, LlamaForCausalLM has 2\)"
    ):
        hybrid.generate(model, torch.tensor([[1, 2, 3, 4]]), drafter=None, past_key_values=foreign, max_new_tokens=2)
    wide = DynamicCache()
    wide.update(torch.zeros(1, 4, 3, 16), torch.zeros(1, 4, 3, 16), 0)
    wide.update(torch.zeros(1, 4, 3, 16), torch.zeros(1, 4, 3, 16), 1)
    with pytest.raises(
        ValueError, match=r"cache was built for another model \(its layer 0 holds 4 key/value heads of size 16"
    ):
        hybrid.generate(model, torch.tensor([[1, 2, 3, 4]]), drafter=None, cache=wide, max_new_tokens=2)
    own = DynamicCache()
    with torch.inference_mode():
        model(torch.tensor([[1, 2, 3]]), cache=own, use_cache=True)
    with pytest.raises(
        ValueError, match=r"does not continue from a past_key_values.*pass the whole sequence as input_ids"
    ):
        hybrid.generate(model, torch.tensor([[1, 2, 3, 4]]), drafter=None, past_key_values=own, max_new_tokens=2)


def test_verifier_dispatched_with_a_device_map(tmp_path):
    """A verifier loaded with a device_map runs through accelerate's hooks (here one layer offloaded to disk and
    loaded at each forward: what a CPU can show of device_map="auto"); hybrid's output is still generate's,
    with a drafter that reads the verifier's hidden states, on the dynamic and the static path."""
    from strategies import random_block_drafter
    from transformers import AutoModelForCausalLM

    tiny_model("llama", 64, 3, seed=3).save_pretrained(tmp_path)
    device_map = {
        "model.embed_tokens": "cpu",
        "model.layers.0": "cpu",
        "model.layers.1": "disk",
        "model.layers.2": "cpu",
        "model.norm": "cpu",
        "model.rotary_emb": "cpu",
        "lm_head": "cpu",
    }
    model = AutoModelForCausalLM.from_pretrained(tmp_path, device_map=device_map, offload_folder=tmp_path / "offload")
    assert hasattr(model.model.layers[1], "_hf_hook"), "accelerate dispatched the model"
    input_ids = torch.tensor([[5, 9, 5, 9, 17, 3, 5, 9]])
    expected = model.generate(input_ids, max_new_tokens=30, do_sample=False)
    for drafter in (PromptLookupDrafter(), random_block_drafter(model, seed=1)):
        for static in (None, "static"):
            out = hybrid.generate(
                model, input_ids, drafter=drafter, max_new_tokens=30, do_sample=False, cache_implementation=static
            )
            assert torch.equal(out, expected), (type(drafter).__name__, static)
