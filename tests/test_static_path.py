"""The static-shape path (`cache_implementation="static"`): few shapes, fixed buffers, the same tokens, compiled.

Its losslessness properties run with the others: tests/test_greedy_lossless.py, test_batch.py and
test_shared_cache.py draw the static layout as one of their cases.
"""

from __future__ import annotations

import pytest
import torch
from strategies import random_block_drafter, tiny_model
from transformers import CompileConfig

import hybrid
import verifiers.support as support_module
from drafters import PromptLookupDrafter
from schedulers import FixedScheduler
from verifiers.cache import SharedCache
from verifiers.verifier import static_width


def test_static_path_has_few_shapes_and_fixed_buffers():
    """cache_implementation="static": after the prefill every verifier forward reads the whole cache and is
    fed one of the padded widths (1, 2, 4, 8, 9 for drafts of up to 8), and no buffer moves, so a compiled
    step is replayed, never re-traced; the output is plain generate's."""
    model = tiny_model("llama", 48, 2, seed=3)
    input_ids = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6]])
    shapes, addresses = set(), set()

    def record(_, args, kwargs):
        cache = kwargs.get("cache")
        if isinstance(cache, SharedCache) and cache.lengths[0]:  # past the prefill
            shapes.add((tuple(kwargs["input_ids"].shape), tuple(kwargs["attention_mask"].shape)))
            addresses.add(tuple(buffer.data_ptr() for buffer in cache.buffers()))

    hook = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        out = hybrid.generate(
            model,
            input_ids,
            drafter=PromptLookupDrafter(max_draft_len=8),
            max_new_tokens=60,
            do_sample=False,
            cache_implementation="static",
        )
    finally:
        hook.remove()
    assert torch.equal(out, model.generate(input_ids, max_new_tokens=60, do_sample=False))
    assert {width for (_, width), _ in shapes} <= {1, 2, 4, 8, 9}, shapes
    assert {mask[-1] for _, mask in shapes} == {256}, "every slot of a 256-slot cache, at every step"
    assert len(addresses) == 1, "the buffers never move"


def test_static_path_needs_per_row_masks(monkeypatch):
    model = tiny_model("llama", 48, 2, seed=3)
    monkeypatch.setattr(support_module, "MASKED_ATTENTION", ())
    with pytest.raises(ValueError, match=r"cache_implementation='static'.*attn_implementation='sdpa'"):
        hybrid.generate(model, torch.tensor([[1, 2, 3]]), drafter=None, max_new_tokens=2, cache_implementation="static")


def test_static_width_is_the_next_power_of_two_up_to_the_widest():
    assert [static_width(m, 17) for m in (1, 2, 3, 5, 9, 16, 17)] == [1, 2, 4, 8, 16, 16, 17]
    with pytest.raises(ValueError, match=r"a verify of 18 tokens on a static path sized for at most 17"):
        static_width(18, 17)


def test_block_drafter_drafts_the_same_on_the_static_path():
    """The block drafter reads its whole context buffer through a mask on the static path: the same drafts
    with the same confidences, step by step."""
    model = tiny_model("llama", 64, 2, seed=5)
    input_ids = torch.tensor([[3, 9, 27, 3, 9, 27, 3, 9, 11, 40]])
    runs = []
    for static in (None, "static"):
        drafter = random_block_drafter(model, seed=1, block_size=6, steps=2, threshold=0.0)
        drafts, propose = [], drafter.propose
        drafter.propose = lambda ctx, n, drafts=drafts, propose=propose: drafts.append(propose(ctx, n)) or drafts[-1]
        hybrid.generate(
            model,
            input_ids,
            drafter=drafter,
            scheduler=FixedScheduler(5),
            max_new_tokens=40,
            do_sample=False,
            cache_implementation=static,
        )
        runs.append(drafts)
    dynamic, static = runs
    assert [d.tokens.tolist() for d in dynamic] == [d.tokens.tolist() for d in static]
    assert len({tuple(d.tokens.tolist()) for d in dynamic}) > 3, "the drafts vary: the model drafts, not a constant"
    for a, b in zip(dynamic, static):
        torch.testing.assert_close(a.confidence, b.confidence)


def test_compiled_static_path_matches_generate_and_never_retraces():
    """Compiled (torch.compile on this CPU, CUDA graphs on a GPU): the output is plain generate's, the first call
    compiles a graph per verify width at most (not one per step), and a second call compiles nothing new."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = tiny_model("llama", 64, 2, seed=3)
    input_ids = torch.tensor([[5, 9, 5, 9, 17, 3, 5, 9]])
    config = CompileConfig(mode="default")
    config._compile_all_devices = True  # as in model.generate: compile off-GPU only when asked
    expected = model.generate(input_ids, max_new_tokens=40, do_sample=False)
    drafter = random_block_drafter(model, seed=2, block_size=6)
    for _ in range(2):
        out = hybrid.generate(
            model,
            input_ids,
            drafter=drafter,
            max_new_tokens=40,
            do_sample=False,
            cache_implementation="static",
            compile_config=config,
        )
        assert torch.equal(out, expected)
        graphs = counters["stats"]["unique_graphs"]
        if _ == 0:
            first = graphs
    widths = {static_width(m, 1 + drafter.max_draft_len) for m in range(1, 2 + drafter.max_draft_len)}
    assert 0 < first <= len(widths) + 1, f"{first} graphs: at most one per verify width and one for the drafter"
    assert graphs == first, f"the second call compiled {graphs - first} more graphs"


def test_compile_config_on_cpu_warns_and_runs_eagerly():
    model = tiny_model("llama", 48, 2, seed=3)
    input_ids = torch.tensor([[1, 2, 3]])
    with pytest.warns(UserWarning, match=r"compile_config is not used on cpu.*_compile_all_devices"):
        out = hybrid.generate(
            model,
            input_ids,
            drafter=None,
            max_new_tokens=5,
            do_sample=False,
            cache_implementation="static",
            compile_config=CompileConfig(),
        )
    assert torch.equal(out, model.generate(input_ids, max_new_tokens=5, do_sample=False))
