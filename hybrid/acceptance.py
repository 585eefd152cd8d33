"""The acceptance rules, pure functions of one position's scores, and the walk of a draft that they drive.

Each rule judges one position (`Rule`); `walk` takes a draft, chain or tree, from the pending token through the
nodes its rule accepts, and returns the accepted path. The engine supplies the scores at each position and records
each emitted token: a position's processed scores depend on the tokens emitted before it, and sampling draws in
sequence order, so the walk asks for them one position at a time.

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

from collections.abc import Callable
from dataclasses import dataclass

import torch

from drafters.base import Draft

ACCEPTANCE_RULES = ("match", "rejection")

# One position: (processed scores there, the drafted children's tokens, their q rows or None) -> (the token to emit,
# the index among the children of the one it accepts, or None: the walk ends there). With no children (the end of a
# branch) the token is the verifier's own, drawn as `generate` draws it: the bonus token.
Rule = Callable[[torch.Tensor, list[int], list[torch.Tensor | None]], tuple[int, int | None]]


def own_choice(do_sample: bool, generator: torch.Generator | None) -> Callable[[torch.Tensor], int]:
    """The verifier's own token from its processed scores [vocab], as `generate` picks it: the argmax, or one draw
    from their softmax with `generator` (None: torch's global RNG)."""
    if do_sample:
        return lambda scores: sample(torch.softmax(scores, dim=-1), generator)
    return lambda scores: int(scores.argmax())


def match_rule(choose: Callable[[torch.Tensor], int]) -> Rule:
    """Emit the verifier's own choice (`choose`, as `generate` makes it) and accept the child that drafted it."""

    def judge(scores: torch.Tensor, children: list[int], _q: list) -> tuple[int, int | None]:
        token = choose(scores)
        return token, next((i for i, child in enumerate(children) if child == token), None)

    return judge


def rejection_rule(generator: torch.Generator | None) -> Rule:
    """Speculative sampling on a chain: accept its one child with probability min(1, p/q), else emit a correction."""

    def judge(scores: torch.Tensor, children: list[int], q: list) -> tuple[int, int | None]:
        if not children:
            return sample(torch.softmax(scores, -1), generator), None
        ok, token = speculative_step(torch.softmax(scores, -1), q[0], children[0], generator)
        return token, 0 if ok else None

    return judge


@dataclass
class AcceptedPath:
    nodes: list[int]  # the draft's accepted nodes, from the pending token down
    kept: list[int]  # the fed offsets whose cache entries stay: the pending token's (0) and the accepted nodes'
    emitted: int  # tokens emitted: the accepted nodes, plus the verifier's own token where the walk ended on one


def walk(
    draft: Draft,
    rule: Rule,
    scores_at: Callable[[int], torch.Tensor],
    emit: Callable[[int, int, torch.Tensor], bool],
) -> AcceptedPath:
    """Walk `draft` from the pending token (fed offset 0; node i is fed at offset i + 1). At each offset
    `scores_at(offset)` gives the processed scores, `rule` the token to emit and the child it accepts, and
    `emit(offset, token, scores)` records the token, returning False once the sequence has finished. The walk goes on
    into the accepted child; it ends where no child is accepted (the rule's token is then the verifier's own) or the
    sequence finished."""
    children: dict[int, list[int]] = {}  # fed offset -> its children's node indices, in draft order
    for node, parent in enumerate(draft.parent_list()):
        children.setdefault(parent + 1, []).append(node)
    tokens = draft.tokens.tolist()
    at, path, nodes = 0, [0], []  # the fed offset walked to, the offsets walked, the nodes accepted
    while True:
        scores = scores_at(at)
        kids = children.get(at, [])
        q = [None if draft.probs is None else draft.probs[kid] for kid in kids]
        token, pick = rule(scores, [tokens[kid] for kid in kids], q)
        node = None if pick is None else kids[pick]
        going_on = emit(at, token, scores)
        if node is None or not going_on:
            break
        nodes.append(node)
        at = node + 1
        path.append(at)
    if node is not None:  # stopped on an accepted token
        nodes.append(node)
    emitted = len(nodes) + (node is None)
    return AcceptedPath(nodes, path[:emitted], emitted)


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
