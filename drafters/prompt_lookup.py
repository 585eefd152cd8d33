"""Prompt lookup: propose what followed the last occurrence of the current n-gram (no model at all), continued by
an n-gram store of the verifier's own answers if given one."""

from __future__ import annotations

from pathlib import Path

import torch

from drafters.base import Draft, DraftContext, Drafter
from drafters.block_diffusion import verifier_fingerprint
from drafters.ngram_store import NgramStore, check_store_fits


class PromptLookupDrafter(Drafter):
    """N-gram lookup in the prompt and the output so far (the idea of HF `prompt_lookup_num_tokens`).

    Tries the longest suffix n-gram first (`max_ngram` down to `min_ngram`) and copies the tokens that
    followed its most recent earlier occurrence. Deterministic, so its q is one-hot. Its confidence
    is n / (n + 1) for a match of n tokens (longer matches predict better; schedulers calibrate the
    number into an acceptance probability). With an `ngram_store` (the verifier's own training answers,
    `drafters.ngram_store`), the store continues the match (the n-gram ending the context and the match,
    n >= `store_min_n`), or stands in where there is none; with `prefer_store`, also where the match is a
    single token and the store's first share is at least that (`lookup_draft`). `min_ngram=0` looks for
    no match: the store alone. Given the `verifier` model, the store is checked to hold its answers.
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
    ):
        if not 0 <= min_ngram <= max_ngram or max_ngram < 1:
            raise ValueError(
                f"need 0 <= min_ngram <= max_ngram and max_ngram >= 1, got min_ngram={min_ngram}, max_ngram={max_ngram}"
            )
        if min_ngram == 0 and ngram_store is None:
            raise ValueError("min_ngram=0 (no context match) drafts from the store alone: it needs an ngram_store")
        if max_draft_len < 1:
            raise ValueError(f"max_draft_len must be >= 1, got {max_draft_len}")
        check_prefer_store(prefer_store, ngram_store)
        self.max_ngram, self.min_ngram, self.max_draft_len = max_ngram, min_ngram, max_draft_len
        self.ngram_store, self.store_min_n = NgramStore.load(ngram_store, store_min_n), store_min_n
        if self.ngram_store is not None and verifier is not None:
            check_store_fits(self.ngram_store, verifier_fingerprint(verifier))
        self.prefer_store = prefer_store
        # Schedulers keep acceptance statistics per drafter: other settings are another drafter.
        self.fingerprint = f"m{min_ngram}-{max_ngram}"
        if self.ngram_store is not None:  # the engine checks this vocabulary against the verifier's
            self.vocab_size = self.ngram_store.vocab_size
            self.fingerprint += f":ng{self.ngram_store.digest()}:n{store_min_n}:p{prefer_store}"

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        ids = ctx.input_ids[0]
        tokens, confidence = lookup_draft(
            ids, self.min_ngram, self.max_ngram, max_tokens, self.ngram_store, self.store_min_n, self.prefer_store
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """(up to `max_tokens` tokens to follow `ids` [n], their confidences) without a model: the longest suffix
    match in `ids` (min_ngram = 0: none), then `store`'s continuation of ids + that match.

    A match of n tokens has confidence n / (n + 1). With `prefer_store`, a match of a single token gives way to the
    store's own continuation when the store's first token has at least that share: on held-out answers a one-token
    match's first token is accepted about a quarter of the time, a confident store n-gram's far more often.
    """
    tokens, n = lookup_continuation(ids, min_ngram, max_ngram, max_tokens) if min_ngram else (ids.new_empty(0), 0)
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
