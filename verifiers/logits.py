"""The verifier's logits processing: `generate`'s logits processors (and, when sampling, warpers) on one position."""

from __future__ import annotations

import torch
from transformers import LogitsProcessorList


def process_logits(processors: LogitsProcessorList, prefix_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Apply `generate`'s logits processors (and, when sampling, warpers) to one position's logits [vocab]."""
    if not processors:
        return logits
    return processors(prefix_ids, logits[None])[0]
