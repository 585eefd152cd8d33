"""Prompt lookup: propose what followed the last occurrence of the current n-gram (no model at all)."""

from __future__ import annotations

from pathlib import Path

import torch

from drafters.base import Draft, DraftContext, Drafter
from drafters.ngram_store import NgramStore


class PromptLookupDrafter(Drafter):
    """N-gram lookup in the prompt and the output so far (the idea of HF `prompt_lookup_num_tokens`).

    Tries the longest suffix n-gram first (`max_ngram` down to `min_ngram`) and copies the tokens that
    followed its most recent earlier occurrence. Deterministic, so its q is one-hot. Its confidence
    is the matched n-gram's share of max_ngram + 1 (longer matches predict better; schedulers
    calibrate the number into an acceptance probability). With an `ngram_store` (the verifier's own
    training answers, `drafters.ngram_store`), the store continues the match, or stands in where there is none.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_draft_len: int = 10,
                 ngram_store: NgramStore | str | Path | None = None, store_min_n: int = 2):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        if max_draft_len < 1:
            raise ValueError(f"max_draft_len must be >= 1, got {max_draft_len}")
        self.max_ngram, self.min_ngram, self.max_draft_len = max_ngram, min_ngram, max_draft_len
        self.ngram_store, self.store_min_n = NgramStore.load(ngram_store, store_min_n), store_min_n
        if self.ngram_store is not None:  # the engine checks this vocabulary against the verifier's
            self.vocab_size, self.fingerprint = self.ngram_store.vocab_size, f"ng{self.ngram_store.digest()}:n{store_min_n}"

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        ids = ctx.input_ids[0, ctx.num_padding :]
        tokens, confidence = lookup_draft(ids, self.min_ngram, self.max_ngram, max_tokens, self.ngram_store, self.store_min_n)
        return Draft(tokens, confidence=confidence)


def lookup_draft(ids: torch.Tensor, min_ngram: int, max_ngram: int, max_tokens: int, store: NgramStore | None = None,
                 store_min_n: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """(up to `max_tokens` tokens to follow `ids` [n], their confidences) without a model: the longest suffix
    match in `ids` (min_ngram = 0: none), then `store`'s continuation of ids + that match."""
    tokens, n = lookup_continuation(ids, min_ngram, max_ngram, max_tokens) if min_ngram else (ids.new_empty(0), 0)
    confidence = torch.full(tokens.shape, n / (max_ngram + 1))
    if store is not None and tokens.shape[0] < max_tokens:
        recent = ids[-store.max_n :].tolist() + tokens.tolist()
        more, shares = store.continuation(recent, max_tokens - tokens.shape[0], store_min_n)
        tokens = torch.cat([tokens, ids.new_tensor(more)])
        confidence = torch.cat([confidence, torch.tensor(shares)])
    return tokens, confidence


def lookup_continuation(ids: torch.Tensor, min_ngram: int, max_ngram: int, max_tokens: int) -> tuple[torch.Tensor, int]:
    """(tokens that followed the most recent earlier match of the longest matching suffix n-gram of `ids` [n],
    that n-gram's length); no match gives no tokens and n = 0."""
    for n in range(min(max_ngram, ids.shape[0] - 1), min_ngram - 1, -1):
        # Windows over ids[:-1] start at j <= len - 1 - n: each match has at least one token after it,
        # and the suffix itself is never its own match.
        windows = ids[:-1].unfold(0, n, 1)
        hits = (windows == ids[-n:]).all(dim=1).nonzero()
        if hits.numel():
            start = int(hits[-1]) + n
            return ids[start : start + max_tokens], n
    return ids.new_empty(0), 0
