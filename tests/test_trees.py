"""Token trees: their layout and mask, the cache after a tree step, best-first trees, and invalid trees.

The losslessness properties (greedy, seeded sampling, batches, the cache after generation) draw tree drafters
through tests/strategies.py like every other drafter; these are the pieces they rest on.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hybrid
from drafters import Draft, Drafter, DraftError
from drafters.tree import add_path, best_first_tree, concatenate
from hybrid.testing import check_cache_matches_prefill, tiny_model
from schedulers import FixedScheduler
from schedulers.calibrated import expected_accepted
from verifiers.cache import SharedCache, tree_layout
from verifiers.verifier import Verifier


def test_tree_layout_gives_depths_and_ancestors():
    # nodes: 0 under the pending token, 1 under 0, 2 under the pending token, 3 under 1; one padding slot
    depths, sees = tree_layout([[-1, 0, -1, 1]], width=6)
    assert depths[0].tolist() == [0, 1, 2, 1, 3, 4]
    fed_sees = [set(torch.nonzero(row).flatten().tolist()) for row in sees[0]]
    assert fed_sees == [{0}, {0, 1}, {0, 1, 2}, {0, 3}, {0, 1, 2, 4}, {0, 1, 2, 4, 5}]


def test_tree_layout_refuses_a_tree_wider_than_the_forward():
    with pytest.raises(ValueError, match="3 tree nodes, which do not fit a forward of 3 tokens"):
        tree_layout([[-1, 0, 1]], width=3)


@pytest.mark.parametrize("window", [None, 3])
def test_tree_mask_sees_the_cache_and_the_ancestors_within_the_window(window):
    model = tiny_model("mistral", 32, 1, seed=0, sliding_window=window)
    cache = SharedCache(model, batch_size=2, capacity=16)
    cache.lengths = [4, 2]
    parents = [[-1, 0, -1], [-1, -1]]
    depths, sees = tree_layout(parents, width=4)
    cache.begin(4, (depths, sees))
    mask = cache.attention_mask(4)
    mask = next(iter(mask.values())) if isinstance(mask, dict) else mask
    visible = mask[:, 0] == 0  # [rows, q, end]
    for b, n in enumerate(cache.lengths):
        for i in range(4):
            query_pos = n + int(depths[b, i])
            for slot in range(cache.end):
                if slot < n:
                    key_pos, seen = slot, True
                elif slot < n + 4:
                    key_pos, seen = n + int(depths[b, slot - n]), bool(sees[b, i, slot - n])
                else:
                    key_pos, seen = slot, False
                if window is not None:
                    seen = seen and key_pos > query_pos - window
                assert bool(visible[b, i, slot]) == seen, (b, i, slot)


def test_a_tree_step_keeps_the_accepted_path_as_a_fresh_prefill_would():
    model = tiny_model("llama", 48, 2, seed=1)
    prompt = torch.tensor([3, 9, 4, 7, 1])
    verifier = Verifier(model, hidden_layers=(1,))
    verifier.prefill_rows([prompt[:-1]], capacity=32)
    # pending 1; nodes: 0=5 (root), 1=6 (under 0), 2=8 (root), 3=2 (under 2), 4=11 (under 3)
    fed = torch.tensor([[1, 5, 6, 8, 2, 11]])
    logits = verifier.verify_rows(fed, parents=[[-1, 0, -1, 2, 3]])[0]
    verifier.keep_accepted([[0, 3, 4, 5]])  # the path pending -> 8 -> 2 -> 11
    committed = torch.cat([prompt, torch.tensor([8, 2, 11])])
    assert verifier.length(0) == committed.shape[0]
    # the cache holds the sequence but its newest token: here one more to come
    check_cache_matches_prefill(model, torch.cat([committed, committed[:1]])[None], verifier.cache.to_dynamic(0))
    with torch.no_grad():
        reference = model(committed[None], output_hidden_states=True)
    # each node's logits are the verifier's after the path to it
    assert torch.allclose(logits[5], reference.logits[0, -1], atol=1e-4)
    assert torch.allclose(logits[2], model(torch.cat([prompt, torch.tensor([5, 6])])[None]).logits[0, -1], atol=1e-4)
    kept_hidden = verifier.hidden_states(0)[0]
    assert torch.allclose(kept_hidden, reference.hidden_states[1][0], atol=1e-4)


def _paths(probs: torch.Tensor, branching: int):
    """Every path (tuple of tokens) through the per-depth top-`branching` tokens, with its score."""
    top = [row.topk(branching).indices.tolist() for row in probs]
    for depth in range(1, len(top) + 1):
        for path in itertools.product(*top[:depth]):
            yield path, sum(math.log(probs[d, t]) for d, t in enumerate(path))


@settings(max_examples=50, deadline=None)
@given(
    depth=st.integers(1, 4),
    budget=st.integers(1, 20),
    branching=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_best_first_tree_holds_the_best_paths_in_order(depth, budget, branching, seed):
    probs = torch.softmax(torch.randn(depth, 6, generator=torch.Generator().manual_seed(seed)) * 2, -1)
    tree = best_first_tree(probs, budget, branching)
    parents, tokens = tree.parent_list(), tree.tokens.tolist()
    paths = []
    for node in range(len(tree)):
        path, at = [], node
        while at >= 0:
            path.append(tokens[at])
            at = parents[at]
        paths.append(tuple(reversed(path)))
    assert all(parent < node for node, parent in enumerate(parents))
    assert len(set(paths)) == len(paths)  # no node twice
    scores = sorted((score for _, score in _paths(probs, branching)), reverse=True)
    ours = [sum(math.log(probs[d, t]) for d, t in enumerate(path)) for path in paths]
    assert len(tree) == min(budget, len(scores))
    assert ours == pytest.approx(scores[: len(tree)], abs=1e-5)  # the best paths, best first
    for node, path in enumerate(paths):
        assert float(tree.confidence[node]) == pytest.approx(float(probs[len(path) - 1, path[-1]]))


def test_concatenate_grows_the_tree_below_the_chain():
    chain = Draft(torch.tensor([7, 8]))
    tree = Draft(torch.tensor([1, 2, 3]), confidence=torch.ones(3), parents=torch.tensor([-1, 0, -1]))
    joined = concatenate(chain, tree)
    assert joined.tokens.tolist() == [7, 8, 1, 2, 3]
    assert joined.parent_list() == [-1, 0, 1, 2, 1]


def test_add_path_joins_where_the_path_leaves_the_draft_and_orders_nodes_by_reach():
    chain = Draft(torch.tensor([5, 6, 7]), confidence=torch.tensor([0.9, 0.8, 0.7]))
    # The path agrees on 5, then leaves: its 9 becomes 5's second child, reached with 0.9 * 0.5.
    tree = add_path(chain, Draft(torch.tensor([5, 9]), confidence=torch.tensor([0.6, 0.5])), stage=1)
    assert tree.tokens.tolist() == [5, 6, 7, 9] and tree.parent_list() == [-1, 0, 1, 0]
    assert tree.stage_list() == [0, 0, 0, 1]
    # A path more confident than the draft goes first; the draft's nodes keep their parents.
    weak = Draft(torch.tensor([5, 6]), confidence=torch.tensor([0.5, 0.5]))
    tree = add_path(weak, Draft(torch.tensor([8, 9]), confidence=torch.tensor([0.9, 0.9])), stage=1)
    assert tree.tokens.tolist() == [8, 9, 5, 6] and tree.parent_list() == [-1, 0, -1, 2]
    assert tree.stage_list() == [1, 1, 0, 0]
    assert tree.confidence.tolist() == pytest.approx([0.9, 0.9, 0.5, 0.5])
    # A path the draft already holds adds nothing.
    same = add_path(chain, Draft(torch.tensor([5, 6])), stage=1)
    assert same.tokens.tolist() == [5, 6, 7] and same.parents is None and same.stage_list() == [0, 0, 0]


def test_keep_refuses_a_child_before_its_parent():
    with pytest.raises(ValueError, match="put it after its child"):
        Draft(torch.tensor([5, 6])).keep([1, 0])


def test_expected_accepted_adds_the_reach_of_siblings():
    # two siblings at depth 1 (0.5, 0.3), a child of the first (0.5)
    assert expected_accepted([0.5, 0.3, 0.5], [-1, -1, 0]) == pytest.approx([0.0, 0.5, 0.8, 1.05])
    assert expected_accepted([0.5, 0.5]) == pytest.approx([0.0, 0.5, 0.75])


def test_best_chain_follows_first_children():
    tree = Draft(torch.tensor([1, 2, 3, 4, 5]), parents=torch.tensor([-1, -1, 0, 0, 2]))
    chain = tree.best_chain()
    assert chain.tokens.tolist() == [1, 3, 5] and chain.parents is None


class _FixedTree(Drafter):
    max_draft_len = 4
    max_nodes = 4

    def __init__(self, tokens, parents, probs=None):
        self.draft = Draft(torch.tensor(tokens), probs, None, torch.tensor(parents) if parents is not None else None)

    def propose(self, ctx, max_tokens):
        return self.draft


@pytest.mark.parametrize(
    "tokens, parents, message",
    [
        ([1, 2], [0, -1], "parent 0 for node 0: a node's parent is an earlier node, or -1"),
        ([1, 2], [-1, 1], "parent 1 for node 1"),
        ([1, 2], [-1, -2], "parent -2 for node 1"),
        ([1, 2], [-1], r"parents \(1,\); expected a \(2,\) integer tensor"),
        ([1, 2, 3, 4, 5], [-1, 0, 1, 2, 3], "returned 5 tokens but at most 4 were asked for"),
        ([1, 99], [-1, -1], "token id 99 outside the verifier's vocabulary"),
    ],
)
def test_invalid_trees_are_refused(tokens, parents, message):
    model = tiny_model("llama", 48, 1, seed=0)
    with pytest.raises(DraftError, match=message):
        hybrid.generate(
            model, torch.tensor([[1, 2, 3]]), drafter=_FixedTree(tokens, parents), scheduler=FixedScheduler(4)
        )


def test_rejection_rule_refuses_a_tree():
    model = tiny_model("llama", 48, 1, seed=0)
    probs = torch.full((2, 48), 1 / 48)
    with pytest.raises(DraftError, match="tree under acceptance='rejection', which verifies chains"):
        hybrid.generate(
            model,
            torch.tensor([[1, 2, 3]]),
            drafter=_FixedTree([1, 2], [-1, -1], probs),
            scheduler=FixedScheduler(2),
            do_sample=True,
            acceptance="rejection",
            max_new_tokens=4,
        )
