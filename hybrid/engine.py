"""The decoding loop: plan -> draft -> choose -> verify the draft's nodes in one forward -> accept -> rewind -> observe.

Reads top to bottom like the data path. Arguments arrive already validated by `hybrid.generate`. A draft is a
chain or a token tree; the verifier scores every node at once, the acceptance rule walks from the pending token
into the child equal to the verifier's choice (`hybrid.acceptance.walk`), and the cache rewinds to the walked path
(`Verifier.keep_accepted`). No drafter is `NoDrafter`, which proposes nothing: plain decoding is the same loop.
A batch is one forward per step over every unfinished row: each row drafts, is verified and accepts
on its own (rows accept different numbers of tokens; the cache keeps one length per row), exactly as
it would alone; rows that finish leave the batch. Where `generate` pads a stopped row (it has an EOS criterion), a
row finishes when its criteria fire; where it does not, every row decodes on to the length at which the last row
stopped, as in `generate`, whose stopped rows keep appending their own tokens until the whole batch has stopped.
"""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList

from drafters.base import Draft, DraftContext, Drafter, DraftError, NoDrafter, check_draft
from hybrid.acceptance import Rule, match_rule, own_choice, rejection_rule, walk
from hybrid.stats import GenerationStats, Stopwatch
from schedulers.base import Scheduler, StepPlan
from verifiers.logits import process_logits
from verifiers.verifier import Verifier


@dataclass(frozen=True)
class DecodeSettings:
    """How one call decodes, as `hybrid.generate` derives it from `generate`'s arguments."""

    stopping_criteria: StoppingCriteriaList
    max_length: int | float
    do_sample: bool
    generator: torch.Generator | None = None  # the verifier's draws when sampling (None: torch's global RNG)
    # "match" keeps a drafted token iff it equals the verifier's own choice, made exactly as `generate` makes it
    # (argmax, or one multinomial draw from the caller's RNG); "rejection" is speculative sampling's min(1, p/q)
    # rule, which trusts `Draft.probs` to be what each token was drawn from (`hybrid.acceptance`).
    acceptance: str = "match"
    streamer: object | None = None
    keep_scores: bool = False  # `output_scores` under `return_dict_in_generate`
    keep_logits: bool = False  # `output_logits` under `return_dict_in_generate`
    # A row finishes when its stopping criteria fire (`generate` pads it: it has an EOS criterion); False: every row
    # decodes on to the length at which the last row's criteria fired.
    pad_stopped: bool = True
    # How the verifier's tokens are chosen, as the scheduler is told it (`Scheduler.start`).
    decoding: dict | None = None


@dataclass
class DecodeResult:
    sequences: list[torch.Tensor]  # per row [1, prompt + new] (the prompt with its left padding)
    scores: tuple[torch.Tensor, ...] | None  # batch 1: processed scores per new token, each [1, vocab]
    logits: tuple[torch.Tensor, ...] | None  # batch 1: raw logits per new token, each [1, vocab]
    stats: GenerationStats  # batch 1: the row's; a batch: all rows' steps, wall-clock times of the call


class _Row:
    """One sequence: its growing ids and everything `generate` records for each emitted token."""

    def __init__(self, input_ids, mask, processors, settings: DecodeSettings, end: int, alone: bool):
        self.ids = input_ids  # [1, n], padding included, as `generate` returns it
        self.prompt_len = input_ids.shape[1]
        self.mask = mask  # [n] the prompt's attention mask (None: every token counts)
        # [n'] the prompt's unmasked tokens: what the cache holds (`generate` numbers them 0, 1, ... by the mask's
        # cumsum, as their slots are; its sliding windows also count the masked ones, see `SharedCache.mark_masked`)
        self.prompt_tokens = input_ids[0] if mask is None else input_ids[0][mask.bool()]
        self.processors = processors
        self.stopping_criteria = settings.stopping_criteria
        self.streamer = settings.streamer
        self.scores = () if settings.keep_scores else None
        self.logits = () if settings.keep_logits else None
        self.end = end  # the length at which the row finishes: max_length, or where the batch stops (`decode`)
        self.stopped_at: int | None = None  # the length at which its stopping criteria first fired
        self.stops_alone = alone  # it finishes when its criteria fire (else at the batch's end, `decode`)
        self.finished = False
        self.stats = GenerationStats()
        self.ctx: DraftContext | None = None
        self.index = 0  # this row's place in the verifier's batch (the engine's own; a drafter may change ctx.row)
        self.drafter: Drafter | None = None
        self.draft = Draft.empty(input_ids.device)  # this step's draft, after the scheduler's cut
        self.draft_time = 0.0  # this step's drafting seconds
        self.accepted: list[int] = []  # this step's accepted nodes, from the pending token down

    def emit(self, token: int, scores: torch.Tensor, logits: torch.Tensor) -> None:
        self.ids = torch.cat([self.ids, self.ids.new_tensor([[token]])], dim=1)
        if self.scores is not None:
            self.scores += (scores[None],)
        if self.logits is not None:
            self.logits += (logits[None],)
        # As in `generate`: criteria see the sequence and the scores so far after every token, until they fire.
        if self.stopped_at is None and bool(self.stopping_criteria(self.ids, self.scores).any()):
            self.stopped_at = self.ids.shape[1]
        self.finished = self.ids.shape[1] >= self.end or (self.stops_alone and self.stopped_at is not None)

    def cut(self, end: int) -> None:
        """Finish at length `end`, dropping what the row decoded beyond it (and those tokens from its stats)."""
        self.end, self.finished = end, True
        extra = self.ids.shape[1] - end
        if extra <= 0:
            return
        self.ids = self.ids[:, :end]
        if self.scores is not None:
            self.scores = self.scores[:-extra]
        if self.logits is not None:
            self.logits = self.logits[:-extra]
        stats = self.stats
        while extra:  # the last steps emitted them: they keep what is left, the accepted nodes within it
            dropped = min(extra, stats.emitted[-1])
            extra -= dropped
            stats.emitted[-1] -= dropped
            stats.accepted[-1] = min(stats.accepted[-1], stats.emitted[-1])
            if stats.emitted[-1] == 0:
                for steps in (stats.drafted, stats.accepted, stats.emitted, stats.passes):
                    steps.pop()

    def unmasked_ids(self) -> torch.Tensor:
        """[1, n' + new]: the committed sequence without the prompt's masked tokens, as the verifier attends to it.
        Always a new tensor: it goes to the drafter, and nothing a drafter writes may reach `self.ids`."""
        if self.prompt_tokens.shape[0] == self.prompt_len:
            return self.ids.clone()
        return torch.cat([self.prompt_tokens[None], self.ids[:, self.prompt_len :]], dim=1)

    def stream(self, num_new: int) -> None:
        if self.streamer is not None and num_new:
            self.streamer.put(self.ids[0, -num_new:].cpu())


def decode(
    verifier: Verifier,
    drafter: Drafter | None,
    scheduler: Scheduler,
    prompts: list[tuple[torch.Tensor, torch.Tensor | None, LogitsProcessorList]],
    settings: DecodeSettings,
) -> DecodeResult:
    """Decode every prompt (input_ids [1, n], its attention mask [n] or None, its processors) to the end."""
    clock = Stopwatch()
    drafter = drafter or NoDrafter()
    do_sample, generator, streamer = settings.do_sample, settings.generator, settings.streamer
    max_length = math.ceil(settings.max_length)  # `generate` stops at the first length >= max_length, a float too
    alone = settings.pad_stopped or len(prompts) == 1
    rows = [_Row(ids, mask, procs, settings, max_length, alone) for ids, mask, procs in prompts]
    if streamer is not None:
        streamer.put(rows[0].ids.cpu())  # as `generate` does; TextStreamer(skip_prompt=True) drops it
    rejection = do_sample and settings.acceptance == "rejection"  # drafts sampled, with their probs, for min(1, p/q)
    choose = own_choice(do_sample, generator)
    rule = rejection_rule(generator) if rejection else match_rule(choose)

    # Prefill: the first new token of every row is the verifier's, exactly as in `generate`.
    logits = verifier.prefill_rows(
        [row.prompt_tokens for row in rows],
        max_length + drafter.node_budget + 1 + verifier.max_padding,
        [row.mask for row in rows],
    )
    for row, row_logits in zip(rows, logits):
        scores = process_logits(row.processors, row.ids, row_logits)
        row.emit(choose(scores), scores, row_logits)
        row.stream(1)
        row.stats.record(drafted=0, accepted=0, emitted=1)
    prefill_time = clock.lap()
    scheduler.start(drafter, model=verifier.model, decoding=settings.decoding, verify_width=verifier.width_rule())
    # Under rejection sampling the drafts are sampled, from generators of the drafters' own seeded from the caller's
    # RNG: their draws are independent of the verifier's, and nothing a drafter does to them reaches the verifier.
    draft_rng = _generator_seeded_from(generator, verifier.model.device) if rejection else None
    for b, row in enumerate(rows):
        row.stats.prefill_time = prefill_time
        row.index = b
        # The drafter's own copy of the processors: it may call them (stateful ones included) or change them, and
        # the verifier's scores go through the originals only.
        row.ctx = DraftContext(
            row.unmasked_ids(),
            rejection,
            _private_copy(row.processors),
            _generator_seeded_from(draft_rng, verifier.model.device) if rejection else None,
            verifier,
            row=b,
        )
        # Each row drafts with its own copy (weights shared, per-sequence state separate).
        row.drafter = drafter if len(rows) == 1 else drafter.fork()
        row.drafter.reset(row.ctx)

    active = _drop_finished(verifier, rows, rows)
    pass_stages = drafter.pass_stages
    steps_start = clock.total()
    while active:
        clock.lap()
        plan = scheduler.plan([(row.end - row.ids.shape[1]) / row.stats.tau for row in active])
        schedule_time = clock.lap()
        ran_passes = any(i < plan.drafting_stages for i in pass_stages)
        passes = plan.denoising_steps if ran_passes else 0  # 0: no stage that takes passes ran
        for row in active:  # where the model's `generate` drops its cache and re-reads the sequence, so does this
            if verifier.rereads_at(row.index):
                verifier.reread(row.unmasked_ids())
        _draft(drafter, verifier, active, plan, do_sample, draft_rng)
        draft_time = clock.lap()
        ks = scheduler.choose([row.draft for row in active])
        for row, k in zip(active, ks):
            row.draft = row.draft.truncate(k)
            if not verifier.takes_trees:  # its attention takes no tree mask: the best chain, same output
                row.draft = row.draft.best_chain()
        schedule_time += clock.lap()
        _verify(verifier, active, rule)
        verify_time = clock.lap()
        scheduler.observe(
            [row.draft for row in active],
            [row.accepted for row in active],
            [row.draft_time for row in active],
            verify_time,
        )
        schedule_time += clock.lap()
        for row in active:  # a row's share of the batched forward is its cost
            row.stats.passes.append(passes)
            row.stats.draft_time += draft_time / len(active)
            row.stats.verify_time += verify_time / len(active)
            row.stats.schedule_time += schedule_time / len(active)
        active = _drop_finished(verifier, active, rows)
    scheduler.finish([row.ids.shape[1] - row.prompt_len - 1 for row in rows], clock.total() - steps_start)

    for row in rows:  # the whole sequence, for a drafter that learns from what was committed
        row.ctx.input_ids = row.unmasked_ids()
        row.drafter.finish(row.ctx)
    if streamer is not None:
        streamer.end()
    if len(rows) == 1:
        stats = rows[0].stats
    else:  # steps of every row, their draft/verify/schedule shares summed; one prefill and one call
        stats = GenerationStats.combined([row.stats for row in rows])
        stats.prefill_time = prefill_time
    stats.total_time = clock.total()
    return DecodeResult([row.ids for row in rows], rows[0].scores, rows[0].logits, stats)


def _draft(
    drafter: Drafter, verifier: Verifier, active: list[_Row], plan: StepPlan, do_sample: bool, draft_rng
) -> None:
    """Each row's draft for this step by the drafter's first `plan.drafting_stages` stages, in
    `plan.denoising_steps` passes, of at most `plan.max_nodes` nodes (and the drafter's budget) and never past
    the row's end (the bonus token needs a slot): all rows asked at once, so a drafter may serve them in one forward.
    No stage: no drafting, the step verifies the pending token alone.

    When sampling, torch's global RNG is forked around the drafter, so nothing it draws or seeds reaches the
    caller's stream. draft_rng (rejection sampling only, else None) reseeds it inside the fork, so that a drafter's
    draws from it are not replays of the verifier's next ones."""
    budget, steps, stages = min(plan.max_nodes, drafter.node_budget), plan.denoising_steps, plan.drafting_stages
    asks = {}  # row -> how many nodes it may draft
    for row in active:
        room = row.end - row.ids.shape[1] - 1  # a draft of at most `room` nodes is at most `room` deep
        positions = verifier.positions_room(row.index)  # a rotary embedding's switch the forward must not straddle
        room = room if positions is None else min(room, positions)
        row.draft, row.draft_time = Draft.empty(row.ids.device), 0.0
        if min(budget, room) > 0 and stages > 0:
            row.ctx.input_ids, row.ctx.steps, row.ctx.stages, row.ctx.row = row.unmasked_ids(), steps, stages, row.index
            asks[row] = min(budget, room)
    if not asks:
        return
    clock = Stopwatch()
    # Under "match" the verifier's draws are `generate`'s own, from the caller's RNG: drafters propose their best
    # guesses (the most likely to match) and whatever they draw comes from a fork of the global RNG.
    rejection = draft_rng is not None
    device = verifier.model.device
    rng_devices = (
        [torch.cuda.current_device() if device.index is None else device.index] if device.type == "cuda" else []
    )
    with torch.random.fork_rng(rng_devices) if do_sample else contextlib.nullcontext():
        if rejection:
            _seed_global_rng(draft_rng, rng_devices)
        drafts = drafter.propose_rows([row.drafter for row in asks], [row.ctx for row in asks], list(asks.values()))
    if not isinstance(drafts, list) or len(drafts) != len(asks):
        raise DraftError(
            f"{type(drafter).__name__}.propose_rows returned {type(drafts).__name__} of "
            f"{len(drafts) if isinstance(drafts, list) else '?'} drafts for {len(asks)} rows: "
            "return a list with one Draft per row"
        )
    share = clock.lap() / len(asks)
    for (row, k), draft in zip(asks.items(), drafts):
        row.draft = check_draft(draft, k, verifier.vocab_size, type(drafter).__name__)
        if rejection and not row.draft.is_chain:
            raise DraftError(
                f"{type(drafter).__name__} proposed a tree under acceptance='rejection', which verifies chains "
                "(min(1, p/q) along one path): propose a chain when ctx.do_sample is set"
            )
        row.draft_time = share


def _verify(verifier: Verifier, active: list[_Row], rule: Rule) -> None:
    """Score [pending, the draft's nodes] of every row in one forward, accept, and rewind the cache to the accepted
    paths.

    Short rows are padded with their pending token, whose scores are never read (and whose slots are dropped)."""
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
    trees = any(not row.draft.is_chain for row in active)
    parents = [row.draft.parent_list() for row in active] if trees else None
    # [rows, width, vocab]: the verifier's view after each fed token and what it continues
    logits = verifier.verify_rows(fed, real=[1 + len(row.draft) for row in active], parents=parents)
    pending = _pending_scores(active, logits)
    kept = [
        _accept(row, row_logits, row_pending, rule) for row, row_logits, row_pending in zip(active, logits, pending)
    ]
    # Rewind: the cache keeps every committed token but the newest, i.e. the pending token and the accepted path.
    verifier.keep_accepted(kept)


def _pending_scores(active: list[_Row], logits: torch.Tensor) -> list[torch.Tensor]:
    """Each row's processed scores [vocab] after its pending token. Rows that hold one processors list (`generate`
    gives every row the same one when its processors are row-wise) and have one length are processed in one call,
    as `generate` processes its batch: a processor's cost barely depends on the rows it is given."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i, row in enumerate(active):
        groups.setdefault((id(row.processors), row.ids.shape[1]), []).append(i)
    scores: list[torch.Tensor | None] = [None] * len(active)
    for members in groups.values():
        first = active[members[0]]
        if len(members) == 1 or not first.processors:
            for i in members:
                scores[i] = process_logits(active[i].processors, active[i].ids, logits[i, 0])
            continue
        ids = torch.cat([active[i].ids for i in members])
        for i, row_scores in zip(members, first.processors(ids, logits[members, 0])):
            scores[i] = row_scores
    return scores


def _accept(row: _Row, logits: torch.Tensor, pending: torch.Tensor, rule: Rule) -> list[int]:
    """Walk the row's draft by `rule` from the pending token (whose processed scores are `pending`), emitting each
    token the rule gives. Returns the fed offsets the cache keeps.

    Every emitted token but a rejection-sampling correction is the verifier's own `choose`, in sequence order."""

    def scores_at(at: int) -> torch.Tensor:  # after the tokens emitted so far: processors read the sequence
        return pending if at == 0 else process_logits(row.processors, row.ids, logits[at])

    def emit(at: int, token: int, scores: torch.Tensor) -> bool:
        row.emit(token, scores, logits[at])
        return not row.finished

    path = walk(row.draft, rule, scores_at, emit)
    row.accepted = path.nodes
    row.stream(path.emitted)
    row.stats.record(drafted=len(row.draft), accepted=len(path.nodes), emitted=path.emitted)
    return path.kept


def _drop_finished(verifier: Verifier, active: list[_Row], rows: list[_Row]) -> list[_Row]:
    """The unfinished rows; finished ones leave the cache, so they stop costing work. Once every row of a batch whose
    rows do not stop alone has stopped, the batch ends where the last one stopped: longer rows are cut there."""
    if not rows[0].stops_alone and all(row.stopped_at is not None for row in rows):
        end = max(row.stopped_at for row in rows)
        for row in rows:  # a row may have run on to max_length and left already: it is cut too
            if row.ids.shape[1] >= end:
                row.cut(end)
            row.end = end
    keep = [row for row in active if not row.finished]
    if len(keep) < len(active) and keep:
        verifier.select_rows([row.index for row in keep])
        for b, row in enumerate(keep):
            row.index = row.ctx.row = b
    return keep


def _generator_seeded_from(generator: torch.Generator | None, device) -> torch.Generator:
    """A new generator on `generator`'s device (None: torch's global RNG, on `device`), seeded by one draw from it."""
    device = generator.device if generator is not None else torch.device(device)
    seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=device))
    return torch.Generator(device).manual_seed(seed)


def _seed_global_rng(source: torch.Generator, cuda_devices: list[int]) -> None:
    """Seed torch's global CPU RNG (and that of `cuda_devices`) by one draw from `source`."""
    seed = int(torch.randint(0, 2**62, (1,), generator=source, device=source.device))
    torch.random.default_generator.manual_seed(seed)
    for index in cuda_devices:
        torch.cuda.default_generators[index].manual_seed(seed)


def _private_copy(processors: LogitsProcessorList) -> LogitsProcessorList:
    """A deep copy of each processor (one that cannot be copied, e.g. holding a lock, is shared as it is)."""
    copies = LogitsProcessorList()
    for processor in processors:
        try:
            copies.append(copy.deepcopy(processor))
        except (TypeError, copy.Error, RuntimeError):
            copies.append(processor)
    return copies
