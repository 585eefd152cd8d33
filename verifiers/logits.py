"""The verifier's logits processing: `generate`'s logits processors (and, when sampling, warpers) on one position,
or on the same position of several rows of one length at once."""

from __future__ import annotations

import torch
from transformers import LogitsProcessorList
from transformers.generation import logits_process as hf

# Processors whose scores for a row depend on that row's ids and logits alone and that hold nothing per row, so one
# instance serves a batch's rows. Left out: those holding per-row data (the repetition penalty's prompt padding, the
# encoder ids of the Encoder* ones, the row index a prefix-constraint function is told) and those with model calls or
# state (guidance, watermarks).
ROW_WISE = (
    hf.MinLengthLogitsProcessor,
    hf.MinNewTokensLengthLogitsProcessor,
    hf.TemperatureLogitsWarper,
    hf.TopKLogitsWarper,
    hf.TopPLogitsWarper,
    hf.TopHLogitsWarper,
    hf.MinPLogitsWarper,
    hf.TypicalLogitsWarper,
    hf.EpsilonLogitsWarper,
    hf.EtaLogitsWarper,
    hf.NoRepeatNGramLogitsProcessor,
    hf.NoBadWordsLogitsProcessor,
    hf.SequenceBiasLogitsProcessor,
    hf.ForcedBOSTokenLogitsProcessor,
    hf.ForcedEOSTokenLogitsProcessor,
    hf.InfNanRemoveLogitsProcessor,
    hf.ExponentialDecayLengthPenalty,
    hf.LogitNormalization,
    hf.SuppressTokensLogitsProcessor,
    hf.SuppressTokensAtBeginLogitsProcessor,
)


def shared_processors(lists: list[LogitsProcessorList]) -> LogitsProcessorList | None:
    """One list that processes each row exactly as the row's own list does, for lists `generate` built from one
    generation config per row: the first, when every list holds the same row-wise processors in the same order;
    else None (each row keeps its own)."""
    kinds = [tuple(type(p) for p in processors) for processors in lists]
    if all(k == kinds[0] for k in kinds) and all(issubclass(kind, ROW_WISE) for kind in kinds[0]):
        return lists[0]
    return None


def process_logits(processors: LogitsProcessorList, prefix_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Apply `generate`'s logits processors (and, when sampling, warpers) to one position's logits [vocab]."""
    if not processors:
        return logits
    return processors(prefix_ids, logits[None])[0]
