"""Property: a batch (left-padded, any lengths) gives, row by row, exactly what batch-1 calls give."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import cache_layouts, drafters_for, padded_batches, verifiers

import hybrid

PROPERTY = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PAD = 0


@PROPERTY
@given(data=st.data())
def test_batch_rows_equal_batch_one_outputs(data):
    model = data.draw(verifiers(), label="verifier")
    vocab = model.config.vocab_size
    input_ids, mask, rows = data.draw(padded_batches(vocab, PAD, model=model), label="batch")
    width = input_ids.shape[1]
    eos = data.draw(st.one_of(st.none(), st.integers(1, vocab - 1)), label="eos")
    drafter = data.draw(drafters_for(model, eos), label="drafter")
    settings_ = {
        "max_new_tokens": data.draw(st.integers(1, 20), label="max_new_tokens"),
        "do_sample": False,
        "eos_token_id": eos,
        "pad_token_id": PAD,
    }

    static = data.draw(cache_layouts(model), label="cache_implementation")
    batch = hybrid.generate(
        model, input_ids, attention_mask=mask, drafter=drafter, cache_implementation=static, **settings_
    )
    assert batch.shape[0] == len(rows) and torch.equal(batch[:, :width], input_ids)
    for r, row in enumerate(rows):
        row_mask = mask[r : r + 1, width - len(row) :]  # the masked tokens inside the row, if any
        alone = hybrid.generate(model, torch.tensor([row]), attention_mask=row_mask, drafter=drafter, **settings_)
        alone = alone[0, len(row) :]
        new = batch[r, width:]
        assert torch.equal(new[: len(alone)], alone), f"row {r}"
        assert bool((new[len(alone) :] == PAD).all()), f"row {r} is padded after it finished"
