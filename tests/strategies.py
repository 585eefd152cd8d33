"""Hypothesis strategies that build the world: a random tiny verifier, a prompt, a drafter, a scheduler."""

from __future__ import annotations

import copy

import torch
from hypothesis import strategies as st
from transformers import SuppressTokensLogitsProcessor

from drafters import (
    BlockDiffusionDrafter,
    ChainDrafter,
    Draft,
    DraftContext,
    Drafter,
    ModelDrafter,
    PromptLookupDrafter,
)
from drafters.block_diffusion import MASKED_INPUTS, BlockDiffusionConfig, BlockDiffusionModel, verifier_fingerprint
from drafters.ngram_store import NgramStore
from hybrid.testing import (
    ARCHITECTURES,
    LLAMA_LIKE,
    AdversarialDrafter,
    RandomTreeDrafter,
    smoothed_point_masses,
    tiny_model,
)
from schedulers import ConfidenceScheduler, CostAwareScheduler, FixedScheduler, HeuristicScheduler
from verifiers.own_state import state_format
from verifiers.probes import padding_changes_outputs
from verifiers.support import keeps_states, masked_window_problem, row_mask_problem, slot_position_problem

# Architectures whose forward over a whole sequence is not how `generate` decodes it: Moshi's own mask ignores the
# window its cache keeps, so past the window a fresh forward gives other states than decoding does; an indexer
# (DeepSeek-V3.2's, GLM-5's, DeepSeek-V4's) breaks its ties over another row in a forward than in a one-token step.
DECODES_UNLIKE_A_FRESH_FORWARD = ("moshi", "deepseek_v32", "glm_moe_dsa", "deepseek_v4")
# Architectures whose `generate` decodes a row of a batch otherwise than the row alone (RWKV's one-token step mixes
# the rows' states): hybrid refuses their batches (tests/test_own_state.py).
BATCHES_UNLIKE_ROWS_ALONE = ("rwkv",)


@st.composite
def verifiers(draw, fresh_forward_reference: bool = False, batches: bool = False):
    """A random tiny verifier; `fresh_forward_reference`: one whose decoding a fresh forward over the sequence
    reproduces (what properties that compare against such a forward need); `batches`: one whose batches hybrid
    serves."""
    excluded = DECODES_UNLIKE_A_FRESH_FORWARD if fresh_forward_reference else ()
    excluded += BATCHES_UNLIKE_ROWS_ALONE if batches else ()
    arch = draw(st.sampled_from(sorted(set(ARCHITECTURES) - set(excluded))))
    window = (
        draw(st.sampled_from([None, 4, 9]))
        if arch in ("mistral", "gpt_neo", "gemma4", "gemma3n", "moshi", "llama4", "deepseek_v4")
        else None
    )
    return tiny_model(arch, draw(st.integers(32, 96)), draw(st.integers(1, 2)), draw(st.integers(0, 2**16)), window)


def cache_layouts(model):
    """The cache layouts to draw for `model`: the static one only where the model takes hybrid's per-row masks and
    keeps its state in the cache's layers (tests/test_model_support.py and tests/test_own_state.py check the
    refusals elsewhere)."""
    static = row_mask_problem(model) is None and state_format(model) is None
    return st.sampled_from([None, "static"] if static else [None])


def prompts(vocab_size: int, max_len: int = 12):
    return st.lists(st.integers(0, vocab_size - 1), min_size=1, max_size=max_len).map(lambda ids: torch.tensor([ids]))


def attention_window(model) -> int | None:
    """The window of `model`'s windowed layers (a sliding window, GPT-Neo's local one), else None."""
    text = model.config.get_text_config()
    return getattr(text, "sliding_window", None) or getattr(text, "window_size", None)


@st.composite
def holes(draw, length: int, model=None):
    """Positions to mask inside a prompt of `length` tokens, never its first or last: none, or 1-3 of them. Where
    `model` attends within a window, they are drawn among the last `window` positions, where a masked token changes
    what a window holds; models that cannot honour such a hole (`masked_window_problem`, `slot_position_problem`,
    `keeps_states`: refused) get none."""
    if length < 3 or model is None:
        return []
    if masked_window_problem(model) or slot_position_problem(model) or keeps_states(model):
        return []
    window = attention_window(model)
    low = 1 if window is None else max(1, length - 1 - window)
    return draw(st.lists(st.integers(low, length - 2), max_size=3, unique=True), label="masked positions")


@st.composite
def prompt_masks(draw, input_ids: torch.Tensor, model):
    """None, or an attention mask [1, n] for `input_ids` with left padding and/or masked tokens inside it."""
    n = input_ids.shape[1]
    if slot_position_problem(model) is not None:  # masked tokens count as positions there: refused
        return None
    if padding_changes_outputs(model):  # generate folds the padding into the row (RWKV's state): refused
        return None
    if not draw(st.booleans(), label="attention_mask"):
        return None
    mask = torch.ones(1, n, dtype=torch.long)
    mask[0, : draw(st.integers(0, n - 1), label="left padding")] = 0
    first = int(mask[0].argmax())
    for position in draw(holes(n - first, model)):
        mask[0, first + position] = 0
    return mask


@st.composite
def padded_batches(draw, vocab_size: int, pad: int = 0, max_len: int = 10, model=None):
    """(input_ids, attention_mask, rows): 2-4 prompts of any lengths, left-padded with `pad` (sometimes more
    than the longest needs); `rows` are the prompts unpadded, as lists. With `model`, some rows also have masked
    tokens inside them (`holes`): row r's own mask is then attention_mask[r, -len(rows[r]):]. A model that places
    tokens by cache slot (`slot_position_problem`, where masked tokens are refused) or whose `generate` lets padding
    change a row (`padding_changes_outputs`: refused) gets rows of one length."""
    lengths = draw(st.lists(st.integers(1, max_len), min_size=2, max_size=4), label="prompt lengths")
    unpadded = model is not None and (slot_position_problem(model) is not None or padding_changes_outputs(model))
    if unpadded:
        lengths = [lengths[0]] * len(lengths)
    token = st.integers(0, vocab_size - 1).filter(lambda t: t != pad)
    rows = [draw(st.lists(token, min_size=n, max_size=n), label="prompt") for n in lengths]
    width = max(lengths) + (0 if unpadded else draw(st.integers(0, 2), label="extra padding"))
    input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    for r, row in enumerate(rows):
        for position in draw(holes(len(row), model)):
            mask[r, width - len(row) + position] = 0
    return input_ids, mask, rows


class LyingDrafter(Drafter):
    """Proposes one token everywhere while reporting it as nearly impossible (q = 1e-9; rows finite, positive,
    summing to 1): under the rejection rule min(1, p/q) = 1 would accept it almost always."""

    max_draft_len = 6

    def __init__(self, vocab_size: int, token: int):
        self.vocab_size, self.token = vocab_size, token

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        probs = torch.full((max_tokens, self.vocab_size), (1 - 1e-9) / (self.vocab_size - 1))
        probs[:, self.token] = 1e-9
        return Draft(torch.full((max_tokens,), self.token), probs)


class MeddlingDrafter(Drafter):
    """Writes into everything its context hands it: the committed ids, the processors (their settings, one added,
    each called), its row, and the RNGs it can reach (reseeded); then proposes the tail of the ids it garbled."""

    max_draft_len = 6

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        ctx.input_ids[0, -1] = (ctx.input_ids[0, -1] + 1) % self.vocab_size
        for processor in ctx.processors:
            for setting in ("penalty", "temperature", "ngram_size", "top_k"):
                if isinstance(getattr(processor, setting, None), (int, float)):
                    setattr(processor, setting, getattr(processor, setting) * 2)
        if not any(isinstance(p, SuppressTokensLogitsProcessor) for p in ctx.processors):
            ctx.processors.append(SuppressTokensLogitsProcessor([int(ctx.input_ids[0, -1])]))
        ctx.choose(torch.zeros(self.vocab_size), ctx.input_ids)  # stateful processors see a drafter's call
        ctx.row = 0
        torch.manual_seed(0)
        if ctx.generator is not None:
            ctx.generator.manual_seed(0)
        tokens = ctx.input_ids[0].flip(0)[:max_tokens]
        if not ctx.do_sample:
            return Draft(tokens)
        return Draft(tokens, smoothed_point_masses(tokens, self.vocab_size))


class HiddenStateMeddler(Drafter):
    """Reads the verifier's hidden states (embeddings and last layer), overwrites them in place, and drafts from
    what it wrote."""

    hidden_layers = (0, -1)
    max_draft_len = 4

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        states = ctx.hidden_states()
        if states is None or states.shape[1] == 0:
            return Draft.empty(ctx.input_ids.device)
        states.mul_(-3.0).add_(1.0)
        tokens = (states[0, -max_tokens:].abs().sum(-1) * 1000).long() % self.vocab_size
        if not ctx.do_sample:
            return Draft(tokens)
        return Draft(tokens, torch.nn.functional.one_hot(tokens, self.vocab_size).float())


def perturbed_copy(model, scale: float, seed: int):
    twin = copy.deepcopy(model)
    gen = torch.Generator(torch.get_default_device()).manual_seed(seed)
    with torch.no_grad():
        for param in twin.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * scale)
    return twin


def random_block_drafter(
    model,
    seed: int,
    draft_vocab_size: int | None = None,
    block_size: int = 6,
    lookup_ngram: int = 0,
    lookup_tokens: int | None = None,
    ngram_store: NgramStore | None = None,
    store_min_n: int = 2,
    lookup_max_ngram: int = 3,
    prefer_store: float | None = None,
    masked_input: str = "anchor",
    branch: int = 0,
    refill_below: float = 0.0,
    **kwargs,
):
    """A random-weight BlockDiffusionDrafter for `model` (`kwargs` are its own), its draft vocabulary a random subset
    of the verifier's, its masked positions reading `masked_input`. With `lookup_ngram` >= 1 or an `ngram_store`, the ChainDrafter of a PromptLookupDrafter
    (min_ngram=lookup_ngram, max_ngram=lookup_max_ngram, up to `lookup_tokens`, by default the block's) and it, the
    block model branching off the lookup's draft with its own first `branch` tokens and redrafting it from its
    first token of confidence < `refill_below`."""
    vocab = model.config.vocab_size
    size = vocab if draft_vocab_size is None else draft_vocab_size
    config = BlockDiffusionConfig.for_verifier(
        model, block_size=block_size, draft_vocab_size=size, masked_input=masked_input
    )
    torch.manual_seed(seed)
    drafter_model = BlockDiffusionModel(config)
    with torch.no_grad():
        drafter_model.mask_embedding.normal_()
        drafter_model.draft_vocab.copy_(torch.randperm(vocab)[:size].sort().values)
    block = BlockDiffusionDrafter(drafter_model, model, **kwargs)
    if not lookup_ngram and ngram_store is None:
        return block
    lookup = PromptLookupDrafter(
        max_ngram=lookup_max_ngram,
        min_ngram=lookup_ngram,
        max_draft_len=block.max_draft_len if lookup_tokens is None else lookup_tokens,
        ngram_store=ngram_store,
        store_min_n=store_min_n,
        prefer_store=prefer_store,
        verifier=model,
    )
    return ChainDrafter([lookup, block], branch=branch, refill_below=refill_below)


def ngram_store_for(model, seed: int, own_answers: bool) -> NgramStore:
    """An NgramStore over `model`'s vocabulary: of its own greedy continuations of random prompts (so lookups hit
    and drafts get accepted), or of random token sequences (lookups hit, drafts mostly rejected)."""
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    answers = []
    for _ in range(4):
        prompt = torch.randint(vocab, (1, 3), generator=gen)
        if own_answers:
            ids = model.generate(
                prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16, do_sample=False, pad_token_id=0
            )[0]
        else:
            ids = torch.cat([prompt[0], torch.randint(vocab, (16,), generator=gen)])
        answers.append((ids.tolist(), 3))
    return NgramStore.build(answers, vocab, max_n=3, min_count=1, verifier=verifier_fingerprint(model))


@st.composite
def drafters_for(draw, model, eos_token_id: int | None):
    """Every kind of drafter the engine must stay lossless with."""
    kinds = ["random", "self", "perturbed", "lookup", "adversarial", "liar", "block", "tree", "meddling", "none"]
    if type(model).config_class.model_type not in LLAMA_LIKE:  # the block model is built for Llama-like verifiers
        kinds.remove("block")
    kind = draw(st.sampled_from(kinds))
    vocab = model.config.vocab_size
    seed = draw(st.integers(0, 2**16))
    if kind == "random":
        arch = draw(st.sampled_from(sorted(ARCHITECTURES)))
        return ModelDrafter(tiny_model(arch, vocab, 1, seed), max_draft_len=8)
    if kind == "self":
        return ModelDrafter(model, max_draft_len=8)
    if kind == "perturbed":
        return ModelDrafter(perturbed_copy(model, draw(st.sampled_from([0.01, 0.1])), seed), max_draft_len=8)
    store = (
        ngram_store_for(model, seed, draw(st.booleans()))
        if kind in ("lookup", "block") and draw(st.booleans())
        else None
    )
    if kind == "lookup":
        return PromptLookupDrafter(
            max_ngram=draw(st.sampled_from([1, 2, 3, 32])),
            max_draft_len=draw(st.integers(1, 8)),
            ngram_store=store,
            store_min_n=draw(st.integers(1, 3)),
            prefer_store=draw(st.sampled_from([None, 0.0, 0.5])) if store else None,
        )
    if kind == "adversarial":
        return AdversarialDrafter(vocab, eos_token_id, seed)
    if kind == "tree":
        guide = ModelDrafter(perturbed_copy(model, draw(st.sampled_from([0.0, 0.01])), seed), max_draft_len=8)
        return RandomTreeDrafter(vocab, eos_token_id, seed, guide=guide)
    if kind == "liar":
        return LyingDrafter(vocab, draw(st.integers(0, vocab - 1)))
    if kind == "meddling":
        return draw(st.sampled_from([MeddlingDrafter, HiddenStateMeddler]), label="meddler")(vocab)
    if kind == "block":
        lookup_ngram = draw(st.sampled_from([0, 1, 2]))
        return random_block_drafter(
            model,
            seed,
            draft_vocab_size=draw(st.sampled_from([None, vocab // 2])),
            block_size=draw(st.integers(2, 9)),
            steps=draw(st.integers(1, 3)),
            threshold=draw(st.sampled_from([0.0, 0.5, 1.0])),
            max_nodes=draw(st.sampled_from([None, 1, 12])),
            branching=draw(st.integers(1, 4)),
            lookup_ngram=lookup_ngram,
            lookup_tokens=draw(st.sampled_from([None, 3, 12])) if lookup_ngram or store else None,
            ngram_store=store,
            store_min_n=draw(st.integers(1, 3)),
            lookup_max_ngram=draw(st.sampled_from([3, 32])),
            prefer_store=draw(st.sampled_from([None, 0.5])) if store else None,
            masked_input=draw(st.sampled_from(MASKED_INPUTS)),
            branch=draw(st.sampled_from([0, 1, 3])) if lookup_ngram or store else 0,
            refill_below=draw(st.sampled_from([0.0, 0.3, 1.0])) if lookup_ngram or store else 0.0,
        )
    return None


@st.composite
def schedulers_for(draw, drafter):
    """Every scheduler; cost-aware ones get a synthetic cost curve (flat to steep) instead of timing a tiny model."""
    kind = draw(st.sampled_from(["heuristic", "fixed", "confidence", "cost-aware"]))
    if drafter is None or kind == "heuristic":
        return HeuristicScheduler(draw(st.integers(1, 4)))
    if kind == "fixed":
        return FixedScheduler(draw(st.integers(1, drafter.node_budget)))
    if kind == "confidence":
        return ConfidenceScheduler(draw(st.sampled_from([0.0, 0.2, 0.6, 1.0])))
    return CostAwareScheduler(costs={1: 1.0, 17: draw(st.sampled_from([1.0, 2.5, 20.0]))})
