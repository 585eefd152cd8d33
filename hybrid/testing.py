"""Losslessness checks anyone can run against their own verifier and drafter (see tests/ for use with hypothesis).

The contract (README, "Losslessness"):
* Greedy: `hybrid.generate` returns `model.generate`'s tokens. Verifying k+1 positions in one forward
  does not reproduce the last bits of one-token decoding, so where the verifier's two best processed
  scores are within `NEAR_TIE_EPS` the two runs may take different branches. `check_greedy_lossless`
  allows a divergence only at such a near tie, and reports when it did.
* Sampling: each emitted token is distributed exactly as the verifier's processed distribution p.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
from transformers import DynamicCache

import hybrid

NEAR_TIE_EPS = 1e-4  # absolute gap between the top-2 processed scores (float32)
GREEDY_CHECKS = {"checked": 0, "near_ties": 0}  # how often the near-tie exception was needed, this process


@dataclass
class GreedyReport:
    reference: torch.Tensor  # model.generate's sequence
    output: torch.Tensor  # hybrid.generate's sequence
    stats: hybrid.GenerationStats
    near_tie_at: int | None  # index of the new token where a near tie let the runs diverge, else None


def check_greedy_lossless(model, input_ids: torch.Tensor, drafter, scheduler=None, hybrid_kwargs: dict | None = None,
                          **kwargs) -> GreedyReport:
    """Assert `hybrid.generate` == `model.generate` under greedy decoding (up to the near-tie contract).

    `kwargs` go to both calls; `hybrid_kwargs` to hybrid's only (e.g. `cache_implementation="static"`)."""
    kwargs = {**kwargs, "do_sample": False}
    ref = model.generate(input_ids, return_dict_in_generate=True, output_scores=True, **kwargs)
    out, stats = hybrid.generate(model, input_ids, drafter=drafter, scheduler=scheduler, return_stats=True,
                                 **kwargs, **(hybrid_kwargs or {}))  # fmt: skip
    prompt_len = input_ids.shape[1]
    expected, got = ref.sequences[0, prompt_len:], out[0, prompt_len:]
    check_stats_consistent(stats, got.shape[0])
    GREEDY_CHECKS["checked"] += 1
    if torch.equal(expected, got):
        return GreedyReport(ref.sequences, out, stats, None)
    n = min(expected.shape[0], got.shape[0])
    mismatch = (expected[:n] != got[:n]).nonzero()
    if mismatch.numel() == 0:  # one is a strict prefix of the other: a stop decision differed
        raise AssertionError(
            f"hybrid stopped after {got.shape[0]} new tokens, model.generate after {expected.shape[0]}; "
            f"common prefix {expected[:n].tolist()}"
        )
    j = int(mismatch[0])
    top2 = ref.scores[j][0].topk(2).values
    gap = float(top2[0] - top2[1])
    if gap >= NEAR_TIE_EPS:
        raise AssertionError(
            f"greedy output differs at new token {j}: model.generate chose {int(expected[j])}, hybrid chose "
            f"{int(got[j])}; top-2 score gap {gap:.3g} >= {NEAR_TIE_EPS} (not a near tie)\n"
            f"expected {expected.tolist()}\n     got {got.tolist()}"
        )
    GREEDY_CHECKS["near_ties"] += 1
    return GreedyReport(ref.sequences, out, stats, j)


def check_stats_consistent(stats: hybrid.GenerationStats, new_tokens: int) -> None:
    """Every statistic derives from the steps: emitted = accepted + 1, except a stop-truncated last step."""
    steps = list(zip(stats.drafted, stats.accepted, stats.emitted))
    assert stats.new_tokens == new_tokens == sum(stats.emitted), (stats.new_tokens, new_tokens)
    assert stats.verifier_forwards == len(steps) >= 1
    assert steps[0] == (0, 0, 1), "the prefill drafts nothing and emits one token"
    for i, (drafted, accepted, emitted) in enumerate(steps):
        assert 0 <= accepted <= drafted, (i, drafted, accepted)
        if i < len(steps) - 1:
            assert emitted == accepted + 1, (i, accepted, emitted)
        else:
            assert 1 <= emitted <= accepted + 1, (i, accepted, emitted)
    assert math.isclose(stats.tau, new_tokens / len(steps))


def check_cache_matches_prefill(model, sequences: torch.Tensor, cache, atol: float = 1e-4) -> None:
    """The cache left by a generation equals a fresh prefill of the sequence minus its newest token."""
    fresh = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(sequences[:, :-1], cache=fresh, use_cache=True)
    assert cache.get_seq_length() == fresh.get_seq_length() == sequences.shape[1] - 1
    for i, (mine, theirs) in enumerate(zip(cache.layers, fresh.layers)):
        for name in ("keys", "values"):
            a, b = getattr(mine, name), getattr(theirs, name)
            assert a.shape == b.shape, f"layer {i} {name}: {tuple(a.shape)} vs fresh prefill {tuple(b.shape)}"
            err = float((a - b).abs().max()) if a.numel() else 0.0
            assert err <= atol, f"layer {i} {name} differs from a fresh prefill by {err:.3g}"


def sequence_distribution(model, input_ids: torch.Tensor, num_tokens: int, **kwargs) -> dict[tuple[int, ...], float]:
    """Exact probability of every continuation of `num_tokens` tokens under `model.generate` sampling.

    Enumerates the vocabulary (only for tiny vocabularies); p at each position goes through the
    same processors and warpers `generate` builds from `kwargs`.
    """
    config, _ = model._prepare_generation_config(None, do_sample=True, max_new_tokens=num_tokens, **kwargs)
    model._prepare_special_tokens(config, False, device=input_ids.device, batch_size=1)
    config = model._prepare_generated_length(config, False, True, "input_ids", input_ids.shape[1], input_ids)
    processors = model._get_logits_processor(config, input_ids.shape[1], input_ids, device=input_ids.device)
    vocab = model.get_output_embeddings().weight.shape[0]
    dist = {}
    with torch.inference_mode():
        for continuation in itertools.product(range(vocab), repeat=num_tokens):
            seq = torch.cat([input_ids, input_ids.new_tensor([continuation])], dim=1)
            logits = model(seq).logits[0, input_ids.shape[1] - 1 : -1].float()
            prob = 1.0
            for i, token in enumerate(continuation):
                scores = processors(seq[:, : input_ids.shape[1] + i], logits[i][None])[0]
                prob *= float(torch.softmax(scores, -1)[token])
            dist[continuation] = prob
    return dist


def chi_square_statistic(counts: dict, probs: dict, min_expected: float = 5.0) -> tuple[float, int]:
    """Pearson's chi-square of observed `counts` against `probs`, pooling cells expected below `min_expected`.

    Returns (statistic, degrees of freedom).
    """
    n = sum(counts.values())
    cells = sorted(probs, key=probs.get)
    observed, expected, pool_o, pool_e = [], [], 0.0, 0.0
    for cell in cells:
        pool_o += counts.get(cell, 0)
        pool_e += probs[cell] * n
        if pool_e >= min_expected:
            observed.append(pool_o)
            expected.append(pool_e)
            pool_o = pool_e = 0.0
    if pool_e > 0 or pool_o > 0:  # leftovers join the last cell
        observed[-1] += pool_o
        expected[-1] += pool_e
    unexpected = sum(c for cell, c in counts.items() if cell not in probs)
    if unexpected:
        return math.inf, max(len(observed) - 1, 1)
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    return stat, len(observed) - 1


def chi_square_critical(df: int, alpha: float) -> float:
    """Upper `alpha` quantile of chi-square(df), Wilson-Hilferty approximation (no SciPy needed)."""
    z = _normal_quantile(1 - alpha)
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _normal_quantile(p: float) -> float:
    lo, hi = -10.0, 10.0
    for _ in range(100):  # bisection on the normal CDF
        mid = (lo + hi) / 2
        if 0.5 * (1 + math.erf(mid / math.sqrt(2))) < p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
