"""Drafters drafting together: the first proposes, the next ones fill in the rest."""

from __future__ import annotations

import torch

from drafters.base import Draft, DraftContext, Drafter
from drafters.tree import add_path


class ChainDrafter(Drafter):
    """Drafts with `sources` in turn: the first proposes, each next one continues the draft so far (`Drafter.fill`)
    up to its own reach, min(nodes asked, its `node_budget`); a source adds nothing (and does no work) to a draft
    that already has that many nodes or is already as deep as the source reaches (its `max_draft_len`).

    `hybrid.load_default()`'s drafter is `ChainDrafter([PromptLookupDrafter(...), BlockDiffusionDrafter(...)])`: the
    longest context match continued by the n-gram store, up to 16 tokens; where that is shorter than the block's 7,
    the block model fills the block in, given it, as a token tree below the lookup's chain. A lookup longer than the
    block is proposed whole.

    Its `vocab_size`, `tokenizer` and `hidden_layers` are its sources' (which must agree), its `max_draft_len`,
    `max_nodes` and `max_steps` the largest of theirs (each source runs at most its own); the rows of a batch are
    drafted source by source, each through the source's `fill_rows` (one forward for the block model). Its `stages`
    are its sources: a row whose context says `stages = n` is drafted by the first n alone, and each node's
    `Draft.stage` names its source.

    With `branch = k > 0` the last source also drafts from the committed sequence alone, and its first k tokens join
    the draft as a second path where they leave it (`drafters.tree.add_path`; nodes best first by the product of
    their confidences): where the earlier sources' tokens are wrong, the last one's own guess is verified beside
    them. Trees verify under the match rule only, so under `acceptance="rejection"` (ctx.do_sample) there is no
    branch.

    With `refill_below = c > 0`, a source that runs after others continues their draft from before its first node of
    confidence < c (a store token few of the verifier's answers continued that way), where that leaves it room: the
    later source redrafts the unsure tail, reading what came before it. A row drafted by the earlier sources alone
    keeps their whole draft.
    """

    def __init__(self, sources: list[Drafter], branch: int = 0, refill_below: float = 0.0):
        sources = tuple(sources)
        if not sources or not all(isinstance(s, Drafter) for s in sources):
            raise TypeError(f"ChainDrafter takes a non-empty list of drafters.Drafter, got {sources!r}")
        if not isinstance(branch, int) or isinstance(branch, bool) or branch < 0:
            raise ValueError(f"branch must be an int >= 0 (0: no branch), got {branch!r}")
        if branch and len(sources) < 2:
            raise ValueError("branch > 0 needs two sources or more: the last one branches off the draft of the others")
        if isinstance(refill_below, bool) or not isinstance(refill_below, (int, float)) or not 0 <= refill_below <= 1:
            raise ValueError(f"refill_below must be a confidence in [0, 1] (0: never refill), got {refill_below!r}")
        self.sources, self.branch, self.refill_below = sources, branch, float(refill_below)
        vocab_sizes = {s.vocab_size for s in sources if s.vocab_size is not None}
        layers = {tuple(s.hidden_layers) for s in sources if s.hidden_layers}
        if len(vocab_sizes) > 1:
            raise ValueError(f"the sources index different vocabularies: {sorted(vocab_sizes)}")
        if len(layers) > 1:
            raise ValueError(f"the sources read different verifier layers: {sorted(layers)}")
        self.vocab_size = next(iter(vocab_sizes), None)
        self.tokenizer = next((s.tokenizer for s in sources if s.tokenizer is not None), None)
        self.hidden_layers = next(iter(layers), ())
        self.max_draft_len = max(s.max_draft_len for s in sources)
        # A tree if any source grows one or the last branches: the most nodes any source reaches.
        trees = branch or any(s.max_nodes for s in sources)
        self.max_nodes = max(s.node_budget for s in sources) if trees else None
        self.max_steps = max(s.max_steps for s in sources)
        # Schedulers keep acceptance statistics per drafter: other sources, or other settings of one, are another.
        self.fingerprint = (
            " + ".join(f"{type(s).__name__}:{s.max_draft_len}:{getattr(s, 'fingerprint', '')}" for s in sources)
            + (f" | branch {branch}" if branch else "")
            + (f" | refill below {refill_below:g}" if refill_below else "")
        )

    @property
    def stages(self) -> tuple[Drafter, ...]:
        return self.sources

    def reset(self, ctx: DraftContext) -> None:
        for source in self.sources:
            source.reset(ctx)

    def finish(self, ctx: DraftContext) -> None:
        for source in self.sources:
            source.finish(ctx)

    def fork(self) -> ChainDrafter:
        return ChainDrafter([source.fork() for source in self.sources], self.branch, self.refill_below)

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        return self.propose_rows([self], [ctx], [max_tokens])[0]

    def propose_rows(self, drafters: list[Drafter], ctxs: list[DraftContext], max_tokens: list[int]) -> list[Draft]:
        drafts = [Draft.empty(ctx.input_ids.device) for ctx in ctxs]
        for i, source in enumerate(self.sources):
            reach = [min(k, source.node_budget) for k in max_tokens]
            depth = [min(k, source.max_draft_len) for k in max_tokens]
            runs = [ctx.stages is None or i < ctx.stages for ctx in ctxs]
            if i and self.refill_below:
                drafts = [self._unsure_tail_cut(d, n) if run else d for d, n, run in zip(drafts, depth, runs)]
            # A source continues a draft shallower than its reach, up to its node budget.
            rows = [
                r for r, draft in enumerate(drafts) if runs[r] and len(draft) < reach[r] and draft.depth() < depth[r]
            ]
            if rows:
                filled = source.fill_rows(
                    [drafters[r].sources[i] for r in rows],
                    [ctxs[r] for r in rows],
                    [drafts[r] for r in rows],
                    [reach[r] for r in rows],
                )
                for r, draft in zip(rows, filled):
                    drafts[r] = with_stage(draft, drafts[r], i)
        return self._branch(drafters, ctxs, drafts, max_tokens) if self.branch else drafts

    def _unsure_tail_cut(self, draft: Draft, depth: int) -> Draft:
        """A chain `draft` cut before its first node of confidence < `refill_below`, where the cut leaves it shallower
        than `depth` (the next source's reach); otherwise `draft`."""
        if draft.confidence is None or not draft.is_chain:
            return draft
        sure = sure_prefix_length(draft.confidence, self.refill_below)
        return draft.truncate(sure) if sure < min(depth, len(draft)) else draft

    def _branch(
        self, drafters: list[Drafter], ctxs: list[DraftContext], drafts: list[Draft], max_tokens: list[int]
    ) -> list[Draft]:
        """`drafts` with the last source's own first `branch` tokens grown in (see the class), cut to each row's
        `max_tokens` (a prefix of best-first nodes)."""
        last = len(self.sources) - 1
        source = self.sources[last]
        rows = [
            r
            for r, ctx in enumerate(ctxs)
            if not ctx.do_sample
            and (ctx.stages is None or last < ctx.stages)
            and max_tokens[r]
            and any(stage < last for stage in drafts[r].stage_list())  # else the draft is the last source's own
        ]
        if not rows:
            return drafts
        own = source.propose_rows(
            [drafters[r].sources[last] for r in rows],
            [ctxs[r] for r in rows],
            [min(self.branch, max_tokens[r], source.max_draft_len) for r in rows],
        )
        for r, path in zip(rows, own):
            drafts[r] = add_path(drafts[r], path, last).truncate(max_tokens[r])
        return drafts


def sure_prefix_length(confidence: torch.Tensor, refill_below: float) -> int:
    """How many leading nodes of a chain have confidence >= `refill_below`: where `ChainDrafter(refill_below=...)`
    cuts a draft for the next source to redraft (`drafters.training.estimate` replays the same rule offline)."""
    return int((confidence >= refill_below).cumprod(0).sum())


def with_stage(draft: Draft, given: Draft, stage: int) -> Draft:
    """`draft`, which starts with `given`, with its nodes past `given` marked as proposed by `stage`."""
    known = given.stage_list()[: len(draft)]
    stages = known + [stage] * (len(draft) - len(known))
    return Draft(
        draft.tokens,
        draft.probs,
        draft.confidence,
        draft.parents,
        torch.tensor(stages, dtype=torch.long, device=draft.tokens.device),
    )
