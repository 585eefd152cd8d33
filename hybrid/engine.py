"""The decoding loop: draft -> schedule -> verify k+1 positions in one forward -> accept -> commit.

Reads top to bottom like the data path. Arguments arrive already validated by `hybrid.generate`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList

from drafters.base import Draft, DraftContext, Drafter, check_draft, process_logits
from hybrid.acceptance import greedy_step, sample, speculative_step
from hybrid.stats import GenerationStats
from schedulers.base import Scheduler
from verifiers.verifier import Verifier


@dataclass
class DecodeResult:
    sequences: torch.Tensor  # [1, prompt + new]
    scores: tuple[torch.Tensor, ...] | None  # processed scores per new token, each [1, vocab]
    logits: tuple[torch.Tensor, ...] | None  # raw logits per new token, each [1, vocab]
    stats: GenerationStats


class _Output:
    """The growing sequence and everything `generate` records for each emitted token."""

    def __init__(self, input_ids, stopping_criteria, streamer, keep_scores, keep_logits):
        self.ids = input_ids
        self.stopping_criteria = stopping_criteria
        self.streamer = streamer
        self.scores = () if keep_scores else None
        self.logits = () if keep_logits else None
        self.finished = False

    def emit(self, token: int, scores: torch.Tensor, logits: torch.Tensor) -> None:
        self.ids = torch.cat([self.ids, self.ids.new_tensor([[token]])], dim=1)
        if self.scores is not None:
            self.scores += (scores[None],)
        if self.logits is not None:
            self.logits += (logits[None],)
        # As in `generate`: criteria see the sequence and the scores so far after every token.
        self.finished = bool(self.stopping_criteria(self.ids, self.scores).any())

    def stream(self, num_new: int) -> None:
        if self.streamer is not None and num_new:
            self.streamer.put(self.ids[0, -num_new:].cpu())


def decode(
    verifier: Verifier,
    drafter: Drafter | None,
    scheduler: Scheduler,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    processors: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    max_length: int,
    do_sample: bool,
    generator: torch.Generator | None = None,
    streamer=None,
    keep_scores: bool = False,
    keep_logits: bool = False,
) -> DecodeResult:
    stats = GenerationStats()
    start = time.perf_counter()
    out = _Output(input_ids, stopping_criteria, streamer, keep_scores, keep_logits)
    if streamer is not None:
        streamer.put(input_ids.cpu())  # as `generate` does; TextStreamer(skip_prompt=True) drops it
    vocab_size = verifier.vocab_size
    num_padding = 0 if attention_mask is None else int(attention_mask[0].argmax())  # leading pads (mask ends in 1)
    max_positions = getattr(verifier.model.config.get_text_config(), "max_position_embeddings", None)

    def choose(scores: torch.Tensor) -> int:
        """The verifier's own token from its processed scores, as `generate` picks it."""
        return sample(torch.softmax(scores, dim=-1), generator) if do_sample else int(scores.argmax())

    # Prefill: the first new token is the verifier's, exactly as in `generate`.
    logits = verifier.prefill(input_ids, attention_mask, capacity=max_length)
    scores = process_logits(processors, out.ids, logits)
    out.emit(choose(scores), scores, logits)
    out.stream(1)
    stats.record(drafted=0, accepted=0, emitted=1)
    stats.prefill_time = time.perf_counter() - start

    ctx = DraftContext(out.ids, num_padding, do_sample, processors, generator, verifier)
    if drafter is not None:
        drafter.reset(ctx)
        scheduler.reset(drafter, verifier.model)

    while not out.finished:
        # Room: never draft past max_length (the bonus token needs a slot) or the model's context.
        room = max_length - out.ids.shape[1] - 1
        if max_positions is not None:
            room = min(room, max_positions - verifier.next_position - 1)
        t0 = time.perf_counter()
        max_k = min(scheduler.max_draft_length(), room) if drafter is not None else 0
        t1 = time.perf_counter()
        draft = Draft.empty(out.ids.device)
        if max_k > 0:
            ctx.input_ids = out.ids
            draft = check_draft(drafter.propose(ctx, max_k), max_k, vocab_size, type(drafter).__name__)
        t2 = time.perf_counter()
        k = scheduler.select(draft) if len(draft) else 0
        if not 0 <= k <= len(draft):
            raise ValueError(f"{type(scheduler).__name__}.select returned {k}; expected 0..{len(draft)}")
        draft = draft.truncate(k)
        t3 = time.perf_counter()

        fed = torch.cat([out.ids[:, -1:], draft.tokens.to(out.ids.device)[None]], dim=1)
        logits = verifier.verify(fed)  # [k + 1, vocab]: the verifier's view after each fed token
        accepted = emitted = 0
        for i in range(k + 1):
            scores = process_logits(processors, out.ids, logits[i])
            if i == k:  # every draft accepted: the bonus token comes from the verifier alone
                token, ok = choose(scores), False
            elif do_sample:
                q = None if draft.probs is None else draft.probs[i]
                ok, token = speculative_step(torch.softmax(scores, -1), q, int(draft.tokens[i]), generator)
            else:
                ok, token = greedy_step(scores, int(draft.tokens[i]))
            out.emit(token, scores, logits[i])
            emitted += 1
            accepted += ok
            if out.finished or not ok:
                break
        # The cache keeps every committed token but the newest: of the k + 1 fed, keep `emitted`.
        verifier.rollback(k + 1 - emitted)
        out.stream(emitted)
        t4 = time.perf_counter()
        if drafter is not None:
            scheduler.update(draft, accepted, t2 - t1, t4 - t3)
        stats.record(drafted=k, accepted=accepted, emitted=emitted)
        stats.draft_time += t2 - t1
        stats.verify_time += t4 - t3
        stats.schedule_time += (t1 - t0) + (t3 - t2) + (time.perf_counter() - t4)

    if streamer is not None:
        streamer.end()
    stats.total_time = time.perf_counter() - start
    return DecodeResult(out.ids, out.scores, out.logits, stats)
