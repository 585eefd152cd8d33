"""Properties: a batch (left-padded, any lengths) gives, row by row, exactly what batch-1 calls give, with the logits
processors `generate` builds, which a batch's rows of one length run in one call; and it gives what `model.generate`
gives on the same batch, however its rows stop."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import cache_layouts, drafters_for, padded_batches, verifiers
from transformers import StoppingCriteria, StoppingCriteriaList

import hybrid
from hybrid.testing import check_batch_greedy_lossless, tiny_model

PROPERTY = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PAD = 0


@PROPERTY
@given(data=st.data())
def test_batch_rows_equal_batch_one_outputs(data):
    model = data.draw(verifiers(batches=True), label="verifier")
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
        # Row-wise processors (one list for every row, aligned rows processed together) and one that is not (the
        # repetition penalty holds each row's prompt padding: every row keeps its own list).
        "min_new_tokens": data.draw(st.sampled_from([None, 3, 30]), label="min_new_tokens"),
        "no_repeat_ngram_size": data.draw(st.sampled_from([None, 2]), label="no_repeat_ngram_size"),
        "repetition_penalty": data.draw(st.sampled_from([None, 1.5]), label="repetition_penalty"),
    }

    static = data.draw(cache_layouts(model), label="cache_implementation")
    batch = hybrid.generate(
        model, input_ids, attention_mask=mask, drafter=drafter, cache_implementation=static, **settings_
    )
    assert batch.shape[0] == len(rows) and torch.equal(batch[:, :width], input_ids)
    # Processors that read the ids see a row's left padding, in `generate` too: such a row is compared with its
    # padded self alone, any other with the row as its user would pass it alone.
    reads_padding = settings_["no_repeat_ngram_size"] or settings_["repetition_penalty"]
    for r, row in enumerate(rows):
        if reads_padding:
            row_ids, row_mask = input_ids[r : r + 1], mask[r : r + 1]
        else:
            row_ids, row_mask = torch.tensor([row]), mask[r : r + 1, width - len(row) :]  # its inner holes, if any
        alone = hybrid.generate(model, row_ids, attention_mask=row_mask, drafter=drafter, **settings_)
        alone = alone[0, row_ids.shape[1] :]
        new = batch[r, width:]
        assert torch.equal(new[: len(alone)], alone), f"row {r}"
        assert bool((new[len(alone) :] == PAD).all()), f"row {r} is padded after it finished"


class StopOnResidue(StoppingCriteria):
    """Stops a row at a token whose id is, modulo `modulus`, that of the row's last prompt token: rows stop at
    different lengths."""

    def __init__(self, modulus: int, prompt_len: int):
        self.modulus, self.prompt_len = modulus, prompt_len

    def __call__(self, input_ids, scores, **kwargs):
        last = input_ids[:, self.prompt_len - 1]
        return (input_ids[:, -1] % self.modulus == last % self.modulus) & (input_ids.shape[1] > self.prompt_len)


@PROPERTY
@given(data=st.data())
def test_a_batch_equals_model_generate_on_it_however_its_rows_stop(data):
    """Where `generate` has an EOS criterion a stopped row is padded; without one (a stopping criterion of the
    user's, stop strings) it goes on appending its own tokens until the last row stops."""
    model = data.draw(verifiers(batches=True), label="verifier")
    vocab = model.config.vocab_size
    input_ids, mask, _ = data.draw(padded_batches(vocab, PAD, model=model), label="batch")
    stop = data.draw(st.sampled_from(["eos", "criterion", "criterion and eos", "length"]), label="stop")
    eos = data.draw(st.integers(1, vocab - 1), label="eos") if "eos" in stop else None
    settings_ = {"max_new_tokens": data.draw(st.integers(1, 24), label="max_new_tokens"), "pad_token_id": PAD}
    settings_["eos_token_id"] = eos
    if "criterion" in stop:
        modulus = data.draw(st.integers(2, 8), label="modulus")
        settings_["stopping_criteria"] = StoppingCriteriaList([StopOnResidue(modulus, input_ids.shape[1])])
    drafter = data.draw(drafters_for(model, eos), label="drafter")
    static = data.draw(cache_layouts(model), label="cache_implementation")
    check_batch_greedy_lossless(
        model, input_ids, drafter, hybrid_kwargs={"cache_implementation": static}, attention_mask=mask, **settings_
    )


def test_a_stopped_row_that_runs_ahead_to_max_length_ends_where_the_last_row_stops():
    """Without an EOS the first row stops at once and, drafted perfectly, runs on to max_length while the second
    still decodes one token a step: the batch ends where the second stops, as in `generate`."""
    from drafters.oracle import OracleDrafter

    class StopFirstRowAtOnceSecondAfter20(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.tensor([bool(row[0] == 5) or row.shape[0] >= 24 for row in input_ids])

    model = tiny_model("llama", 64, 1, 3)
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    own = model.generate(ids[:1], max_new_tokens=40, do_sample=False)  # the first row's own continuation
    stopping = StoppingCriteriaList([StopFirstRowAtOnceSecondAfter20()])
    check_batch_greedy_lossless(
        model, ids, OracleDrafter(own), max_new_tokens=40, stopping_criteria=stopping, pad_token_id=PAD
    )


def test_rows_share_one_processors_list_only_when_every_processor_is_row_wise():
    from transformers import GenerationConfig, LogitsProcessorList

    from verifiers.logits import shared_processors

    model = tiny_model("llama", 64, 1, 0)
    ids, mask = torch.tensor([[PAD, 5, 6], [7, 8, 9]]), torch.tensor([[0, 1, 1], [1, 1, 1]])

    def row_lists(**config):
        config = GenerationConfig(**config, pad_token_id=PAD)
        return [
            model._get_logits_processor(
                generation_config=config,
                input_ids_seq_length=3,
                encoder_input_ids=ids[r : r + 1],
                logits_processor=LogitsProcessorList(),
                device=ids.device,
                model_kwargs={"attention_mask": mask[r : r + 1]},
            )
            for r in range(2)
        ]

    lists = row_lists(min_new_tokens=4, eos_token_id=3, do_sample=True, top_k=5, temperature=0.7)
    assert shared_processors(lists) is lists[0]
    assert shared_processors(row_lists(repetition_penalty=1.3)) is None  # holds each row's prompt padding
