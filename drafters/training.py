"""Batches, losses and the held-out acceptance estimate for training drafters on verifier features.

Indexing used throughout: sequence tokens x[0..L-1]; greedy[p] = the verifier's argmax after x[:p+1].
An anchor at position a drafts block positions i = 1..B-1, whose target is greedy[a + i - 1]. That
target is exact (it is what greedy decoding would produce there) only while the text between follows
the verifier's greedy chain: position i is valid iff x[a+j] == greedy[a+j-1] for j = 1..i-1. On the
verifier's own generations every position is valid; on other text the valid spans are shorter.
The block for anchor a sees the verifier states of x[:a] only (the anchor's own state does not exist yet
at draft time) and its own B positions.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from drafters.distill import FeatureStore


def draft_vocabulary(store: FeatureStore, sequences: list[int], size: int) -> tuple[torch.Tensor, float]:
    """The `size` tokens the verifier predicts most often in the answers of `sequences`, and their coverage."""
    counts = np.zeros(int(store.top_ids.max()) + 1 if len(store) else 1, dtype=np.int64)
    for i in sequences:
        s = store.sequence(i)
        np.add.at(counts, s["greedy"][s["prompt_len"] :], 1)
    order = np.argsort(-counts, kind="stable")[:size]
    return torch.from_numpy(np.sort(order)).long(), float(counts[order].sum() / max(1, counts.sum()))


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """exp(-(i-1)/gamma) for block positions i = 1..B-1: early positions decide acceptance, weigh them most."""
    return torch.exp(-torch.arange(block_size - 1).float() / gamma)


def chain_valid(ids: np.ndarray, greedy: np.ndarray) -> np.ndarray:
    """on_chain[p] = x[p+1] == greedy[p] (the text continues the verifier's greedy chain after p)."""
    on = np.zeros(len(ids), dtype=bool)
    on[:-1] = ids[1:] == greedy[:-1]
    return on


def anchor_candidates(s: dict) -> np.ndarray:
    """Positions usable as anchors: inside the answer, on the greedy chain (as a drafted anchor always is)."""
    on = chain_valid(s["ids"], s["greedy"])
    a = np.arange(max(1, s["prompt_len"]), len(s["ids"]) - 1)
    return a[on[a - 1]]


def block_targets(s: dict, anchors: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(targets [A, B-1], valid [A, B-1], soft index rows [A, B-1]) of full-vocab greedy targets per anchor."""
    ids, greedy = s["ids"], s["greedy"]
    on = chain_valid(ids, greedy)
    L = len(ids)
    p = anchors[:, None] + np.arange(block_size - 1)[None]  # target rows
    inside = p <= L - 2  # keep targets inside the text (after EOS nothing is exact)
    pc = np.minimum(p, L - 1)
    # valid i needs on[a .. a+i-2] all true: a cumulative product along the block, shifted by one.
    prior = np.concatenate([np.ones((len(anchors), 1), bool), on[pc[:, :-1]]], axis=1)
    valid = np.cumprod(prior, axis=1).astype(bool) & inside
    return greedy[pc], valid, pc


class VocabMap:
    """Full-vocabulary ids -> draft-vocabulary indices (-1 outside)."""

    def __init__(self, draft_vocab: torch.Tensor, vocab_size: int):
        self.table = torch.full((vocab_size,), -1, dtype=torch.long)
        self.table[draft_vocab] = torch.arange(draft_vocab.shape[0])

    def __call__(self, ids) -> torch.Tensor:
        if isinstance(ids, torch.Tensor):  # np.array(tensor) goes through the deprecated __array__ path
            return self.table[ids.long().cpu()]
        return self.table[torch.from_numpy(np.array(ids, dtype=np.int64))]


def distill_loss(logits, targets, soft_ids, soft_probs, weights, hard_weight: float = 0.5) -> torch.Tensor:
    """Weighted mix of cross-entropy to the greedy target and to the verifier's top-k distribution.

    logits [N, V'] over the draft vocabulary; targets [N] (index, -1 = outside V'); soft_ids [N, K]
    (-1 = outside V') with soft_probs [N, K]; weights [N] (0 = not a valid position).
    """
    logp = F.log_softmax(logits.float(), dim=-1)
    hard = -logp.gather(1, targets.clamp(min=0)[:, None])[:, 0] * (targets >= 0)
    probs = soft_probs.float() * (soft_ids >= 0)
    probs = probs / probs.sum(-1, keepdim=True).clamp(min=1e-6)
    soft = -(probs * logp.gather(1, soft_ids.clamp(min=0))).sum(-1)
    per_position = hard_weight * hard + (1 - hard_weight) * soft
    return (per_position * weights).sum() / weights.sum().clamp(min=1e-6)


def accepted_lengths(predicted: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per anchor, how many leading predictions equal the (valid) targets: the greedy accepted length.

    The block positions are the last dimension: [..., B-1] in, [...] out."""
    hit = (predicted == targets) & valid
    return hit.long().cumprod(dim=-1).sum(dim=-1)


def lr_at(step: int, total: int, peak: float, warmup: int = 50) -> float:
    """Linear warm-up, then cosine to 10% of peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
