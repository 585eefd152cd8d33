"""Acceptance metrics: pure functions on the per-step logs of `hybrid.GenerationStats`.

A step log is three lists with one entry per verifier forward (step 0 is the prefill):
`drafted[s]` tokens the verifier scored beyond the pending one, `accepted[s]` of them kept,
`emitted[s]` tokens appended. Only steps with drafted > 0 say anything about the drafter; steps
where it proposed nothing (and the prefill) count for tau but not for acceptance.
"""

from __future__ import annotations

from collections import Counter

from hybrid.stats import GenerationStats


def tau(emitted: list[int]) -> float:
    """Mean tokens emitted per verifier forward (1.0 for plain decoding)."""
    return GenerationStats(emitted=list(emitted)).tau if emitted else float("nan")


def position_counts(drafted: list[int], accepted: list[int]) -> tuple[list[int], list[int]]:
    """(attempts, successes) per block position i = 1..max(drafted), as lists indexed i - 1.

    attempts[i-1]:  steps that drafted at least i tokens.
    successes[i-1]: those of them whose first i drafted tokens were all accepted (accepted >= i).
    Counts, not ratios, so runs pool by adding them.
    """
    depth = max(drafted, default=0)
    attempts, successes = [0] * depth, [0] * depth
    for d, a in zip(drafted, accepted):
        for i in range(d):
            attempts[i] += 1
            successes[i] += a > i
    return attempts, successes


def acceptance_by_position(drafted: list[int], accepted: list[int]) -> list[float]:
    """Acceptance rate at each block position i = 1..max(drafted) (list index i - 1).

    For position i: among the steps that drafted at least i tokens (after the scheduler's cut), the
    fraction in which the first i drafted tokens were all accepted, i.e. P(accepted >= i | drafted >= i).
    It is cumulative (position i is kept only if 1..i-1 were), so it never rises with i for a step
    set where drafted is constant. Caveat: on the last step, EOS or max_new_tokens can stop the
    verifier reading the rest of a draft; those unread tokens count as not accepted.
    """
    attempts, successes = position_counts(drafted, accepted)
    return ratios(successes, attempts)


def accepted_length_histogram(drafted: list[int], accepted: list[int]) -> list[int]:
    """Number of drafting steps (drafted > 0) that accepted exactly n tokens, as a list indexed n."""
    counts = Counter(a for d, a in zip(drafted, accepted) if d > 0)
    return [counts[n] for n in range(max(counts, default=-1) + 1)]


def acceptance_rate(drafted: list[int], accepted: list[int]) -> float:
    """Accepted / drafted over all steps (nan when nothing was drafted)."""
    return GenerationStats(drafted=list(drafted), accepted=list(accepted)).acceptance_rate


def ratios(numerators: list[int], denominators: list[int]) -> list[float]:
    return [n / d if d else float("nan") for n, d in zip(numerators, denominators)]


def add_lists(a: list[int], b: list[int]) -> list[int]:
    """Element-wise sum of two count lists of possibly different lengths."""
    longer, shorter = (a, b) if len(a) >= len(b) else (b, a)
    return [x + (shorter[i] if i < len(shorter) else 0) for i, x in enumerate(longer)]


def summarize(records: list[dict], by: tuple[str, ...]) -> list[dict]:
    """One summary row per distinct value of the `by` fields, in first-seen order.

    Each record is one run (one prompt under one configuration) with the step lists `drafted`,
    `accepted`, `emitted`, `tau`, `new_tokens`, `total_time`, `baseline_new_tokens`,
    `baseline_time` (plain `model.generate` on the same prompt, same process) and
    `matches_generate` (bool for greedy runs, None for sampled ones).

    Per row: mean_tau is the mean of per-run tau (each prompt weighs the same); tokens/s are
    throughputs, total new tokens over total seconds, for hybrid and for plain generate on the same
    prompts, and speedup is their ratio; acceptance by position and the accepted-length histogram
    pool the step counts of every run.
    """
    groups: dict[tuple, list[dict]] = {}
    for record in records:
        groups.setdefault(tuple(record[field] for field in by), []).append(record)
    rows = []
    for values, runs in groups.items():
        attempts, successes, histogram = [], [], []
        for r in runs:
            a, s = position_counts(r["drafted"], r["accepted"])
            attempts, successes = add_lists(attempts, a), add_lists(successes, s)
            histogram = add_lists(histogram, accepted_length_histogram(r["drafted"], r["accepted"]))
        tokens_per_s = sum(r["new_tokens"] for r in runs) / sum(r["total_time"] for r in runs)
        baseline_tokens_per_s = sum(r["baseline_new_tokens"] for r in runs) / sum(r["baseline_time"] for r in runs)
        checked = [r["matches_generate"] for r in runs if r["matches_generate"] is not None]
        rows.append(
            dict(zip(by, values))
            | {
                "runs": len(runs),
                "mean_tau": sum(r["tau"] for r in runs) / len(runs),
                "tokens_per_s": tokens_per_s,
                "baseline_tokens_per_s": baseline_tokens_per_s,
                "speedup": tokens_per_s / baseline_tokens_per_s,
                "acceptance_rate": acceptance_rate(
                    [sum(r["drafted"]) for r in runs], [sum(r["accepted"]) for r in runs]
                ),
                "acceptance_by_position": ratios(successes, attempts),
                "accepted_length_histogram": histogram,
                "matches_generate": sum(checked) if checked else None,
                "checked_against_generate": len(checked),
            }
        )
    return rows
