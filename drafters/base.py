"""The drafter interface: what the engine gives a drafter each step and what it expects back.

A drafter proposes tokens that continue the committed sequence. It may be anything: an AR model
drafting one token at a time, an n-gram lookup, or a block model that fills a whole block in one
parallel pass conditioned on the verifier's hidden states. The engine never trusts it: every draft
is validated, and the acceptance rule makes the output the verifier's own whatever is proposed.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from verifiers.logits import process_logits

if TYPE_CHECKING:
    from verifiers.verifier import Verifier


@dataclass
class Draft:
    """A proposal: a chain of tokens to follow the committed sequence, or a tree of them.

    tokens: LongTensor [k], k <= the `max_tokens` the engine asked for (k = 0 is a valid "no idea").
    parents: LongTensor [k] or None. Node i continues node parents[i] (< i), or the pending token (the one the
            verifier just chose) where parents[i] = -1. None is a chain: node i continues node i - 1. The
            verifier scores every node in one forward and the engine walks from the pending token to the child
            equal to the verifier's choice, and on. Nodes are best first: the scheduler verifies a prefix of
            them (any prefix of a parent-before-child order is a tree).
    probs:  float tensor [k, vocab] or None. Row i is the distribution token i was drawn from, given
            the committed sequence and the tokens before it (rejection sampling needs the true proposal
            distribution; that rule verifies chains only). None means the proposal is deterministic.
    confidence: float tensor [k] or None: the drafter's own belief that node i is what the verifier will
            choose once its parent was (e.g. its probability of the token). Schedulers calibrate it into
            acceptance probabilities; it never affects correctness.
    stage:  LongTensor [k] or None: which of the drafter's `Drafter.stages` proposed node i (None: the first).
            A stage's nodes never parent an earlier stage's, so the nodes of stages < s are the draft those
            stages alone would have made (a later stage's may come before them in best-first order):
            schedulers learn from it what each stage adds.
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None = None
    confidence: torch.Tensor | None = None
    parents: torch.Tensor | None = None
    stage: torch.Tensor | None = None

    @staticmethod
    def empty(device: torch.device | str = "cpu") -> Draft:
        return Draft(torch.empty(0, dtype=torch.long, device=device))

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def truncate(self, k: int) -> Draft:
        """The first k nodes (a tree still: parents come first)."""
        cut = lambda t: None if t is None else t[:k]  # noqa: E731
        return Draft(self.tokens[:k], cut(self.probs), cut(self.confidence), cut(self.parents), cut(self.stage))

    @property
    def is_chain(self) -> bool:
        if self.parents is None:
            return True
        return bool((self.parents == torch.arange(-1, len(self) - 1, device=self.parents.device)).all())

    def parent_list(self) -> list[int]:
        """parents as Python ints (a chain's spelled out)."""
        return list(range(-1, len(self) - 1)) if self.parents is None else self.parents.tolist()

    def depths(self) -> list[int]:
        """Tokens from the pending one to each node: 1 for its children."""
        depths: list[int] = []
        for parent in self.parent_list():
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return depths

    def depth(self) -> int:
        """The longest path's length: the most tokens the draft can add in one step."""
        return max(self.depths(), default=0)

    def keep(self, nodes: list[int]) -> Draft:
        """The sub-draft of `nodes` in that order (each node's parent among them and before it, or the pending
        token), renumbered."""
        index = {node: i for i, node in enumerate(nodes)}
        parents = self.parent_list()
        if any(parents[n] >= 0 and index.get(parents[n], len(nodes)) >= index[n] for n in nodes):
            raise ValueError(f"nodes {nodes} leave out a parent of one of them or put it after its child")
        at = torch.tensor(nodes, dtype=torch.long, device=self.tokens.device)
        pick = lambda t: None if t is None else t[at.to(t.device)]  # noqa: E731
        renumbered = torch.tensor([index.get(parents[n], -1) for n in nodes], dtype=torch.long)
        return Draft(
            self.tokens[at],
            pick(self.probs),
            pick(self.confidence),
            renumbered.to(self.tokens.device),
            pick(self.stage),
        ).chain_or_tree()

    def best_chain(self) -> Draft:
        """The path that always takes a node's first child: the draft's best chain, for verifiers that take no tree
        mask (the output is the same; only fewer tokens may be accepted)."""
        if self.parents is None:
            return self
        parents, path, last = self.parent_list(), [], -1
        for node, parent in enumerate(parents):
            if parent == last:
                path.append(node)
                last = node
        return self.keep(path)

    def chain_or_tree(self) -> Draft:
        """This draft with parents=None if it is a chain (the form chain-only code expects)."""
        if self.parents is not None and self.is_chain:
            return Draft(self.tokens, self.probs, self.confidence, None, self.stage)
        return self

    def stage_list(self) -> list[int]:
        """stage as Python ints (None spelled out: every node the first stage's)."""
        return [0] * len(self) if self.stage is None else self.stage.tolist()


# Warpers that rescale or cut the tail of a distribution but never reorder the tokens they keep.
_ORDER_KEEPING = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper)


@dataclass
class DraftContext:
    """What a drafter may read while proposing. Built by the engine once per `generate` call.

    input_ids:    [1, n] the committed sequence as the verifier attends to it (the prompt's padding and
                  masked tokens left out, so position p is input_ids[0, p]); the last token is the one
                  the verifier just chose, whose successors are to be drafted. A copy, new each step.
    do_sample:    whether to sample the draft and report its probs: only under the rejection rule
                  (`acceptance="rejection"`). Under the default rule a drafter proposes its best guesses,
                  since the verifier keeps a token iff it equals its own draw.
    processors:   the logits processors/warpers the verifier's scores go through, as this drafter's own copy
                  (calling or changing them leaves the verifier's untouched).
    generator:    the random generator to sample with: under the rejection rule one of this row's own, seeded
                  from the caller's RNG; else None (torch's global RNG, forked by the engine around each draft).
    verifier:     the `verifiers.Verifier` whose cache holds this row (None: no verifier, so no states).
                  A drafter reads it only through the methods below.
    row:          this sequence's row in the verifier's batch.
    steps:        denoising passes the scheduler chose for this step (1..`Drafter.max_steps`); None
                  outside the engine (then a drafter uses its own setting).
    stages:       how many of `Drafter.stages` run this step, the first ones (the scheduler's choice); None:
                  all. A drafter of several stages runs only those.

    What a drafter may read of the verifier and keep beside it:
        hidden_states():   the states of the layers it asked for (`Drafter.hidden_layers`) for
                           input_ids[:, :-1], never beyond.
        side_buffer(name, per_token, dtype, device): its own per-token state [rows, capacity, *per_token]
                           in the verifier's cache, slot p for position p, allocated on first use; row r's
                           slots 0 .. side_length(name) - 1 are valid for ctx.row = r. A rollback cuts that
                           length back, finished rows leave it, and it grows with the cache, all as the
                           verifier's own keys/values: a drafter only writes the slots it computes and calls
                           mark_computed(name, n). Fetch it each draft (growth replaces the tensor).
        static:            whether the verifier runs the static-shape path (one shape at every step: a
                           drafter's forward should read all `capacity` slots through a mask then).
        compiled(module):  `module` compiled as the verifier's step is (static path), or `module` itself.
    """

    input_ids: torch.Tensor
    do_sample: bool
    processors: LogitsProcessorList
    generator: torch.Generator | None
    verifier: Verifier | None
    row: int = 0
    steps: int | None = None
    stages: int | None = None

    def hidden_states(self) -> torch.Tensor | None:
        """[1, n, len(hidden_layers) * hidden] for the committed tokens but the last (None: none kept)."""
        return None if self.verifier is None else self.verifier.hidden_states(self.row)

    def side_buffer(self, name: str, per_token: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
        """The per-token side buffer `name` of every row of the batch, [rows, capacity, *per_token] (see above)."""
        return self._cache().side_buffer(name, per_token, dtype, device)

    def side_length(self, name: str) -> int:
        """Tokens of this row whose state side buffer `name` holds (0 before the first `mark_computed`)."""
        return self._cache().side_length(name, self.row)

    def mark_computed(self, name: str, length: int) -> None:
        """Side buffer `name` now holds this row's state for its first `length` tokens (at most the cached ones)."""
        self._cache().mark_computed(name, self.row, length)

    @property
    def static(self) -> bool:
        return self.verifier is not None and self.verifier.static

    @property
    def reorders(self) -> bool:
        """Whether the processors may change how tokens rank by their raw logits (a greedy guess taken from the raw
        logits would then differ from the processed one). Sampling's temperature, top-k, top-p and min-p keep the
        order, so under them a drafter's best guesses are its raw top tokens, with no per-position processing."""
        return any(not isinstance(p, _ORDER_KEEPING) for p in self.processors)

    def compiled(self, module):
        return module if self.verifier is None else self.verifier.compiled(module)

    def _cache(self):
        if self.verifier is None or self.verifier.cache is None:
            raise ValueError("this context has no verifier cache to keep side state in: draft through hybrid.generate")
        return self.verifier.cache

    def choose(self, logits: torch.Tensor, prefix_ids: torch.Tensor) -> tuple[int, torch.Tensor]:
        """Pick a draft token from a drafter's logits [vocab] at the position after `prefix_ids` [1, m].

        The logits go through the verifier's own processors so the proposal lives in the same space
        as the verifier's distribution. Returns the token and q = softmax(processed logits): greedy
        takes q's argmax, sampling draws from q (report q as `Draft.probs` then).
        """
        q = torch.softmax(process_logits(self.processors, prefix_ids, logits.float()), dim=-1)
        if not self.do_sample:
            return int(q.argmax()), q
        return int(torch.multinomial(q, 1, generator=self.generator)), q


class Drafter:
    """Base class for drafters. Subclass it and implement `propose`; override `reset` if you keep state.

    A drafter that can continue tokens proposed before it (in a `drafters.ChainDrafter`, after a lookup)
    overrides `fill`; the default continues nothing.

    Class attributes a subclass may set:
        vocab_size:    the vocabulary its token ids index; checked against the verifier's (None: any).
        tokenizer:     its tokenizer, if known; checked against the tokenizer passed to `generate`.
        hidden_layers: verifier hidden-state layers to keep for it (0 = embeddings, i = layer i).
        max_draft_len: the most tokens it can add in one step: a chain's length, a tree's depth.
        max_nodes:     the most nodes of a tree it proposes (None: it proposes chains, of max_draft_len).
        max_steps:     the most denoising passes it can run per draft (1 for one-pass drafters); the
                       scheduler picks 1..max_steps each step and the engine passes it as `ctx.steps`.
    """

    vocab_size: int | None = None
    tokenizer = None
    hidden_layers: tuple[int, ...] = ()
    max_draft_len: int = 16
    max_nodes: int | None = None
    max_steps: int = 1

    @property
    def stages(self) -> tuple[Drafter, ...]:
        """The drafters this one runs in turn, cheapest first, each continuing the draft so far: the scheduler may
        run only the first few (`DraftContext.stages`). A single drafter is one stage, itself."""
        return (self,)

    @property
    def pass_stages(self) -> frozenset[int]:
        """Indices into `stages` of those that run several denoising passes: the only ones whose drafts the passes
        the scheduler picks can change (a block model's; a lookup's never)."""
        return frozenset(i for i, stage in enumerate(self.stages) if stage.max_steps > 1)

    @property
    def node_budget(self) -> int:
        """The most nodes one draft may have: `max_nodes` for a tree drafter, else `max_draft_len` (a chain's)."""
        return self.max_draft_len if self.max_nodes is None else self.max_nodes

    def reset(self, ctx: DraftContext) -> None:
        """Called once per `generate` call, after the prefill and before the first `propose`."""

    def finish(self, ctx: DraftContext) -> None:
        """Called once per `generate` call and row, after its last step, with `ctx.input_ids` its whole committed
        sequence. The scheduler may skip drafting at any step, so a drafter that learns from what was committed
        must not count on `propose` having seen every token."""

    def fork(self) -> Drafter:
        """A drafter for another row of a batch: shares the weights, keeps its own per-sequence state.

        The default is a shallow copy, right for state that `reset` assigns afresh; override it when
        state lives in objects `__init__` creates (as `ModelDrafter`'s cache does).
        """
        return copy.copy(self)

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        """Return a draft of at most `max_tokens` tokens (tree nodes) to follow `ctx.input_ids`."""
        raise NotImplementedError

    def propose_rows(self, drafters: list[Drafter], ctxs: list[DraftContext], max_tokens: list[int]) -> list[Draft]:
        """Drafts for several rows of a batch at once, row r by `drafters[r]` (this drafter or one of its forks),
        asked by the engine on the drafter passed to `generate`. The default asks each row on its own; a drafter
        whose model can serve the rows in one forward overrides it (`BlockDiffusionDrafter` does)."""
        return [drafter.propose(ctx, k) for drafter, ctx, k in zip(drafters, ctxs, max_tokens)]

    def fill(self, ctx: DraftContext, given: Draft, max_tokens: int) -> Draft:
        """A draft of at most `max_tokens` tokens that starts with `given`, tokens another drafter proposed to
        follow `ctx.input_ids` (0 <= len(given) < max_tokens <= max_draft_len). Given tokens stay as they are,
        with their probs (None: deterministic) and confidences; the default adds none after them."""
        return self.propose(ctx, max_tokens) if len(given) == 0 else given

    def fill_rows(
        self, drafters: list[Drafter], ctxs: list[DraftContext], givens: list[Draft], max_tokens: list[int]
    ) -> list[Draft]:
        """`fill` for several rows of a batch, as `propose_rows` is `propose`'s (rows given nothing at all go through
        `propose_rows`, so a drafter that batches there batches here; else each row on its own, in row order)."""
        if not any(len(given) for given in givens):
            return self.propose_rows(drafters, ctxs, max_tokens)
        return [drafter.fill(ctx, given, k) for drafter, ctx, given, k in zip(drafters, ctxs, givens, max_tokens)]


class NoDrafter(Drafter):
    """Proposes nothing: every step verifies the pending token alone, i.e. plain decoding (`drafter=None`)."""

    max_draft_len = 0

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        return Draft.empty(ctx.input_ids.device)


def common_prefix_length(a: torch.Tensor, b: torch.Tensor) -> int:
    """Length of the longest common prefix of token ids a and b (1-D): how much of a drafter's cache,
    built for `a`, still holds for `b` after the verifier rolled back and went on differently."""
    n = min(a.shape[0], b.shape[0])
    diff = (a[:n].cpu() != b[:n].cpu()).nonzero()
    return int(diff[0]) if diff.numel() else n


def check_same_verifier(expected: dict, actual: dict, problem: str, fix: str) -> None:
    """Raise `ValueError("{problem} (key a != b, ...): {fix}")` when two verifier fingerprints differ."""
    if expected != actual:
        diffs = ", ".join(
            f"{key} {expected.get(key)!r} != {actual.get(key)!r}"
            for key in sorted(set(expected) | set(actual))
            if expected.get(key) != actual.get(key)
        )
        raise ValueError(f"{problem} ({diffs}): {fix}")


class DraftError(ValueError):
    """A drafter broke its contract (wrong shape, token outside the vocabulary, bad probabilities)."""


def check_draft(draft: Draft, max_tokens: int, vocab_size: int, drafter_name: str) -> Draft:
    """Validate a draft before anything of it reaches the verifier. Returns it with probs in float32."""
    where = f"{drafter_name}.propose"
    if not isinstance(draft, Draft):
        raise DraftError(f"{where} returned {type(draft).__name__}; it must return a drafters.Draft")
    tokens = draft.tokens
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or tokens.dtype not in (torch.long, torch.int32):
        got = f"{tuple(tokens.shape)} {tokens.dtype}" if isinstance(tokens, torch.Tensor) else type(tokens).__name__
        raise DraftError(f"{where} returned tokens {got}; expected a 1-D LongTensor of at most {max_tokens} ids")
    k = tokens.shape[0]
    if k > max_tokens:
        raise DraftError(f"{where} returned {k} tokens but at most {max_tokens} were asked for")
    if k and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        raise DraftError(
            f"{where} returned token id {int(tokens.max()) if int(tokens.min()) >= 0 else int(tokens.min())} "
            f"outside the verifier's vocabulary [0, {vocab_size})"
        )
    parents = draft.parents
    if parents is not None:
        if not isinstance(parents, torch.Tensor) or tuple(parents.shape) != (k,) or parents.is_floating_point():
            shape = tuple(parents.shape) if isinstance(parents, torch.Tensor) else type(parents).__name__
            raise DraftError(f"{where} returned parents {shape}; expected a ({k},) integer tensor or None (a chain)")
        bad = (parents < -1) | (parents >= torch.arange(k, device=parents.device))
        if k and bool(bad.any()):
            node = int(bad.nonzero()[0])
            raise DraftError(
                f"{where} returned parent {int(parents[node])} for node {node}: a node's parent is an earlier "
                "node, or -1 for the pending token"
            )
        parents = parents.long()
    confidence = draft.confidence
    if confidence is not None:
        if not isinstance(confidence, torch.Tensor) or tuple(confidence.shape) != (k,):
            shape = tuple(confidence.shape) if isinstance(confidence, torch.Tensor) else type(confidence).__name__
            raise DraftError(f"{where} returned confidence {shape}; expected ({k},) or None")
        confidence = confidence.float()
        if k and not bool(torch.isfinite(confidence).all()):
            node = int((~torch.isfinite(confidence)).nonzero()[0])
            raise DraftError(
                f"{where} returned confidence {float(confidence[node])} for node {node}: confidences are finite "
                "beliefs in [0, 1] (or confidence=None)"
            )
    stage = draft.stage
    if stage is not None:
        if not isinstance(stage, torch.Tensor) or tuple(stage.shape) != (k,) or stage.is_floating_point():
            shape = tuple(stage.shape) if isinstance(stage, torch.Tensor) else type(stage).__name__
            raise DraftError(f"{where} returned stage {shape}; expected a ({k},) integer tensor or None")
        stage = stage.long()
    probs = draft.probs
    if probs is None:
        return Draft(tokens.long(), None, confidence, parents, stage).chain_or_tree()
    if not isinstance(probs, torch.Tensor) or tuple(probs.shape) != (k, vocab_size):
        shape = tuple(probs.shape) if isinstance(probs, torch.Tensor) else type(probs).__name__
        raise DraftError(f"{where} returned probs {shape}; expected ({k}, {vocab_size}) or None")
    probs = probs.float()
    bad = ~torch.isfinite(probs) | (probs < 0)
    if k and bool(bad.any()):
        node, token = (int(i) for i in bad.nonzero()[0])
        raise DraftError(
            f"{where} returned probs[{node}, {token}] = {float(probs[node, token])}: each row of probs is a "
            "distribution (finite, non-negative entries summing to 1)"
        )
    if k and bool(((probs.sum(-1) - 1).abs() > 1e-3).any()):
        raise DraftError(f"{where} returned probs whose rows do not sum to 1")
    if k and bool((probs.gather(1, tokens.long()[:, None]) <= 0).any()):
        raise DraftError(f"{where} proposed a token its own probs give probability 0")
    return Draft(tokens.long(), probs, confidence, parents, stage).chain_or_tree()
