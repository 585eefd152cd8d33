"""The acceptance rules: pure functions on one position's distributions.

"match" (the default): at each position, in sequence order, the verifier makes its own choice exactly as
`generate` makes it (the argmax of the processed scores, or one multinomial draw from them with the caller's
RNG), and a drafted token is kept iff it equals that choice. Output is `generate`'s own, token for token,
whatever the drafter proposes: a drafter cannot inject a token.

"rejection" (Leviathan et al. 2023; Chen et al. 2023), sampling only: keep draft x ~ q with probability
min(1, p(x) / q(x)); on rejection emit a token from normalise(max(0, p - q)). The emitted token is then
distributed exactly as p, but only as long as x really was drawn from the q the drafter reports: this rule
trusts `Draft.probs`. A drafter that proposes x while reporting q(x) ~ 0 gets x accepted with probability 1.
"""

from __future__ import annotations

import torch

ACCEPTANCE_RULES = ("match", "rejection")


def greedy_step(scores: torch.Tensor, draft_token: int) -> tuple[bool, int]:
    """(accepted, emitted token) for one drafted position under greedy decoding."""
    target = int(scores.argmax())
    return target == draft_token, target


def acceptance_probability(p: torch.Tensor, q: torch.Tensor | None, token: int) -> float:
    """min(1, p(x) / q(x)); q None means the draft was deterministic (q one-hot on x)."""
    q_x = 1.0 if q is None else float(q[token])
    return min(1.0, float(p[token]) / q_x)


def residual_distribution(p: torch.Tensor, q: torch.Tensor | None, token: int) -> torch.Tensor:
    """normalise(max(0, p - q)): where to draw from after rejecting `token`."""
    if q is None:
        residual = p.clone()
        residual[token] = 0.0
    else:
        residual = (p - q).clamp_min(0.0)
    total = residual.sum()
    # total == 0 only when p <= q everywhere, i.e. p == q, where rejection has probability 0; rounding
    # can still land here, and then p itself is the exact answer.
    return p if total <= 0 else residual / total


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from probs [vocab], as `generate` draws a row of its batch (`torch.multinomial(probs, 1)`)."""
    return int(torch.multinomial(probs[None], 1, generator=generator))


def speculative_step(
    p: torch.Tensor, q: torch.Tensor | None, token: int, generator: torch.Generator | None
) -> tuple[bool, int]:
    """(accepted, emitted token) for one drafted position under sampling; the emitted token ~ p exactly."""
    accept = acceptance_probability(p, q, token)
    if accept >= 1.0 or float(torch.rand((), generator=generator, device=p.device)) < accept:
        return True, token
    return False, sample(residual_distribution(p, q, token), generator)
