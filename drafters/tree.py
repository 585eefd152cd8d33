"""Token trees from a block drafter's per-position distributions: best first, under a node budget.

A block drafter predicts every position of its block in one pass, each from the context alone, so its output is a
distribution per depth rather than per path. A path's score is the sum of its tokens' log-probabilities at their
depths (DDTree, arXiv 2604.12989): the tree of the `budget` best paths' nodes is what a one-forward verify should
score. The candidates at depth d are that depth's tokens sorted by probability, shared by every parent, so the
best-first search needs only two successors per popped node: its next sibling and its first child.
"""

from __future__ import annotations

import heapq
import math

import torch

from drafters.base import Draft, DraftContext
from verifiers.logits import process_logits


def best_first_tree(probs: torch.Tensor, budget: int, branching: int = 4) -> Draft:
    """The `budget`-node tree of highest path scores over probs [depth, vocab] (rows sum to at most 1).

    Node i's confidence is its token's probability at its depth: the chance the verifier picks it once its
    parent was picked. At most `branching` children per node. Nodes come best first (a parent before its
    children), so every prefix of them is the best tree of that size.
    """
    device = probs.device
    if budget <= 0 or probs.shape[0] == 0:
        return Draft.empty(device)
    top_p, top_i = probs.float().topk(min(branching, probs.shape[-1]), dim=-1)
    depth = top_p.shape[0]
    log_p = top_p.clamp_min(1e-30).log().tolist()
    top_p, top_i = top_p.tolist(), top_i.tolist()
    tokens, parents, confidence = [], [], []
    # (-path score, tie-break, depth, rank among that depth's candidates, parent node, parent's path score)
    frontier = [(-log_p[0][0], 0, 0, 0, -1, 0.0)]
    pushed = 1
    while frontier and len(tokens) < budget:
        neg, _, d, rank, parent, parent_score = heapq.heappop(frontier)
        if top_p[d][rank] <= 0:
            continue  # a token the drafter rules out (e.g. outside its vocabulary), and so every later sibling
        node = len(tokens)
        tokens.append(top_i[d][rank])
        parents.append(parent)
        confidence.append(top_p[d][rank])
        if rank + 1 < len(top_i[d]):  # the next sibling: same parent, the next token at this depth
            heapq.heappush(frontier, (-(parent_score + log_p[d][rank + 1]), pushed, d, rank + 1, parent, parent_score))
            pushed += 1
        if d + 1 < depth:  # the first child: the best token one depth further
            heapq.heappush(frontier, (neg - log_p[d + 1][0], pushed, d + 1, 0, node, -neg))
            pushed += 1
    return Draft(
        torch.tensor(tokens, dtype=torch.long, device=device),
        confidence=torch.tensor(confidence, device=device),
        parents=torch.tensor(parents, dtype=torch.long, device=device),
    ).chain_or_tree()


def concatenate(chain: Draft, tree: Draft) -> Draft:
    """`chain`'s nodes, then `tree`'s grown below the chain's last token (the tree's -1 parents become it).

    The result is a deterministic proposal (probs dropped): trees verify under the match rule only. A node without
    a confidence gets 1, as a drafter that gives none vouches for its tokens."""
    device = chain.tokens.device
    m = len(chain)
    shifted = torch.tensor([p + m if p >= 0 else m - 1 for p in tree.parent_list()], dtype=torch.long)
    confidence = [
        (d.confidence if d.confidence is not None else torch.ones(len(d))).to(device).float() for d in (chain, tree)
    ]
    return Draft(
        torch.cat([chain.tokens, tree.tokens.to(device)]),
        confidence=torch.cat(confidence),
        parents=torch.cat([torch.arange(-1, m - 1), shifted]).to(device),
    ).chain_or_tree()


def tree_below(
    ctx: DraftContext,
    chain: Draft,
    logits: torch.Tensor,
    budget: int,
    branching: int,
    columns: torch.Tensor | None = None,
    vocab_size: int | None = None,
) -> Draft:
    """`chain` (tokens fixed before), then the best-first tree of the remaining `budget` nodes below it, over a block
    drafter's logits for the depths after the chain, logits [depth, n].

    Columns are the verifier's vocabulary, or a draft vocabulary whose token ids are `columns` (of a verifier
    vocabulary of `vocab_size`). With logits processors the distributions are processed as the verifier's scores
    will be, given the committed sequence and the chain (one prefix for every path: a proposal needs no more).
    """
    budget -= len(chain)
    if budget <= 0 or logits.shape[0] == 0:
        return chain
    if ctx.reorders:
        full = logits
        if columns is not None:
            full = logits.new_full((logits.shape[0], vocab_size), -math.inf)
            full[:, columns] = logits
        prefix = torch.cat([ctx.input_ids, chain.tokens.to(ctx.input_ids.device)[None]], dim=1)
        probs = torch.stack([torch.softmax(process_logits(ctx.processors, prefix, row.float()), -1) for row in full])
        tree = best_first_tree(probs, budget, branching)
    else:
        tree = best_first_tree(torch.softmax(logits.float(), -1), budget, branching)
        if columns is not None:
            tree.tokens = columns[tree.tokens.to(columns.device)]
    tree.tokens = tree.tokens.to(ctx.input_ids.device)
    return concatenate(chain, tree)


def add_path(draft: Draft, path: Draft, stage: int) -> Draft:
    """`draft` (a chain or a tree) with the chain `path` grown into it from the pending token: the path follows the
    draft's nodes while its tokens equal theirs, and its nodes past that become new ones (of `stage`), so a path
    the draft already holds adds nothing. Nodes come best first by reach, the product of the confidences from the
    pending token to the node (a node without a confidence vouches with 1), a parent before its children, so every
    prefix is the draft's best tree of that size by its confidences. Deterministic proposals only (probs are
    dropped)."""
    device = draft.tokens.device
    tokens, parents = draft.tokens.tolist(), draft.parent_list()
    confidence = [1.0] * len(draft) if draft.confidence is None else draft.confidence.tolist()
    stages = draft.stage_list()
    path_confidence = [1.0] * len(path) if path.confidence is None else path.confidence.tolist()
    node = -1
    for token, conf in zip(path.tokens.tolist(), path_confidence):
        child = next((i for i, (t, p) in enumerate(zip(tokens, parents)) if p == node and t == token), None)
        if child is None:  # a new node: the path leaves the draft here
            tokens.append(token)
            parents.append(node)
            confidence.append(conf)
            stages.append(stage)
            child = len(tokens) - 1
        node = child
    reach: list[float] = []
    depths: list[int] = []
    for conf, parent in zip(confidence, parents):
        reach.append(min(max(conf, 0.0), 1.0) * (1.0 if parent < 0 else reach[parent]))
        depths.append(1 if parent < 0 else depths[parent] + 1)
    # A child's reach is at most its parent's, and ties go to the shallower node: parents stay first.
    order = sorted(range(len(tokens)), key=lambda i: (-reach[i], depths[i], i))
    return Draft(
        torch.tensor(tokens, dtype=torch.long, device=device),
        confidence=torch.tensor(confidence, device=device),
        parents=torch.tensor(parents, dtype=torch.long, device=device),
        stage=torch.tensor(stages, dtype=torch.long, device=device),
    ).keep(order)
