"""Batches: the tensors of one training step (and of the held-out estimate), read from the feature store.

Indexing used throughout: sequence tokens x[0..L-1]; greedy[p] = the verifier's argmax after x[:p+1].
An anchor at position a drafts block positions i = 1..B-1, whose target is greedy[a + i - 1]. That
target is exact (it is what greedy decoding would produce there) only while the text between follows
the verifier's greedy chain: position i is valid iff x[a+j] == greedy[a+j-1] for j = 1..i-1. On the
verifier's own generations every position is valid; on other text the valid spans are shorter.
The block for anchor a sees the verifier states of x[:a] only (the anchor's own state does not exist yet
at draft time) and its own B positions.
"""

from __future__ import annotations

import numpy as np
import torch


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


def block_batch(
    store, seq_ids, rng, anchors_per_seq, block_size, vmap, reveal_prob=0.0, anchors=None, reveal_scheme="prefix"
):
    """Tensors for one step: S sequences x A anchors x B block positions (the indexing above)."""
    seqs = [store.sequence(i) for i in seq_ids]
    S, A, B = len(seqs), anchors_per_seq, block_size
    width = max(len(s["ids"]) for s in seqs)
    on_device = isinstance(store.hidden, torch.Tensor)  # FeatureStore.move_hidden: gather where the states are
    hidden = torch.zeros(S, width, store.hidden.shape[1], device=store.hidden.device if on_device else "cpu")
    ids = torch.zeros(S, width, dtype=torch.long)
    anchor_pos = torch.zeros(S, A, dtype=torch.long)
    tokens = torch.zeros(S, A, B, dtype=torch.long)
    known = torch.zeros(S, A, B, dtype=torch.bool)
    targets = torch.full((S, A, B - 1), -1, dtype=torch.long)
    valid = torch.zeros(S, A, B - 1, dtype=torch.bool)  # stays False for anchor slots a short sequence leaves empty
    soft_ids = torch.full((S, A, B - 1, store.top_k), -1, dtype=torch.long)
    soft_probs = torch.zeros(S, A, B - 1, store.top_k)
    for row, s in enumerate(seqs):
        h = s["hidden"]
        ids[row, : len(s["ids"])] = torch.from_numpy(s["ids"].astype(np.int64))
        hidden[row, : len(s["ids"])] = h.float() if on_device else torch.from_numpy(np.asarray(h, dtype=np.float32))
        if anchors is None:
            cand = anchor_candidates(s)
            chosen = rng.choice(cand, size=min(A, len(cand)), replace=False) if len(cand) else cand
        else:
            chosen = np.asarray(anchors[row][:A])
        n = len(chosen)
        if not n:
            continue
        full, ok, rows = block_targets(s, chosen, B)
        anchor_pos[row, :n] = torch.from_numpy(chosen)
        tokens[row, :n, 0] = torch.from_numpy(s["ids"][chosen].astype(np.int64))
        tokens[row, :n, 1:] = torch.from_numpy(full.astype(np.int64))
        targets[row, :n] = vmap(full)
        valid[row, :n] = torch.from_numpy(ok)
        soft_ids[row, :n] = vmap(s["top_ids"][rows])
        soft_probs[row, :n] = torch.from_numpy(np.asarray(s["top_probs"][rows], dtype=np.float32))
    known[..., 0] = True
    if reveal_prob:  # some blocks see part of their answer, as a later denoising pass or a lookup prefix would
        known[..., 1:] = revealed(rng, valid, reveal_prob, reveal_scheme)
    weights_mask = valid & ~known[..., 1:]
    return dict(
        first_masked=known[..., 1:].int().cumprod(-1).sum(-1),
        hidden=hidden,
        ids=ids,
        anchors=anchor_pos,
        tokens=tokens,
        known=known,
        targets=targets,
        valid=valid,
        soft_ids=soft_ids,
        soft_probs=soft_probs,
        loss_mask=weights_mask,
        full_targets=tokens[..., 1:],
    )


REVEAL_SCHEMES = ("prefix", "mixed")


def revealed(rng, valid: torch.Tensor, reveal_prob: float, scheme: str) -> torch.Tensor:
    """Which drafted positions [S, A, B-1] a block is given (True), in a share `reveal_prob` of blocks.

    "prefix": positions 1..k, k uniform in 1..B-2, which is all a block is ever given at draft time (a lookup match
    or the leading run an earlier denoising pass fixed); "mixed": half prefixes, half random subsets. Only valid
    positions are revealed: their tokens are the exact greedy chain the rest must continue."""
    if scheme not in REVEAL_SCHEMES:
        raise ValueError(f"reveal scheme {scheme!r}: choose one of {', '.join(REVEAL_SCHEMES)}")
    S, A, n = valid.shape
    pos = torch.arange(1, n + 1)
    reveal = torch.from_numpy(rng.random((S, A)) < reveal_prob)
    if scheme == "prefix":
        if n < 2:  # a block of one drafted position has nothing left to predict once given one
            return torch.zeros_like(valid)
        k = torch.from_numpy(rng.integers(1, n, size=(S, A)))  # 1..n-1 given, at least one left to predict
        chosen = pos <= k[..., None]
    else:
        use_prefix = torch.from_numpy(rng.random((S, A)) < 0.5)
        cut = torch.from_numpy(rng.integers(1, n + 1, size=(S, A)))
        subset = torch.from_numpy(rng.random((S, A, n))) < torch.from_numpy(rng.random((S, A, 1)))
        chosen = torch.where(use_prefix[..., None], pos < cut[..., None], subset)
    return chosen & valid & reveal[..., None]


def ar_batch(store, seq_ids, vmap):
    """Tensors for one step of the AR baseline: whole sequences, a next-token target at every answer position."""
    seqs = [store.sequence(i) for i in seq_ids]
    width = max(len(s["ids"]) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    loss_mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    greedy = torch.full((len(seqs), width), -1, dtype=torch.long)
    soft_ids = torch.full((len(seqs), width, store.top_k), -1, dtype=torch.long)
    soft_probs = torch.zeros(len(seqs), width, store.top_k)
    for row, s in enumerate(seqs):
        n = len(s["ids"])
        ids[row, :n] = torch.from_numpy(s["ids"].astype(np.int64))
        mask[row, :n] = 1
        loss_mask[row, max(0, s["prompt_len"] - 1) : n - 1] = True  # every next-token target in the answer is exact
        greedy[row, :n] = torch.from_numpy(s["greedy"].astype(np.int64))
        soft_ids[row, :n] = vmap(s["top_ids"])
        soft_probs[row, :n] = torch.from_numpy(np.asarray(s["top_probs"], dtype=np.float32))
    return dict(
        ids=ids,
        mask=mask,
        loss_mask=loss_mask,
        full_targets=greedy,
        targets=vmap(greedy.clamp(min=0)),
        soft_ids=soft_ids,
        soft_probs=soft_probs,
    )


def to_device(batch: dict, device) -> dict:
    """The batch's tensors on `device`."""
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}
