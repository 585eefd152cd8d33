"""The decoding loop: draft -> schedule -> verify k+1 positions in one forward -> accept -> roll back.

Reads top to bottom like the data path. Arguments arrive already validated by `hybrid.generate`.
A batch is one forward per step over every unfinished row: each row drafts, is verified and accepts
on its own (rows accept different numbers of tokens; the cache keeps one length per row), exactly as
it would alone; rows that finish leave the batch.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList

from drafters.base import Draft, DraftContext, Drafter, DraftError, check_draft
from hybrid.acceptance import sample, speculative_step
from hybrid.stats import GenerationStats
from schedulers.base import Scheduler
from verifiers.logits import process_logits
from verifiers.verifier import Verifier


@dataclass
class DecodeResult:
    sequences: list[torch.Tensor]  # per row [1, prompt + new] (the prompt with its left padding)
    scores: tuple[torch.Tensor, ...] | None  # batch 1: processed scores per new token, each [1, vocab]
    logits: tuple[torch.Tensor, ...] | None  # batch 1: raw logits per new token, each [1, vocab]
    stats: GenerationStats  # batch 1: the row's; a batch: all rows' steps, wall-clock times of the call


class _Row:
    """One sequence: its growing ids and everything `generate` records for each emitted token."""

    def __init__(self, input_ids, prompt_tokens, processors, stopping_criteria, streamer, keep_scores, keep_logits):
        self.ids = input_ids  # [1, n], padding included, as `generate` returns it
        self.prompt_len = input_ids.shape[1]
        self.prompt_tokens = prompt_tokens  # [n'] the prompt's unmasked tokens: what the cache holds
        self.processors = processors
        self.stopping_criteria = stopping_criteria
        self.streamer = streamer
        self.scores = () if keep_scores else None
        self.logits = () if keep_logits else None
        self.finished = False
        self.stats = GenerationStats()
        self.ctx: DraftContext | None = None
        self.drafter: Drafter | None = None
        self.draft = Draft.empty(input_ids.device)  # this step's draft, after the scheduler's cut
        self.draft_time = 0.0  # this step's drafting seconds
        self.accepted = 0  # this step's accepted drafts

    def emit(self, token: int, scores: torch.Tensor, logits: torch.Tensor) -> None:
        self.ids = torch.cat([self.ids, self.ids.new_tensor([[token]])], dim=1)
        if self.scores is not None:
            self.scores += (scores[None],)
        if self.logits is not None:
            self.logits += (logits[None],)
        # As in `generate`: criteria see the sequence and the scores so far after every token.
        self.finished = bool(self.stopping_criteria(self.ids, self.scores).any())

    def unmasked_ids(self) -> torch.Tensor:
        """[1, n' + new]: the committed sequence without the prompt's masked tokens, as the verifier attends to it."""
        if self.prompt_tokens.shape[0] == self.prompt_len:
            return self.ids
        return torch.cat([self.prompt_tokens[None], self.ids[:, self.prompt_len :]], dim=1)

    def stream(self, num_new: int) -> None:
        if self.streamer is not None and num_new:
            self.streamer.put(self.ids[0, -num_new:].cpu())


def decode(
    verifier: Verifier,
    drafter: Drafter | None,
    scheduler: Scheduler,
    prompts: list[tuple[torch.Tensor, torch.Tensor, LogitsProcessorList]],
    stopping_criteria: StoppingCriteriaList,
    max_length: int | float,
    do_sample: bool,
    generator: torch.Generator | None = None,
    acceptance: str = "match",
    streamer=None,
    keep_scores: bool = False,
    keep_logits: bool = False,
) -> DecodeResult:
    """Decode every prompt (input_ids [1, n], its unmasked tokens [n'], its processors) to the end.

    acceptance: "match" keeps a drafted token iff it equals the verifier's own choice, made exactly as `generate`
    makes it (argmax, or one multinomial draw from the caller's RNG); "rejection" is speculative sampling's
    min(1, p/q) rule, which trusts `Draft.probs` to be what each token was drawn from.
    """
    start = time.perf_counter()
    max_length = math.ceil(max_length)  # `generate` stops at the first length >= max_length, a float included
    rows = [
        _Row(ids, kept, procs, stopping_criteria, streamer, keep_scores, keep_logits) for ids, kept, procs in prompts
    ]
    if streamer is not None:
        streamer.put(rows[0].ids.cpu())  # as `generate` does; TextStreamer(skip_prompt=True) drops it
    vocab_size = verifier.vocab_size
    draft_len = drafter.max_draft_len if drafter is not None else 0

    def choose(scores: torch.Tensor) -> int:
        """The verifier's own token from its processed scores, as `generate` picks it."""
        return sample(torch.softmax(scores, dim=-1), generator) if do_sample else int(scores.argmax())

    # Prefill: the first new token of every row is the verifier's, exactly as in `generate`.
    logits = verifier.prefill_rows([row.prompt_tokens for row in rows], capacity=max_length + draft_len + 1)
    for row, row_logits in zip(rows, logits):
        scores = process_logits(row.processors, row.ids, row_logits)
        row.emit(choose(scores), scores, row_logits)
        row.stream(1)
        row.stats.record(drafted=0, accepted=0, emitted=1)
    prefill_time = time.perf_counter() - start
    for row in rows:
        row.stats.prefill_time = prefill_time
    if drafter is not None:
        scheduler.reset(drafter, verifier.model)
        scheduler.set_verify_width(verifier.padded_width)
    # Under "match" the verifier's draws are `generate`'s own, from the caller's RNG: drafters propose their best
    # guesses (the most likely to match) and whatever they draw comes from a fork of the global RNG.
    rejection = do_sample and acceptance == "rejection"  # drafts sampled, with their probs, for min(1, p/q)
    protect_rng = do_sample and not rejection
    device = verifier.model.device
    rng_devices = (
        [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    )
    for b, row in enumerate(rows):
        row.ctx = DraftContext(
            row.unmasked_ids(), rejection, row.processors, generator if rejection else None, verifier, row=b
        )
        if drafter is not None:
            # Each row drafts with its own copy (weights shared, per-sequence state separate).
            row.drafter = drafter if len(rows) == 1 else drafter.fork()
            row.drafter.reset(row.ctx)

    active = _drop_finished(verifier, rows)
    while active:
        # Draft, each row on its own. Room: never past max_length (the bonus token needs a slot) or the context.
        t0 = time.perf_counter()
        max_k = min(scheduler.max_draft_length(), draft_len) if drafter is not None else 0
        steps = scheduler.denoising_steps() if drafter is not None else 1
        if drafter is not None and not 1 <= steps <= drafter.max_steps:
            raise ValueError(
                f"{type(scheduler).__name__}.denoising_steps returned {steps}; expected 1..{drafter.max_steps}"
            )
        schedule_time = time.perf_counter() - t0
        asks = {}  # row -> how many tokens it may draft
        for row in active:
            room = max_length - row.ids.shape[1] - 1
            row.draft, row.draft_time = Draft.empty(row.ids.device), 0.0
            if min(max_k, room) > 0:
                row.ctx.input_ids, row.ctx.steps = row.unmasked_ids(), steps
                asks[row] = min(max_k, room)
        if asks:  # all rows at once: a drafter may serve them in one forward; each row is charged its share
            t1 = time.perf_counter()
            with torch.random.fork_rng(rng_devices) if protect_rng else contextlib.nullcontext():
                drafts = drafter.propose_rows(
                    [row.drafter for row in asks], [row.ctx for row in asks], list(asks.values())
                )
            if not isinstance(drafts, list) or len(drafts) != len(asks):
                raise DraftError(
                    f"{type(drafter).__name__}.propose_rows returned {type(drafts).__name__} of "
                    f"{len(drafts) if isinstance(drafts, list) else '?'} drafts for {len(asks)} rows: "
                    "return a list with one Draft per row"
                )
            for (row, k), draft in zip(asks.items(), drafts):
                row.draft = check_draft(draft, k, vocab_size, type(drafter).__name__)
            share = (time.perf_counter() - t1) / len(asks)
            for row in asks:
                row.draft_time = share
                row.stats.draft_time += share
        t2 = time.perf_counter()
        ks = scheduler.select_batch([row.draft for row in active]) if drafter is not None else [0] * len(active)
        for row, k in zip(active, ks):
            if not 0 <= k <= len(row.draft):
                raise ValueError(f"{type(scheduler).__name__}.select returned {k}; expected 0..{len(row.draft)}")
            row.draft = row.draft.truncate(k)
        schedule_time += time.perf_counter() - t2

        # Verify: [pending, d_1 .. d_k] for every row in one forward; short rows are padded with
        # their pending token, whose scores are never read (and whose slots the rollback drops).
        t3 = time.perf_counter()
        width = 1 + max(len(row.draft) for row in active)
        fed = torch.stack(
            [
                torch.cat(
                    [
                        row.ids[0, -1:],
                        row.draft.tokens.to(row.ids.device),
                        row.ids[0, -1:].expand(width - 1 - len(row.draft)),
                    ]
                )
                for row in active
            ]
        )
        # [rows, width, vocab]: the verifier's view after each fed token
        logits = verifier.verify_rows(fed, real=[1 + len(row.draft) for row in active])
        drop = []
        for row, row_logits in zip(active, logits):
            emitted = _accept(row, row_logits, rejection, choose, generator)
            drop.append(width - emitted)  # the cache keeps every committed token but the newest
        verifier.rollback_rows(drop)
        verify_time = time.perf_counter() - t3
        t4 = time.perf_counter()
        if drafter is not None:
            scheduler.update_batch(
                [row.draft for row in active],
                [row.accepted for row in active],
                [row.draft_time for row in active],
                verify_time,
            )
        schedule_time += time.perf_counter() - t4
        for row in active:  # a row's share of the batched forward is its verify cost
            row.stats.verify_time += verify_time / len(active)
            row.stats.schedule_time += schedule_time / len(active)
        active = _drop_finished(verifier, active)

    if streamer is not None:
        streamer.end()
    total = time.perf_counter() - start
    if len(rows) == 1:
        stats = rows[0].stats
    else:  # steps of every row, their draft/verify/schedule shares summed; one prefill and one call
        stats = GenerationStats.combined([row.stats for row in rows])
        stats.prefill_time = prefill_time
    stats.total_time = total
    return DecodeResult([row.ids for row in rows], rows[0].scores, rows[0].logits, stats)


def _accept(row: _Row, logits: torch.Tensor, rejection: bool, choose, generator) -> int:
    """Run the acceptance rule over one row's verified positions; emit, and return how many tokens it emitted.

    Every emitted token but a rejection-sampling correction is the verifier's own `choose`, in sequence order."""
    draft, k = row.draft, len(row.draft)
    accepted = emitted = 0
    for i in range(k + 1):
        scores = process_logits(row.processors, row.ids, logits[i])
        if i == k:  # every draft accepted: the bonus token comes from the verifier alone
            token, ok = choose(scores), False
        elif rejection:
            q = None if draft.probs is None else draft.probs[i]
            ok, token = speculative_step(torch.softmax(scores, -1), q, int(draft.tokens[i]), generator)
        else:
            token = choose(scores)
            ok = token == int(draft.tokens[i])
        row.emit(token, scores, logits[i])
        emitted += 1
        accepted += ok
        if row.finished or not ok:
            break
    row.accepted = accepted
    row.stream(emitted)
    row.stats.record(drafted=k, accepted=accepted, emitted=emitted)
    return emitted


def _drop_finished(verifier: Verifier, active: list[_Row]) -> list[_Row]:
    """The unfinished rows; finished ones leave the cache, so they stop costing work."""
    keep = [row for row in active if not row.finished]
    if len(keep) < len(active) and keep:
        verifier.select_rows([row.ctx.row for row in keep])
        for b, row in enumerate(keep):
            row.ctx.row = b
    return keep
