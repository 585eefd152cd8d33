"""Prompt lookup: propose what followed the last occurrence of the current n-gram (no model at all), or what followed
it in the verifier's earlier outputs (an online store), continued by an n-gram store of the verifier's own answers
if given one."""

from __future__ import annotations

import weakref
from pathlib import Path

import torch

from drafters.base import Draft, DraftContext, Drafter
from drafters.block_diffusion import verifier_fingerprint
from drafters.ngram_store import NgramStore, check_store_fits
from drafters.online_store import OnlineStore


class PromptLookupDrafter(Drafter):
    """N-gram lookup in the prompt and the output so far (the idea of HF `prompt_lookup_num_tokens`).

    Tries the longest suffix n-gram first (`max_ngram` down to `min_ngram`) and copies the tokens that
    followed its most recent earlier occurrence. Deterministic, so its q is one-hot. Its confidence
    is n / (n + 1) for a match of n tokens (longer matches predict better; schedulers calibrate the
    number into an acceptance probability). With an `ngram_store` (the verifier's own training answers,
    `drafters.ngram_store`), the store continues the match (the n-gram ending the context and the match,
    n >= `store_min_n`), or stands in where there is none; with `prefer_store`, also where the match is a
    single token and the store's first share is at least that (`lookup_draft`). `min_ngram=0` looks for
    no match: the store alone. The store is checked to hold the answers of the verifier it drafts for: the `verifier`
    model when given, and the verifier of every call (once per model).

    With an `online_store` (`drafters.online_store`), every sequence this drafter drafts for is recorded there as
    the engine commits it (at `reset` and each `propose`), and a match in those earlier outputs longer than the
    context's stands in for it (a repeated request drafts its earlier answer). The online store is checked against
    the verifier of every call. One drafter drafts one call at a time; concurrent calls each take a `fork()` (which
    shares the online store).
    """

    def __init__(
        self,
        max_ngram: int = 3,
        min_ngram: int = 1,
        max_draft_len: int = 10,
        ngram_store: NgramStore | str | Path | None = None,
        store_min_n: int = 2,
        prefer_store: float | None = None,
        verifier=None,
        online_store: OnlineStore | None = None,
    ):
        if not 0 <= min_ngram <= max_ngram or max_ngram < 1:
            raise ValueError(
                f"need 0 <= min_ngram <= max_ngram and max_ngram >= 1, got min_ngram={min_ngram}, max_ngram={max_ngram}"
            )
        if min_ngram == 0 and ngram_store is None and online_store is None:
            raise ValueError(
                "min_ngram=0 (no context match) drafts from a store alone: it needs an ngram_store or an online_store"
            )
        if online_store is not None and not isinstance(online_store, OnlineStore):
            raise TypeError(f"online_store must be a drafters.online_store.OnlineStore or None, got {online_store!r}")
        if max_draft_len < 1:
            raise ValueError(f"max_draft_len must be >= 1, got {max_draft_len}")
        check_prefer_store(prefer_store, ngram_store)
        self.max_ngram, self.min_ngram, self.max_draft_len = max_ngram, min_ngram, max_draft_len
        self.ngram_store, self.store_min_n = NgramStore.load(ngram_store, store_min_n), store_min_n
        self._store_checked = None  # the verifier model the n-gram store was last checked against (a weak reference)
        if verifier is not None:
            self._check_store(verifier)
        self.online_store = online_store
        if online_store is not None and verifier is not None:
            online_store.bind(verifier)
        self.prefer_store = prefer_store
        self._sequence, self._recorded, self._answer_start = None, 0, 0  # this call's sequence in the online store
        # Schedulers keep acceptance statistics per drafter: other settings are another drafter.
        self.fingerprint = f"m{min_ngram}-{max_ngram}"
        if self.ngram_store is not None:  # the engine checks this vocabulary against the verifier's
            self.vocab_size = self.ngram_store.vocab_size
            self.fingerprint += f":ng{self.ngram_store.digest()}:n{store_min_n}:p{prefer_store}"
        if online_store is not None:  # its contents grow, its kind does not: one drafter for the scheduler
            self.fingerprint += f":online{online_store.max_match}"

    def _check_store(self, model) -> None:
        """Refuse an n-gram store built from another verifier's answers (a store that records no verifier passes)."""
        if self.ngram_store is None or not self.ngram_store.verifier:
            return
        if self._store_checked is not None and self._store_checked() is model:
            return
        check_store_fits(self.ngram_store, verifier_fingerprint(model))
        self._store_checked = weakref.ref(model)

    def reset(self, ctx: DraftContext) -> None:
        if ctx.verifier is not None:
            self._check_store(ctx.verifier.model)
        if self.online_store is None:
            return
        if ctx.verifier is not None:
            self.online_store.bind(ctx.verifier.model)
        # The engine resets after the prefill: the last token is the verifier's first, the ones before it the prompt.
        self._sequence = self.online_store.new_sequence()
        self._recorded = self._answer_start = ctx.input_ids.shape[1] - 1
        self._record(ctx)

    def finish(self, ctx: DraftContext) -> None:
        if self.online_store is not None:
            self._record(ctx)  # the steps the scheduler did not draft at committed tokens too

    def _record(self, ctx: DraftContext) -> list[int]:
        """Give the online store the tokens the engine committed since the last call (all of them the verifier's);
        returns the committed sequence."""
        ids = ctx.input_ids[0].tolist()
        if self._sequence is not None:
            self.online_store.add(self._sequence, ids, self._recorded, self._answer_start)
            self._recorded = len(ids)
        return ids

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        ids = ctx.input_ids[0]
        online = None
        if self.online_store is not None:
            online = self.online_store.lookup(self._record(ctx), max_tokens)
        tokens, confidence = lookup_draft(
            ids,
            self.min_ngram,
            self.max_ngram,
            max_tokens,
            self.ngram_store,
            self.store_min_n,
            self.prefer_store,
            online,
        )
        return Draft(tokens, confidence=confidence)


def lookup_draft(
    ids: torch.Tensor,
    min_ngram: int,
    max_ngram: int,
    max_tokens: int,
    store: NgramStore | None = None,
    store_min_n: int = 2,
    prefer_store: float | None = None,
    online: tuple[list[int], int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(up to `max_tokens` tokens to follow `ids` [n], their confidences) without a model: the longest suffix
    match in `ids` (min_ngram = 0: none), or `online`, an online store's (tokens, match length) for `ids`, where that
    match is longer; then `store`'s continuation of ids + those tokens.

    A match of n tokens has confidence n / (n + 1). With `prefer_store`, a match of a single token gives way to the
    store's own continuation when the store's first token has at least that share: on held-out answers a one-token
    match's first token is accepted about a quarter of the time, a confident store n-gram's far more often.
    """
    tokens, n = lookup_continuation(ids, min_ngram, max_ngram, max_tokens) if min_ngram else (ids.new_empty(0), 0)
    if online is not None and online[1] > n:
        tokens, n = ids.new_tensor(online[0]), online[1]
    if store is None:
        return tokens, torch.full(tokens.shape, n / (n + 1))
    recent = ids[-store.max_n :].tolist()
    if n == 1 and prefer_store is not None:
        first = store.next_token(recent, store_min_n)  # (token, share, n): decide on it before chaining the rest
        if first is not None and first[1] >= prefer_store:
            own, shares = store.continuation(recent, max_tokens, store_min_n)
            return ids.new_tensor(own), torch.tensor(shares)
    confidence = torch.full(tokens.shape, n / (n + 1))
    if tokens.shape[0] < max_tokens:
        more, shares = store.continuation(recent + tokens.tolist(), max_tokens - tokens.shape[0], store_min_n)
        tokens = torch.cat([tokens, ids.new_tensor(more)])
        confidence = torch.cat([confidence, torch.tensor(shares)])
    return tokens, confidence


def check_prefer_store(prefer_store: float | None, store) -> None:
    """`prefer_store` (see `lookup_draft`) is a share, and only means something with a store."""
    if prefer_store is not None and (store is None or not 0.0 <= prefer_store <= 1.0):
        raise ValueError(f"prefer_store={prefer_store!r} needs an ngram_store and a share in [0, 1]")


def lookup_continuation(ids: torch.Tensor, min_ngram: int, max_ngram: int, max_tokens: int) -> tuple[torch.Tensor, int]:
    """(tokens that followed the most recent earlier match of the longest matching suffix n-gram of `ids` [n],
    min_ngram <= n <= max_ngram, and that n); no match gives no tokens and n = 0.

    Every earlier occurrence of the last token is a candidate; its match length is how far the tokens before it
    agree with the tokens before the last one (capped at `max_ngram`). Long caps pay: of several 3-token matches,
    the one that agrees over 20 tokens is usually the passage being repeated.
    """
    length = ids.shape[0]
    # Candidates end at j <= length - 2: each has at least one token after it, and the suffix is never its own match.
    ends = (ids[: length - 1] == ids[-1]).nonzero()[:, 0]
    if ends.numel() == 0:
        return ids.new_empty(0), 0
    back = torch.arange(min(max_ngram, length - 1), device=ids.device)
    before = ends[:, None] - back  # [candidates, n]: positions j, j - 1, ... of each candidate
    agree = (before >= 0) & (ids[before.clamp(min=0)] == ids[length - 1 - back])
    matched = agree.long().cumprod(dim=1).sum(dim=1)  # [candidates]: suffix tokens matched
    n = int(matched.max())
    if n < min_ngram:
        return ids.new_empty(0), 0
    start = int(ends[matched == n][-1]) + 1  # the most recent of the longest
    return ids[start : start + max_tokens], n
