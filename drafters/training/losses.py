"""What training minimises: the distillation loss, weighted by block position."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def position_weights(block_size: int, gamma: float, first_masked: torch.Tensor | None = None) -> torch.Tensor:
    """exp(-(i-1-f)/gamma) for block positions i = 1..B-1 ([B-1]), or [..., B-1] for blocks given their first
    `first_masked` [...] = f positions: the first positions left to draft decide acceptance, weigh them most."""
    i = torch.arange(block_size - 1, device=None if first_masked is None else first_masked.device).float()
    if first_masked is not None:
        i = (i - first_masked[..., None]).clamp(min=0)
    return torch.exp(-i / gamma)


def distill_loss(
    logits, targets, soft_ids, soft_probs, weights, hard_weight: float = 0.5, total: torch.Tensor | None = None
) -> torch.Tensor:
    """Weighted mix of cross-entropy to the greedy target and to the verifier's top-k distribution.

    logits [N, V'] over the draft vocabulary; targets [N] (index, -1 = outside V'); soft_ids [N, K]
    (-1 = outside V') with soft_probs [N, K]; weights [N] (0 = not a valid position). The weighted sum is divided by
    `total` (default: weights.sum()); a process of a data-parallel step passes the whole step's, so the processes'
    losses add up to the step's loss.
    """
    logp = F.log_softmax(logits.float(), dim=-1)
    hard = -logp.gather(1, targets.clamp(min=0)[:, None])[:, 0] * (targets >= 0)
    probs = soft_probs.float() * (soft_ids >= 0)
    probs = probs / probs.sum(-1, keepdim=True).clamp(min=1e-6)
    soft = -(probs * logp.gather(1, soft_ids.clamp(min=0))).sum(-1)
    per_position = hard_weight * hard + (1 - hard_weight) * soft
    total = weights.sum() if total is None else total
    return (per_position * weights).sum() / total.clamp(min=1e-6)


def keep_loss(logits, teacher_logits, weights, total: torch.Tensor) -> torch.Tensor:
    """Weighted KL(teacher || student) per position, over the same sum of weights as `distill_loss`: a fine-tune that
    also matches its starting checkpoint where that checkpoint's inputs are unchanged keeps what it knew there."""
    logp = F.log_softmax(logits.float(), dim=-1)
    teacher = F.log_softmax(teacher_logits.float(), dim=-1)
    kl = (teacher.exp() * (teacher - logp)).sum(-1)
    return (kl * weights).sum() / total.clamp(min=1e-6)
