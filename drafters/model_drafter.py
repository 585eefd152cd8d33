"""Classic speculative decoding: a small causal LM with the verifier's vocabulary drafts token by token."""

from __future__ import annotations

import torch

from drafters.base import Draft, DraftContext, Drafter, common_prefix_length
from verifiers.verifier import Verifier


class ModelDrafter(Drafter):
    """Drafts autoregressively with any Hugging Face causal LM that shares the verifier's vocabulary.

    The drafter keeps its own KV cache across steps and, like the verifier, rolls it back to the
    longest prefix it shares with the committed sequence, so each step only feeds new tokens.
    """

    def __init__(self, model, tokenizer=None, max_draft_len: int = 16):
        self.lm = Verifier(model, role="drafter")  # the same "AR model + croppable cache" machinery the verifier uses
        self.vocab_size = self.lm.vocab_size
        self.tokenizer = tokenizer
        self.max_draft_len = max_draft_len
        self._fed = torch.empty(0, dtype=torch.long)  # tokens whose KV is in the drafter's cache

    def fork(self) -> ModelDrafter:
        return ModelDrafter(self.lm.model, self.tokenizer, self.max_draft_len)

    def reset(self, ctx: DraftContext) -> None:
        self._fed = torch.empty(0, dtype=torch.long)

    @torch.inference_mode()
    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        committed = ctx.input_ids[0].to(self.lm.model.device)
        if self.lm.max_positions is not None:  # a learned position table ends: draft only what it can embed
            max_tokens = min(max_tokens, self.lm.max_positions - committed.shape[0])
            if max_tokens < 1:
                return Draft.empty(ctx.input_ids.device)
        logits = self._catch_up(committed)
        tokens, probs, confidence = [], [], []
        prefix = ctx.input_ids
        for i in range(max_tokens):
            token, q = ctx.choose(logits, prefix)
            tokens.append(token)
            probs.append(q)
            confidence.append(float(q[token]))
            if i + 1 == max_tokens:
                break
            prefix = torch.cat([prefix, prefix.new_tensor([[token]])], dim=1)
            fed = committed.new_tensor([token])
            logits = self.lm.verify(fed[None])[-1]
            self._fed = torch.cat([self._fed, fed])
        device = ctx.input_ids.device
        draft_probs = torch.stack(probs).to(device) if ctx.do_sample and probs else None
        return Draft(
            torch.tensor(tokens, dtype=torch.long, device=device), draft_probs, torch.tensor(confidence, device=device)
        )

    def _catch_up(self, committed: torch.Tensor) -> torch.Tensor:
        """Bring the cache to `committed` (reusing the common prefix); return logits after its last token."""
        common = common_prefix_length(self._fed, committed[:-1])  # keep at least the last token to feed
        if common < self.lm.rollback_floor():  # recurrent states reach back only so far: read the sequence afresh
            common = 0
        if common == 0:
            logits = self.lm.prefill(committed[None], None, capacity=0)
        else:
            self.lm.rollback(len(self._fed) - common)
            logits = self.lm.verify(committed[None, common:])[-1]
        self._fed = committed.clone()
        return logits
