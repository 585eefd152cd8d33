"""The oracle: proposes a known continuation at zero cost. With the verifier's own greedy output it
measures the ceiling of speculative decoding for a verifier on a machine."""

from __future__ import annotations

import torch

from drafters.base import Draft, DraftContext, Drafter


class OracleDrafter(Drafter):
    """Proposes the continuation of `sequence` [1, n] (prompt + answer) while the committed text follows it."""

    def __init__(self, sequence: torch.Tensor, max_draft_len: int = 16):
        self.sequence = sequence.reshape(-1)
        self.max_draft_len = max_draft_len

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        committed = ctx.input_ids[0]
        n = committed.shape[0]
        if n >= self.sequence.shape[0] or not torch.equal(committed, self.sequence[:n].to(committed.device)):
            return Draft.empty(committed.device)
        return Draft(self.sequence[n : n + max_tokens].to(committed.device))
