"""The held-out acceptance estimate: tau of one greedy draft per held-out anchor, without decoding.

What training logs every --eval-every steps and what experiments.heldout prints: per anchor on the verifier's
greedy chain, the accepted length of one draft of block_size - 1 tokens (a block drafter's, the AR baseline's
or prompt lookup's) against the verifier's greedy continuation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from drafters.composite import sure_prefix_length
from drafters.prompt_lookup import lookup_draft
from drafters.training.batches import VocabMap, anchor_candidates, ar_batch, block_batch, block_targets, to_device
from drafters.training.models import ar_forward, block_forward

if TYPE_CHECKING:
    from drafters.training.distill import FeatureStore


@dataclass(frozen=True)
class ScoringSettings:
    """What one held-out estimate scores, and on what: a drafter (`arch` "block", which a DFlash drafter drafts as,
    or "ar"; its `model`, the verifier's frozen `embed` and `head` over its `vocab`, `vmap`, its `block_size`) on the
    held-out `anchors` of `store` (`held_out_anchors`), `chunk_size` sequences a forward, on `device`."""

    model: torch.nn.Module
    embed: torch.nn.Module
    head: torch.nn.Module
    vocab: torch.Tensor
    vmap: VocabMap
    block_size: int
    store: FeatureStore
    anchors: list[tuple[int, np.ndarray]]
    arch: str = "block"
    device: str | torch.device = "cpu"
    chunk_size: int = 4


def accepted_lengths(predicted: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per anchor, how many leading predictions equal the (valid) targets: the greedy accepted length.

    The block positions are the last dimension: [..., B-1] in, [...] out."""
    hit = (predicted == targets) & valid
    return hit.long().cumprod(dim=-1).sum(dim=-1)


def held_out_anchors(store, held, per_seq: int, seed: int) -> list[tuple[int, np.ndarray]]:
    """(sequence, sorted anchors): up to `per_seq` anchors drawn (seeded) in each held-out sequence."""
    rng = np.random.default_rng(seed)
    out = []
    for i in held:
        cand = anchor_candidates(store.sequence(i))
        if len(cand):
            out.append((i, np.sort(rng.choice(cand, size=min(per_seq, len(cand)), replace=False))))
    return out


def greedy_block_drafts(model, embed, head, vocab, batch, passes: int = 1) -> torch.Tensor:
    """Greedy drafts [S, A, B-1] (full-vocabulary ids) of a `block_batch`'s anchors after `passes` denoising passes,
    each after the first with the first still-masked position fixed to the model's own prediction (what
    `BlockDiffusionDrafter` drafts with threshold 1; positions the batch gives as known stay as they are)."""
    tokens, known = batch["tokens"].clone(), batch["known"].clone()
    last = tokens.shape[-1] - 1
    for done in range(1, passes + 1):
        predicted = vocab[block_forward(model, embed, head, {**batch, "tokens": tokens, "known": known}).argmax(-1)]
        first = known[..., 1:].int().cumprod(-1).sum(-1)  # the leading run of known drafted positions
        still_open = first < last
        if done == passes or not bool(still_open.any()):
            break
        at = first.clamp(max=last - 1)[..., None]  # the first masked position, minus the anchor
        fixed = torch.where(still_open[..., None], predicted.gather(-1, at), tokens[..., 1:].gather(-1, at))
        tokens[..., 1:].scatter_(-1, at, fixed)
        known[..., 1:].scatter_(-1, at, known[..., 1:].gather(-1, at) | still_open[..., None])
    return torch.where(known[..., 1:], tokens[..., 1:], predicted)


def anchor_chunks(anchors, chunk_size: int = 4):
    """`held_out_anchors` in chunks of `chunk_size` sequences: one forward scores a chunk's anchors together."""
    for start in range(0, len(anchors), chunk_size):
        yield anchors[start : start + chunk_size]


def anchor_block_batches(store, anchors, block_size, vmap, device="cpu", chunk_size: int = 4):
    """(chunk, its `block_batch` on `device`) for every chunk of the held-out anchors: one block per anchor."""
    for chunk in anchor_chunks(anchors, chunk_size):
        batch = block_batch(
            store,
            [i for i, _ in chunk],
            None,
            max(len(a) for _, a in chunk),
            block_size,
            vmap,
            anchors=[a for _, a in chunk],
        )
        yield chunk, to_device(batch, device)


@torch.no_grad()
def estimate_tau(settings: ScoringSettings, passes: int = 1) -> tuple[float, np.ndarray]:
    """tau = 1 + mean accepted length of one greedy draft of block_size - 1 tokens per held-out anchor,
    and the acceptance rate by block position (share of anchors whose first i drafts are all accepted).
    A block drafter runs `passes` denoising passes, each after the first with one more leading position fixed
    to its own prediction (`BlockDiffusionDrafter` with threshold 1)."""
    model, embed, head, store, anchors = settings.model, settings.embed, settings.head, settings.store, settings.anchors
    vmap, block_size, device, chunk_size = settings.vmap, settings.block_size, settings.device, settings.chunk_size
    vocab = settings.vocab.to(device)
    model.eval()
    lengths = []
    if settings.arch == "block":
        for chunk, batch in anchor_block_batches(store, anchors, block_size, vmap, device, chunk_size):
            predicted = greedy_block_drafts(model, embed, head, vocab, batch, passes)
            got = accepted_lengths(predicted, batch["full_targets"], batch["valid"])
            lengths += [got[r, : len(a)] for r, (_, a) in enumerate(chunk)]
    else:
        for chunk in anchor_chunks(anchors, chunk_size):
            batch = to_device(ar_batch(store, [i for i, _ in chunk], vmap), device)
            hit = (vocab[ar_forward(model, head, batch).argmax(-1)] == batch["full_targets"]) & batch["loss_mask"]
            for r, (_, a) in enumerate(chunk):
                # A teacher-forced AR pass scores every anchor at once: drafts from anchor a are accepted
                # while its predictions at a, a+1, ... match (it would have fed exactly those tokens).
                rows = (torch.from_numpy(a)[:, None] + torch.arange(block_size - 1)).to(device)
                inside = rows < hit.shape[1]
                got = hit[r, rows.clamp(max=hit.shape[1] - 1)] & inside
                lengths.append(got.long().cumprod(1).sum(1))
    model.train()
    lengths = torch.cat(lengths).cpu().numpy()
    by_position = np.array([(lengths >= i).mean() for i in range(1, block_size)])
    return 1 + float(lengths.mean()), by_position


def lookup_tau(
    store,
    anchors,
    block_size,
    ngrams=None,
    min_ngram: int = 1,
    store_min_n: int = 2,
    max_ngram: int = 3,
    prefer_store: float | None = None,
) -> float:
    """The same estimate for prompt lookup (n-gram min_ngram..max_ngram over prompt + answer so far; min_ngram = 0:
    none), continued by the n-gram store `ngrams` if given (`lookup_draft`), for reference."""
    lengths = []
    for i, chosen in anchors:
        s = store.sequence(i)
        ids = torch.from_numpy(s["ids"].astype(np.int64))
        for a in chosen:
            draft, _ = lookup_draft(
                ids[: a + 1], min_ngram, max_ngram, block_size - 1, ngrams, store_min_n, prefer_store
            )
            full, ok, _ = block_targets(s, np.array([a]), block_size)
            k = len(draft)
            hit = (draft.numpy() == full[0, :k]) & ok[0, :k]
            lengths.append(int(np.cumprod(hit).sum()))
    return 1 + float(np.mean(lengths))


@torch.no_grad()
def lookup_fill_tau(
    settings: ScoringSettings,
    ngrams=None,
    max_ngram: int = 3,
    prefer_store: float | None = None,
    passes: int = 1,
    branch: int = 0,
    refill_below: float = 0.0,
) -> tuple[float, np.ndarray, float]:
    """The estimate for the default's chain, for a block drafter: lookup (`lookup_tau`'s, min_ngram 1, continued by
    the n-gram store `ngrams` if given) gives the block's first positions, the block model, reading them as known,
    fills the rest with `passes` passes. With `branch` k > 0, the block model's own first k tokens (from the anchor
    alone) are verified beside that chain, as a second path of a tree (`drafters.ChainDrafter`'s branch): an anchor
    accepts the longer of the two, every node verified. With `refill_below` > 0 the lookup's draft ends before its
    first token of lower confidence (a store token's share), and the block model fills from there
    (`drafters.ChainDrafter`'s refill_below). Returns tau, acceptance by position, and the share of anchors where the
    block model drafted anything (the lookup left room)."""
    model, embed, head, store, anchors = settings.model, settings.embed, settings.head, settings.store, settings.anchors
    vmap, block_size, device, chunk_size = settings.vmap, settings.block_size, settings.device, settings.chunk_size
    vocab = settings.vocab.to(device)
    model.eval()
    lengths, filled = [], 0
    for chunk, batch in anchor_block_batches(store, anchors, block_size, vmap, device, chunk_size):
        tokens, known = batch["tokens"].clone(), batch["known"].clone()
        for r, (i, chosen) in enumerate(chunk):
            ids = torch.from_numpy(store.sequence(i)["ids"].astype(np.int64))
            for j, a in enumerate(chosen):
                draft, confidence = lookup_draft(ids[: a + 1], 1, max_ngram, block_size - 1, ngrams, 2, prefer_store)
                draft = draft[: sure_prefix_length(confidence, refill_below)]
                tokens[r, j, 1 : 1 + len(draft)], known[r, j, 1 : 1 + len(draft)] = draft, True
                known[r, j, 1 + len(draft) :] = False
                filled += len(draft) < block_size - 1
        predicted = greedy_block_drafts(model, embed, head, vocab, {**batch, "tokens": tokens, "known": known}, passes)
        got = accepted_lengths(predicted, batch["full_targets"], batch["valid"])
        if branch:
            own = greedy_block_drafts(model, embed, head, vocab, batch, passes)
            got = torch.maximum(got, accepted_lengths(own, batch["full_targets"], batch["valid"]).clamp(max=branch))
        lengths += [got[r, : len(a)] for r, (_, a) in enumerate(chunk)]
    model.train()
    lengths = torch.cat(lengths).cpu().numpy()
    by_position = np.array([(lengths >= i).mean() for i in range(1, block_size)])
    return 1 + float(lengths.mean()), by_position, filled / max(1, len(lengths))
