"""What hybrid serves and what it refuses, model by model: each case once gave output different from
`model.generate`'s without a word, or failed deep inside transformers. Now it equals `generate` or raises an error
that names the problem and the fix."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from strategies import HiddenStateMeddler, LyingDrafter, MeddlingDrafter, RandomTreeDrafter
from transformers import (
    OpenAIGPTConfig,
    OpenAIGPTLMHeadModel,
    RwkvConfig,
    RwkvForCausalLM,
    xLSTMConfig,
    xLSTMForCausalLM,
)

import hybrid
from drafters import Draft, ModelDrafter, PromptLookupDrafter
from drafters.oracle import OracleDrafter
from hybrid.testing import AdversarialDrafter, check_greedy_lossless, check_sampled_identical, tiny_model
from schedulers import FixedScheduler
from verifiers import cache_layers, cost_table, probes, support

GREEDY = {"do_sample": False, "pad_token_id": 0}


def two_prompts(vocab: int):
    """A left-padded batch of two prompts of lengths 10 and 13 (padding 0), and the prompts alone."""
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randint(1, vocab, (10,), generator=gen), torch.randint(1, vocab, (13,), generator=gen)
    ids = torch.stack([torch.cat([torch.zeros(3, dtype=torch.long), a]), b])
    mask = torch.tensor([[0] * 3 + [1] * 10, [1] * 13])
    return ids, mask, [a, b]


def assert_rows_equal_batch_one(model, ids, mask, rows, drafter, **kwargs):
    batch = hybrid.generate(model, ids, attention_mask=mask, drafter=drafter, max_new_tokens=20, **GREEDY, **kwargs)
    for r, row in enumerate(rows):
        alone = model.generate(row[None], max_new_tokens=20, **GREEDY)[0, len(row) :]
        assert torch.equal(batch[r, ids.shape[1] :], alone), f"row {r}"


@pytest.mark.parametrize("arch", ["gpt_neo", "bloom", "falcon", "mpt"])
def test_models_that_build_their_own_masks_batch_row_by_row(arch):
    """GPT-Neo's local attention (window 7) lives inside its attention modules and ALiBi models build their bias
    from a 2-D mask: neither can take per-row masks, so a batch decodes one row per forward, each row exactly."""
    model = tiny_model(arch, 96, 2, seed=0, sliding_window=7 if arch == "gpt_neo" else None)
    ids, mask, rows = two_prompts(96)
    for drafter in (PromptLookupDrafter(), ModelDrafter(model)):
        assert_rows_equal_batch_one(model, ids, mask, rows, drafter)
    check_greedy_lossless(model, rows[1][None], PromptLookupDrafter(), max_new_tokens=20, pad_token_id=0)


@pytest.mark.parametrize("arch", ["gpt_neo", "bloom", "falcon", "mpt"])
def test_static_path_refuses_models_without_per_row_masks(arch):
    model = tiny_model(arch, 96, 2, seed=0, sliding_window=7 if arch == "gpt_neo" else None)
    with pytest.raises(ValueError, match=r"static.*per-row masks.*Drop cache_implementation"):
        hybrid.generate(model, torch.tensor([[1, 2, 3]]), drafter=None, max_new_tokens=4, cache_implementation="static")


def test_rotary_model_runs_past_max_position_embeddings_as_generate():
    """RoPE has no table: `generate` goes on past max_position_embeddings, and so does hybrid, never clamping."""
    model = tiny_model("llama", 96, 2, seed=0, max_position_embeddings=32)
    prompt = torch.randint(1, 96, (1, 20), generator=torch.Generator().manual_seed(1))
    for drafter in (None, PromptLookupDrafter(), ModelDrafter(model)):
        report = check_greedy_lossless(model, prompt, drafter, max_new_tokens=30, pad_token_id=0)
        assert report.near_tie_at is None


SWITCH = 16  # where the rotary embeddings below leave their original frequencies
SWITCHING_ROPES = {
    "longrope": {"short_factor": [1.0] * 4, "long_factor": [2.0, 3.0, 4.0, 5.0]},
    "dynamic": {"factor": 2.0},
}


def switching_rope_model(rope_type: str, seed: int):
    """A tiny Llama whose rotary frequencies follow a forward's last position past SWITCH: LongRoPE's long factors,
    or dynamic NTK scaling to the largest position reached (module state)."""
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SWITCH,
        initializer_range=0.3,
    )
    config.rope_parameters = {"rope_type": rope_type, "rope_theta": 10000.0, **SWITCHING_ROPES[rope_type]}
    if rope_type == "longrope":
        config.rope_parameters["original_max_position_embeddings"] = SWITCH
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("rope_type", sorted(SWITCHING_ROPES))
@pytest.mark.parametrize("prompt_len", [3, 13, 20], ids=["crossing-early", "crossing-at-once", "past"])
def test_a_rotary_embedding_that_switches_by_a_forwards_last_position_decodes_as_generate(rope_type, prompt_len):
    """A verify whose drafts reach past the switch would give its earlier tokens the other frequencies: every
    forward stays on one side, and past a dynamic NTK switch the model decodes one token per step."""
    for seed in range(2):
        model = switching_rope_model(rope_type, seed)
        prompt = torch.tensor([[1, 2, 3] * 10])[:, :prompt_len]
        model.generate(prompt, max_new_tokens=30)  # dynamic NTK keeps what an earlier call reached: hybrid too
        for drafter in (
            AdversarialDrafter(64, None, seed),
            PromptLookupDrafter(),
            RandomTreeDrafter(64, None, seed, guide=PromptLookupDrafter()),
        ):
            for static in (None, "static") if isinstance(drafter, PromptLookupDrafter) else (None,):
                kwargs = {"max_new_tokens": 30, "hybrid_kwargs": {"cache_implementation": static}}
                check_greedy_lossless(model, prompt, drafter, **kwargs)
                if not isinstance(drafter, RandomTreeDrafter):
                    check_sampled_identical(model, prompt, drafter, seed, **kwargs)


def test_the_rotary_state_an_earlier_call_left_is_where_hybrid_starts(tmp_path, monkeypatch):
    """Dynamic NTK scaling keeps the largest position any forward reached, and a prompt past the switch is decoded
    with that position's frequencies, in `generate` as in hybrid: the probes hybrid runs on a model it has not
    seen (short forwards, which reset that state) leave it as the caller did."""
    monkeypatch.setenv("HYBRID_COSTS", str(tmp_path))  # no verdicts kept: this call probes
    model = switching_rope_model("dynamic", 5)
    prompt = torch.tensor([[1, 2, 3] * 7])
    model.generate(prompt, max_new_tokens=30)
    check_greedy_lossless(model, prompt, PromptLookupDrafter(), max_new_tokens=10)


def padded_pair():
    """Two prompts of four tokens, the first left-padded by one, and greedy settings with their mask."""
    ids, mask = torch.tensor([[0, 5, 6, 7], [4, 5, 6, 7]]), torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    return ids, mask, {"attention_mask": mask, "pad_token_id": 0, "do_sample": False}


def test_a_batch_that_would_reach_a_rotary_switch_is_refused():
    """The switch reads a forward's last position over the whole batch, which hybrid's uneven rows reach at other
    steps than `generate`'s: a batch that stays within it is served, one that would reach it is refused."""
    model = switching_rope_model("longrope", 0)
    ids, mask, settings = padded_pair()
    assert torch.equal(
        hybrid.generate(model, ids, drafter=PromptLookupDrafter(), max_new_tokens=12, **settings),
        model.generate(ids, max_new_tokens=12, **settings),
    )
    with pytest.raises(ValueError, match=r"position 16, by the batch's longest row.*pass one prompt per call"):
        hybrid.generate(model, ids, drafter=PromptLookupDrafter(), max_new_tokens=13, **settings)


LONGROPE_AT = 24  # original_max_position_embeddings of the Phi-3 models below


def tiny_phi(kind: str, seed: int = 0):
    """A tiny Phi-3 or PhiMoE with LongRoPE past LONGROPE_AT, as Phi-3-mini-128k and Phi-3.5 have it: its
    `prepare_inputs_for_generation` drops the cache there and re-reads the sequence with the long factors."""
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": LONGROPE_AT}
    rope |= {"short_factor": [1.0, 1.2, 1.5, 2.0], "long_factor": [3.0, 5.0, 8.0, 13.0]}
    if kind == "phimoe":
        rope |= {"short_mscale": 1.0, "long_mscale": 1.2}
    sizes = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    sizes |= dict(num_key_value_heads=4, max_position_embeddings=96, original_max_position_embeddings=LONGROPE_AT)
    config_class, model_class = {
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
        "phimoe": (transformers.PhimoeConfig, transformers.PhimoeForCausalLM),
    }[kind]
    extra = dict(num_local_experts=4, num_experts_per_tok=2) if kind == "phimoe" else {}
    config = config_class(**sizes, **extra, rope_parameters=rope, initializer_range=0.3, pad_token_id=0)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return model_class(config).eval()


@pytest.mark.parametrize("kind", ["phi3", "phimoe"])
def test_a_model_whose_generate_rereads_the_sequence_at_a_position_decodes_as_generate(kind):
    """Phi-3's and PhiMoE's `generate` drop the cache once the sequence grows past LONGROPE_AT and re-read it with
    LongRoPE's long factors: hybrid re-reads there too, with every drafter, greedy and sampled, on both layouts."""
    model = tiny_phi(kind)
    for prompt_len in (20, 24):
        prompt = torch.randint(2, 128, (1, prompt_len), generator=torch.Generator().manual_seed(prompt_len))
        drafters = [None, PromptLookupDrafter(), AdversarialDrafter(128, None, prompt_len)]
        drafters.append(RandomTreeDrafter(128, None, prompt_len, guide=PromptLookupDrafter()))
        for drafter in drafters:
            kwargs = {"max_new_tokens": 12, "pad_token_id": 0}
            report = check_greedy_lossless(model, prompt, drafter, **kwargs)
            assert report.near_tie_at is None
            if not isinstance(drafter, RandomTreeDrafter):
                check_sampled_identical(model, prompt, drafter, prompt_len, **kwargs)
        check_greedy_lossless(
            model, prompt, PromptLookupDrafter(), hybrid_kwargs={"cache_implementation": "static"}, **kwargs
        )


def test_a_batch_or_a_padded_prompt_that_would_reach_a_reread_is_refused():
    """`generate` re-reads at a length that counts a row's padding, which hybrid's rows do not share: refused by
    name where a call would reach it, served where it stays short of it."""
    model = tiny_phi("phi3")
    ids, mask, settings = padded_pair()
    assert torch.equal(
        hybrid.generate(model, ids, drafter=PromptLookupDrafter(), max_new_tokens=20, **settings),
        model.generate(ids, max_new_tokens=20, **settings),
    )
    with pytest.raises(ValueError, match=r"re-reads the whole sequence.*past 24 tokens.*one unpadded prompt"):
        hybrid.generate(model, ids, drafter=PromptLookupDrafter(), max_new_tokens=30, **settings)
    settings["attention_mask"] = mask[:1]
    with pytest.raises(ValueError, match=r"re-reads the whole sequence.*past 24 tokens"):
        hybrid.generate(model, ids[:1], drafter=None, max_new_tokens=30, **settings)


class ShiftingStepLlama(transformers.LlamaForCausalLM):
    """A model whose `generate` feeds its steps something else than their token past position 10."""

    def prepare_inputs_for_generation(self, input_ids, **kwargs):
        inputs = super().prepare_inputs_for_generation(input_ids, **kwargs)
        if input_ids.shape[1] > 10:
            inputs["input_ids"] = (inputs["input_ids"] + 1) % self.config.vocab_size
        return inputs


def test_a_model_whose_generate_feeds_other_step_inputs_is_refused_where_it_would():
    config = tiny_model("llama", 64, 2, seed=0).config
    model = ShiftingStepLlama(config).eval()
    prompt = torch.tensor([[1, 2, 3, 4, 5]])
    check_greedy_lossless(model, prompt, PromptLookupDrafter(), max_new_tokens=5, pad_token_id=0)
    with pytest.raises(ValueError, match=r"other inputs than the newest token at position 10.*input_ids"):
        hybrid.generate(model, prompt, drafter=None, max_new_tokens=10, pad_token_id=0)


@pytest.mark.parametrize("arch", ["gpt2", "opt"])
def test_learned_position_table_bounds_the_call(arch):
    """Past a learned table `generate` fails with IndexError mid-way; hybrid refuses up front, naming the fix."""
    model = tiny_model(arch, 96, 2, seed=0, max_position_embeddings=32)
    prompt = torch.randint(1, 96, (1, 20), generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match=r"past the 32 positions .* lower max_new_tokens to at most 12"):
        hybrid.generate(model, prompt, drafter=PromptLookupDrafter(), max_new_tokens=30, **GREEDY)
    with pytest.raises(ValueError, match=r"shorten the prompt"):
        hybrid.generate(model, torch.ones(1, 40, dtype=torch.long), drafter=None, max_new_tokens=1, **GREEDY)
    # Up to the table's end, drafts included, it equals generate.
    check_greedy_lossless(model, prompt, ModelDrafter(model), max_new_tokens=12, pad_token_id=0)


def test_attention_mask_with_a_hole_is_honoured():
    """`generate` masks a token inside the prompt (mask 0, or inferred from pad_token_id): so does hybrid."""
    model = tiny_model("llama", 64, 2, seed=3)
    ids = torch.tensor([[5, 17, 0, 33, 41, 8, 9]])
    mask = torch.tensor([[1, 1, 0, 1, 1, 1, 1]])
    for drafter in (PromptLookupDrafter(), ModelDrafter(model)):
        check_greedy_lossless(model, ids, drafter, attention_mask=mask, max_new_tokens=20, pad_token_id=0)
        check_greedy_lossless(model, ids, drafter, max_new_tokens=20, pad_token_id=0)  # mask inferred from the pad
    holes = torch.tensor([[1, 0, 1, 0, 0, 1, 1]])
    check_greedy_lossless(model, ids, PromptLookupDrafter(), attention_mask=holes, max_new_tokens=20, pad_token_id=0)


def holed_prompt(hole: int):
    """12 random tokens with position `hole` masked."""
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[0, hole] = 0
    return ids, mask


def check_each_layout(model, prompt, drafters, **kwargs):
    """Greedy output equals `generate`'s with each drafter, on the dynamic and the static cache layout."""
    for drafter in drafters:
        for static in (None, "static"):
            check_greedy_lossless(
                model, prompt, drafter, hybrid_kwargs={"cache_implementation": static}, **GREEDY, **kwargs
            )


def test_a_masked_token_inside_a_sliding_window_counts_as_generate_counts_it():
    """`generate` measures a sliding window in its cache positions, which count a masked token's slot: a token after
    the hole sees one real token fewer. hybrid's cache leaves the hole out, and its masks count it back in (plain
    decoding, chains, trees, the static layout, and a batch whose other row has no hole)."""
    model = tiny_model("mistral", 64, 2, seed=0, sliding_window=5)
    ids, mask = holed_prompt(9)
    out = hybrid.generate(model, ids, attention_mask=mask, drafter=None, max_new_tokens=8, **GREEDY)
    assert out[0, 12:].tolist() == [36, 3, 63, 28, 30, 50, 18, 61]  # model.generate's
    tree = RandomTreeDrafter(64, None, seed=1, guide=ModelDrafter(model))
    check_each_layout(model, ids, (None, ModelDrafter(model), tree), attention_mask=mask, max_new_tokens=16)
    other = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(5))
    batch = hybrid.generate(
        model,
        torch.cat([ids, other]),
        attention_mask=torch.cat([mask, torch.ones_like(mask)]),
        drafter=tree,
        max_new_tokens=16,
        **GREEDY,
    )
    for r, (row, row_mask) in enumerate([(ids, mask), (other, None)]):
        alone = model.generate(row, attention_mask=row_mask, max_new_tokens=16, **GREEDY)
        assert torch.equal(batch[r : r + 1], alone), f"row {r}"


def test_a_model_whose_own_mask_ignores_its_window_decodes_as_generate_past_it():
    """A config that declares a sliding window its model's masks ignore (Moshi's text model; here a Llama given one):
    `generate` attends fully over the prompt, then through a cache that keeps the window. hybrid's chains once
    followed the model's full mask past the window and its trees and static path windowed the prompt too."""
    model = tiny_model("llama", 96, 2, seed=0)
    model.config.sliding_window = 4  # read by the cache, as Moshi's is; Llama's mask never windows
    prompt = torch.randint(2, 96, (1, 12), generator=torch.Generator().manual_seed(1))
    prompt[0, 8:] = prompt[0, 2:6]
    reference = model.generate(prompt, max_new_tokens=20, **GREEDY)
    tree = RandomTreeDrafter(96, None, seed=1, guide=OracleDrafter(reference))
    check_each_layout(model, prompt, (None, PromptLookupDrafter(), tree), max_new_tokens=20)


def test_a_masked_token_inside_a_window_its_model_ignores_is_attended_over_as_generate_does():
    """Moshi's own mask ignores its window, so `generate`'s prefill of a holed prompt attends over all of it, while a
    model that applies its window counts the hole in it: the holed row's forward as `generate` runs it tells which."""
    model = tiny_model("moshi", 64, 2, seed=0, sliding_window=4)
    ids, mask = holed_prompt(9)
    tree = RandomTreeDrafter(64, None, seed=1, guide=ModelDrafter(model))
    check_each_layout(model, ids, (None, ModelDrafter(model), tree), attention_mask=mask, max_new_tokens=16)


def test_a_masked_token_a_local_window_of_its_own_would_miscount_is_refused():
    """GPT-Neo applies its local window inside its attention, over the slots hybrid's cache holds, which leave a
    masked token out: the window would hold one real token more than `generate`'s, so such a prompt is refused up
    front, batch rows included. Leading padding, and models whose windows take hybrid's masks, are served."""
    model = tiny_model("gpt_neo", 64, 2, seed=0, sliding_window=5)
    ids, mask = holed_prompt(10)
    refusal = (
        r"masks position 10 of row 0, after the row's first token, and GPTNeoForCausalLM cannot count it .*local window"
    )
    with pytest.raises(ValueError, match=refusal):
        hybrid.generate(model, ids, attention_mask=mask, drafter=None, max_new_tokens=8, **GREEDY)
    with pytest.raises(ValueError, match=r"masks position 10 of row 1"):
        hybrid.generate(
            model,
            torch.cat([ids, ids]),
            attention_mask=torch.cat([torch.ones_like(mask), mask]),
            drafter=None,
            max_new_tokens=8,
            **GREEDY,
        )
    padded = torch.ones_like(mask)
    padded[0, :3] = 0
    check_greedy_lossless(model, ids, ModelDrafter(model), attention_mask=padded, max_new_tokens=12, **GREEDY)


def test_a_masked_token_an_alibi_bias_over_slots_would_miscount_is_refused():
    """MPT's ALiBi bias is an arange over the key slots, which leave a masked token out: a hole between two tokens
    would shorten their distance, so such a prompt is refused. Bloom's and Falcon's bias counts only unmasked
    tokens (as hybrid's cache holds them) and is served exactly."""
    ids, mask = holed_prompt(2)
    with pytest.raises(ValueError, match=r"masks position 2 of row 0.*MptForCausalLM.*ALiBi bias counts key slots"):
        hybrid.generate(tiny_model("mpt", 64, 2, seed=0), ids, attention_mask=mask, drafter=None, **GREEDY)
    for arch in ("bloom", "falcon"):
        model = tiny_model(arch, 64, 2, seed=0)
        check_greedy_lossless(model, ids, PromptLookupDrafter(), attention_mask=mask, max_new_tokens=8, **GREEDY)


def test_model_that_ignores_the_cache_is_refused():
    """OpenAI GPT accepts `cache=` and drops it, so a verify would see only the fed tokens."""
    torch.manual_seed(0)
    model = OpenAIGPTLMHeadModel(OpenAIGPTConfig(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64)).eval()
    with pytest.raises(ValueError, match=r"did not store its keys/values in the cache"):
        hybrid.generate(model, torch.tensor([[1, 2, 3]]), drafter=PromptLookupDrafter(), max_new_tokens=5, **GREEDY)


def test_a_model_that_attends_ahead_is_refused():
    """BERT's LM head loaded without is_decoder=True attends both ways: its output at a token changes with the tokens
    after it, so even one token per forward gave text other than `generate`'s. As a decoder it is served."""
    config = transformers.BertConfig(
        vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
    )
    torch.manual_seed(0)
    model = transformers.BertLMHeadModel(config).eval()
    for drafter in (None, PromptLookupDrafter()):
        with pytest.raises(TypeError, match=r"attends to the tokens after each position.*is_decoder=True"):
            hybrid.generate(model, torch.tensor([[4, 5, 6, 4, 5]]), drafter=drafter, max_new_tokens=8, **GREEDY)
    check_greedy_lossless(
        tiny_model("bert", 96, 2, seed=0), torch.tensor([[4, 5, 6, 4, 5]]), PromptLookupDrafter(), max_new_tokens=20
    )


def test_a_model_whose_layers_mix_a_forwards_tokens_is_refused():
    """torch.ao's dynamic quantization scales all of a forward's tokens by their common range, so a token's output in
    a verify depends on the drafts after it: a causal Llama quantized so (its head kept in float) gave text other
    than `generate`'s without a word, its attention declaring itself causal."""
    quantize_dynamic = getattr(getattr(torch.ao, "quantization", None), "quantize_dynamic", None)
    if quantize_dynamic is None:
        pytest.skip("this torch has no torch.ao.quantization.quantize_dynamic")
    model = tiny_model("llama", 96, 2, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        model.model = quantize_dynamic(model.model, {torch.nn.Linear}, dtype=torch.qint8)
    for drafter in (None, PromptLookupDrafter()):
        with pytest.raises(TypeError, match=r"depends on the tokens after it.*dynamic quantization"):
            hybrid.generate(model, torch.tensor([[4, 5, 6, 4, 5]]), drafter=drafter, max_new_tokens=8, **GREEDY)


class OutlierColumnsLinear(torch.nn.Module):
    """LLM.int8's product: the columns where any of a forward's tokens exceeds the threshold are multiplied as they
    are, the rest after rounding each token's row to 127 steps of its own range."""

    def __init__(self, linear: torch.nn.Linear, threshold: float):
        super().__init__()
        self.linear, self.threshold = linear, threshold

    def forward(self, x):
        outliers = (x.reshape(-1, x.shape[-1]).abs() > self.threshold).any(0)
        rest = x.masked_fill(outliers, 0)
        step = rest.abs().amax(-1, keepdim=True).clamp_min(1e-8) / 127
        return self.linear(torch.where(outliers, x, (rest / step).round() * step))


def test_a_model_whose_layers_take_outlier_columns_across_a_forward_is_refused():
    """bitsandbytes' LLM.int8 (its default llm_int8_threshold=6) takes a column out of the int8 product wherever any
    of the forward's tokens exceeds the threshold: a token's output in a verify depends on the drafts after it. On
    SmolLM2 no other token of the vocabulary moves the columns; one large input feature does."""
    model = tiny_model("llama", 96, 2, seed=0)
    for layer in model.model.layers:  # the products whose inputs are normalized: ordinary tokens stay under 4.5
        for parent, name in [(layer.self_attn, n) for n in ("q_proj", "k_proj", "v_proj")] + [
            (layer.mlp, n) for n in ("gate_proj", "up_proj")
        ]:
            setattr(parent, name, OutlierColumnsLinear(getattr(parent, name), threshold=4.5))
    for drafter in (None, PromptLookupDrafter()):
        with pytest.raises(TypeError, match=r"depends on the tokens after it.*outlier columns"):
            hybrid.generate(model, torch.tensor([[4, 5, 6, 4, 5]]), drafter=drafter, max_new_tokens=8, **GREEDY)


class WidthKernelLinear(torch.nn.Module):
    """A product whose kernel depends on the forward's width, as some int8 products of activations quantized on the
    fly do: at the widths `rounds_at` names, after rounding each token's row to 15 steps of its own range."""

    def __init__(self, linear: torch.nn.Linear, rounds_at=lambda width: width > 1):
        super().__init__()
        self.linear, self.rounds_at = linear, rounds_at

    def forward(self, x):
        if self.rounds_at(x.shape[-2]):
            step = x.abs().amax(-1, keepdim=True).clamp_min(1e-8) / 15
            x = (x / step).round() * step
        return self.linear(x)


@pytest.mark.parametrize("rounds_at", [lambda width: width > 1, lambda width: width == 11], ids=["wide", "one-width"])
def test_a_model_whose_scores_depend_on_its_forwards_width_is_refused(rounds_at):
    """torchao's int8 products of per-token quantized activations score a token other numbers in a forward of several
    tokens than in one of one on a CPU, and bitsandbytes' at a few widths only: each token's output is still its own
    row's, yet a verify scores other numbers than `generate`'s steps."""
    model = tiny_model("llama", 96, 2, seed=0)
    for layer in model.model.layers:
        layer.mlp.up_proj = WidthKernelLinear(layer.mlp.up_proj, rounds_at)
    for drafter in (None, PromptLookupDrafter()):
        with pytest.raises(TypeError, match=r"depend on how many tokens its forward feeds"):
            hybrid.generate(model, torch.tensor([[4, 5, 6, 4, 5]]), drafter=drafter, max_new_tokens=8, **GREEDY)


def test_a_half_precision_model_of_other_modules_is_served_through_its_rounding():
    """A model built partly of other modules (an adapter, a wrapper) is probed; in bfloat16 a wider forward rounds
    each score differently by a few steps, which is no reason to refuse it."""
    model = tiny_model("llama", 96, 2, seed=0).to(torch.bfloat16)
    for layer in model.model.layers:
        layer.mlp.up_proj = WidthKernelLinear(layer.mlp.up_proj)
        layer.mlp.up_proj.forward = layer.mlp.up_proj.linear.forward  # a plain product: only the class is other
    assert not probes.scores_depend_on_width(model)
    check_greedy_lossless(model, torch.tensor([[4, 5, 6, 4, 5]]), PromptLookupDrafter(), max_new_tokens=16, **GREEDY)


def test_a_model_that_places_tokens_by_cache_slot_verifies_trees_as_chains():
    """BART's decoder takes no position_ids and puts fed tokens at the positions after its cache's slots, so a tree
    node fed beside its sibling sat one position too far; it once made a tree's walk accept a wrong token."""
    model = tiny_model("bart", 96, 2, seed=0)
    prompt = torch.randint(2, 96, (1, 9), generator=torch.Generator().manual_seed(1))
    reference = model.generate(prompt, max_new_tokens=24, **GREEDY)
    accepted = 0
    for seed in range(4):
        drafter = RandomTreeDrafter(96, None, seed, guide=OracleDrafter(reference))
        report = check_greedy_lossless(model, prompt, drafter, FixedScheduler(drafter.node_budget), max_new_tokens=24)
        accepted += sum(report.stats.accepted)
    assert accepted > 0  # the trees' chains were verified


def test_a_model_that_places_tokens_by_cache_slot_refuses_masked_prompt_tokens():
    """There `generate` counts a padded row's padding as positions, so its text for the row depends on the padding;
    hybrid places each row's tokens as if it were alone. Rows without padding batch as `generate` does."""
    model = tiny_model("bart", 96, 2, seed=0)
    ids, mask, rows = two_prompts(96)
    with pytest.raises(ValueError, match=r"masks tokens of row 0.*takes no position_ids"):
        hybrid.generate(model, ids, attention_mask=mask, drafter=PromptLookupDrafter(), max_new_tokens=8, **GREEDY)
    unpadded = torch.stack([rows[0], rows[1][:10]])
    expected = model.generate(unpadded, max_new_tokens=12, **GREEDY)
    for drafter in (None, PromptLookupDrafter()):
        assert torch.equal(hybrid.generate(model, unpadded, drafter=drafter, max_new_tokens=12, **GREEDY), expected)


def tiny_git() -> transformers.GitForCausalLM:
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64, image_size=32)
    config = transformers.GitConfig(
        vision_config=vision,
        vocab_size=96,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=128,
        initializer_range=0.3,  # logits far from uniform, so a changed mask changes tokens
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )
    torch.manual_seed(0)
    return transformers.GitForCausalLM(config).eval()


def test_an_image_encoders_position_table_does_not_bound_the_text():
    """GIT's image encoder has a table of its patches' positions (5 here), which no text token is placed by: once
    taken for the text's, it refused any call longer than that."""
    model = tiny_git()
    assert support.learned_position_limit(model) == 128
    prompt = torch.randint(1, 96, (1, 9), generator=torch.Generator().manual_seed(1))
    check_greedy_lossless(model, prompt, PromptLookupDrafter(), max_new_tokens=20, pad_token_id=0)


def test_a_model_whose_generate_reads_a_padded_row_off_its_slots_refuses_masked_prompt_tokens():
    """GIT's cached steps widen a 2-D mask by its image tokens, so under `generate` a left-padded row's text depends
    on its padding; hybrid decodes each row as if alone and once gave the row's own text without a word. Rows without
    padding batch as `generate` does."""
    model = tiny_git()
    ids, mask, rows = two_prompts(96)
    padded = model.generate(ids, attention_mask=mask, max_new_tokens=12, **GREEDY)[0, ids.shape[1] :]
    alone = model.generate(rows[0][None], max_new_tokens=12, **GREEDY)[0, rows[0].shape[0] :]
    assert not torch.equal(padded, alone)  # what hybrid cannot follow
    for drafter in (None, PromptLookupDrafter()):
        with pytest.raises(ValueError, match=r"masks tokens of row 0.*depends on its padding"):
            hybrid.generate(model, ids, attention_mask=mask, drafter=drafter, max_new_tokens=12, **GREEDY)
    unpadded = torch.stack([rows[0], rows[1][:10]])
    expected = model.generate(unpadded, max_new_tokens=12, **GREEDY)
    for drafter in (None, PromptLookupDrafter()):
        assert torch.equal(hybrid.generate(model, unpadded, drafter=drafter, max_new_tokens=12, **GREEDY), expected)


def test_a_probes_verdict_is_kept_for_later_processes_by_what_decides_it(monkeypatch):
    """A probe's verdict is read from disk by a later process with the same kind of model, not probed inside its
    first call; a model with a hook (which can change what it computes) is probed anew."""
    assert probes.padding_changes_outputs(tiny_git())
    monkeypatch.setattr(transformers.GitForCausalLM, "generate", None)  # a probe now fails: verdict False
    assert probes.padding_changes_outputs(tiny_git())  # a new model object: its verdict read from disk
    hooked = tiny_git()
    hooked.register_forward_hook(lambda module, args, output: output)
    assert not probes.padding_changes_outputs(hooked)
    assert not probes.padding_changes_outputs(tiny_model("llama", 96, 2, seed=0))


RECURRENT_MODELS = {
    "rwkv": lambda: RwkvForCausalLM(
        RwkvConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32, intermediate_size=64)
    ),
    "xlstm": lambda: xLSTMForCausalLM(
        xLSTMConfig(vocab_size=96, hidden_size=32, embedding_dim=32, num_hidden_layers=2, num_heads=2, num_blocks=2)
    ),
}


def test_recurrent_model_is_refused_clearly():
    """MiniMax keeps its lightning-attention state in a MiniMaxCache, the only cache its forward takes: refused by
    what it is (RWKV's and xLSTM's own state structures are served: tests/test_own_state.py)."""
    from experiments.architectures import tiny_from_defaults

    model = tiny_from_defaults("minimax").eval()
    with pytest.raises(ValueError, match=r"keeps its recurrent state in a structure of its own.*MiniMaxCache"):
        hybrid.generate(model, torch.tensor([[1, 2, 3]]), drafter=None, max_new_tokens=5, **GREEDY)


@pytest.mark.parametrize("kind", list(RECURRENT_MODELS))
def test_own_state_model_is_refused_on_the_static_path(kind):
    """RWKV's and xLSTM's state is copied before a verify and replayed after it, outside any compiled graph."""
    model = RECURRENT_MODELS[kind]().eval()
    with pytest.raises(ValueError, match=r"keeps its recurrent state\s+in a structure of its own.*Drop cache_impl"):
        hybrid.generate(
            model, torch.tensor([[1, 2, 3]]), drafter=None, max_new_tokens=5, cache_implementation="static", **GREEDY
        )


def test_use_cache_false_in_the_config_is_no_request():
    """MPT's config says use_cache=False; hybrid needs its own forwards cached and the output is the same."""
    model = tiny_model("mpt", 96, 2, seed=0)
    assert model.config.use_cache is False
    check_greedy_lossless(
        model, torch.tensor([[4, 5, 6, 4, 5]]), PromptLookupDrafter(), max_new_tokens=20, pad_token_id=0
    )
    with pytest.raises(ValueError, match=r"use_cache=False"):  # asked for by the caller, it still raises
        hybrid.generate(model, torch.tensor([[4, 5]]), drafter=None, max_new_tokens=5, use_cache=False, **GREEDY)


def test_float_max_new_tokens_as_generate():
    model = tiny_model("llama", 96, 2, seed=0)
    prompt = torch.tensor([[3, 4, 5, 6, 7]])
    expected = model.generate(prompt, max_new_tokens=2.5, **GREEDY)
    assert torch.equal(
        hybrid.generate(model, prompt, drafter=ModelDrafter(model), max_new_tokens=2.5, **GREEDY), expected
    )


def test_training_mode_warns():
    model = tiny_model("llama", 96, 1, seed=0).train()
    with pytest.warns(UserWarning, match=r"training mode.*model.eval\(\)"):
        hybrid.generate(model, torch.tensor([[1, 2]]), drafter=None, max_new_tokens=2, **GREEDY)


def test_lying_drafter_cannot_inject_tokens():
    """A drafter proposing token 63 with q(63) = 1e-9: under the default rule the output is `generate`'s, seed for
    seed; the rejection rule trusts q, and then the token floods the output (hence not the default)."""
    model = tiny_model("llama", 64, 2, seed=3)
    prompt = torch.tensor([[1, 2, 3, 4]])
    sample = {"do_sample": True, "max_new_tokens": 30, "pad_token_id": 0}
    injected = 0
    for seed in range(10):
        torch.manual_seed(seed)
        expected = model.generate(prompt, **sample)
        torch.manual_seed(seed)
        assert torch.equal(hybrid.generate(model, prompt, drafter=LyingDrafter(64, 63), **sample), expected)
        torch.manual_seed(seed)
        # Every draft verified whole, whatever this busy machine's cost table says: what is shown is the rule.
        lying = {"drafter": LyingDrafter(64, 63), "scheduler": FixedScheduler(6), "acceptance": "rejection"}
        out = hybrid.generate(model, prompt, **lying, **sample)
        injected += int((out[0, 4:] == 63).sum())
    assert injected > 100, injected  # of 300 tokens; model.generate samples it a few times


def test_a_drafter_that_writes_into_its_context_changes_nothing():
    """A drafter may write into whatever it is handed (the ids, the processors, its row, the RNGs, the verifier's
    hidden states): its drafts change, the output does not, greedy, sampled, in a batch."""
    model = tiny_model("llama", 64, 2, seed=0)
    prompt = torch.tensor([[1, 2, 3, 4]])
    settings = {"max_new_tokens": 12, "pad_token_id": 0}
    for meddler in (MeddlingDrafter(64), HiddenStateMeddler(64)):
        for extra in ({}, {"repetition_penalty": 1.3}, {"no_repeat_ngram_size": 2}):
            check_greedy_lossless(model, prompt, meddler, **settings, **extra)
        for seed in range(3):
            check_sampled_identical(model, prompt, meddler, seed, **settings, temperature=0.7, top_k=20)
    ids, mask, rows = two_prompts(64)
    stop = {"max_new_tokens": 20, "eos_token_id": 52, **GREEDY}  # row 0 ends first, and leaves the batch
    batch = hybrid.generate(model, ids, attention_mask=mask, drafter=MeddlingDrafter(64), **stop)
    for r, row in enumerate(rows):
        alone = model.generate(row[None], **stop)[0, len(row) :]
        assert torch.equal(batch[r, ids.shape[1] : ids.shape[1] + len(alone)], alone), f"row {r}"


class SteadyDrafter(MeddlingDrafter):
    """Proposes the pending token twice with an honest smoothed distribution; with `reseeds`, it also seeds every RNG
    it can reach, the global one and its context's generator."""

    def __init__(self, reseeds: bool):
        super().__init__(64)
        self.reseeds = reseeds

    def propose(self, ctx, max_tokens):
        if self.reseeds:
            torch.manual_seed(0)
            if ctx.generator is not None:
                ctx.generator.manual_seed(0)
        tokens = ctx.input_ids[0, -1:].repeat(min(2, max_tokens))
        probs = torch.full((len(tokens), 64), 0.5 / 64)
        probs[torch.arange(len(tokens)), tokens] += 0.5
        return Draft(tokens, probs)


def test_a_drafter_cannot_steer_the_rejection_rule_through_the_rngs():
    """Under acceptance="rejection" the drafter samples from a generator of its own, and the global RNG is forked
    and reseeded around it: seeding them changes none of the verifier's draws, with or without a caller's
    generator."""
    model = tiny_model("llama", 64, 2, seed=0)
    prompt = torch.tensor([[1, 2, 3, 4]])
    # A fixed scheduler: the default one learns across calls, which would change the drafts verified.
    sample = {"do_sample": True, "max_new_tokens": 24, "pad_token_id": 0, "acceptance": "rejection"}
    sample["scheduler"] = FixedScheduler(2)
    for seed in range(3):
        outs = []
        for reseeds in (False, True):
            torch.manual_seed(seed)
            outs.append(hybrid.generate(model, prompt, drafter=SteadyDrafter(reseeds), **sample))
            generator = torch.Generator().manual_seed(seed)
            outs.append(hybrid.generate(model, prompt, drafter=SteadyDrafter(reseeds), generator=generator, **sample))
        assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[3]), seed


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_within_the_near_tie_contract(dtype):
    """In bfloat16 / float16 a wider forward rounds logits differently by about one step: greedy output equals
    `generate`'s except after a tie within two rounding steps of the top score (`near_tie_eps`)."""
    gen = torch.Generator().manual_seed(0)
    for seed in range(3):
        model = tiny_model("llama", 96, 2, seed=seed).to(dtype)
        prompt = torch.randint(0, 96, (1, 8), generator=gen)
        for drafter in (PromptLookupDrafter(), ModelDrafter(model)):
            check_greedy_lossless(model, prompt, drafter, max_new_tokens=30, pad_token_id=0)


def _glm4_moe_lite(num_key_value_heads: int):
    config = transformers.Glm4MoeLiteConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=num_key_value_heads,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        kv_lora_rank=16,
        q_lora_rank=16,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
    )
    torch.manual_seed(0)
    return transformers.Glm4MoeLiteForCausalLM(config).eval()


def test_latent_attention_with_fewer_kv_heads_serves_only_one_token_per_forward():
    """GLM-4-MoE-Lite's latent attention expands keys to every head and then repeats them again by
    num_attention_heads // num_key_value_heads: any forward with a mask fails (inside SDPA). One token per forward,
    as `generate` runs, takes no mask, so drafter=None is exact; a drafter is refused up front, naming the fix."""
    model = _glm4_moe_lite(num_key_value_heads=2)
    prompt = torch.randint(1, 96, (1, 10), generator=torch.Generator().manual_seed(1))
    check_greedy_lossless(model, prompt, None, max_new_tokens=20, pad_token_id=0)
    with pytest.raises(ValueError, match=r"num_key_value_heads=2 .* set num_key_value_heads=4, or pass drafter=None"):
        hybrid.generate(model, prompt, drafter=PromptLookupDrafter(), max_new_tokens=5, **GREEDY)
    with pytest.raises(ValueError, match=r"cannot be a drafter .* set num_key_value_heads=4"):
        ModelDrafter(model)
    consistent = _glm4_moe_lite(num_key_value_heads=4)  # as released: served with any drafter
    for drafter in (PromptLookupDrafter(), ModelDrafter(consistent)):
        check_greedy_lossless(consistent, prompt, drafter, max_new_tokens=20, pad_token_id=0)


def _dory(mode: str):
    config = transformers.DoryConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        n_input_layers=1,
        n_output_layers=1,
        sliding_window=4,
        recurrent_kv_cache_mode=mode,
    )
    torch.manual_seed(0)
    return transformers.DoryForCausalLM(config).eval()


def test_looped_model_caches_each_loop_in_its_own_layers():
    """Dory runs its recurrent layers twice, each loop into its own cache layers, which it appends to a cache of one
    layer per model layer by deep copy; hybrid's cache has them from the start (copies would write nowhere)."""
    model = _dory("per_loop")
    prompt = torch.randint(1, 96, (1, 12), generator=torch.Generator().manual_seed(1))
    for drafter, scheduler in ((None, None), (PromptLookupDrafter(), None), (ModelDrafter(model), FixedScheduler(4))):
        check_greedy_lossless(model, prompt, drafter, scheduler, max_new_tokens=30, pad_token_id=0)
    with pytest.raises(
        ValueError, match=r"recurrent_kv_cache_mode='last_loop'.*serves recurrent_kv_cache_mode='per_loop'"
    ):
        hybrid.generate(_dory("last_loop"), prompt, drafter=None, max_new_tokens=5, **GREEDY)


def test_per_layer_head_sizes_are_read_per_layer():
    """Gemma 4's full-attention layers have their own head size: the global config refuses to say `head_dim`
    (AmbiguousGlobalPerLayerAttributeError), so the cache reads each layer's config."""
    model = tiny_model("gemma4", 96, 2, seed=0)
    assert cache_layers.cache_fingerprint(model)["layers"] == [(2, 8, 8), (2, 16, 16)]
    prompt = torch.randint(1, 96, (1, 12), generator=torch.Generator().manual_seed(1))
    for drafter in (None, PromptLookupDrafter(), ModelDrafter(model)):
        check_greedy_lossless(model, prompt, drafter, max_new_tokens=30)


def test_layers_that_read_another_layers_keys_and_values_decode_as_generate():
    """Gemma 4 with KV sharing (as its small checkpoints): its last layers store nothing and attend over the keys
    and values the last earlier layer of their kind returned from the cache, which hybrid's cache returns too."""
    config = transformers.Gemma4UnifiedTextConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        global_head_dim=16,
        sliding_window=4,
        num_kv_shared_layers=3,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        initializer_range=0.3,
    )
    assert config.kv_sharing_modes[3:] == ["reuse"] * 3
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = transformers.Gemma4UnifiedForCausalLM(config).eval()
    prompt = torch.tensor([[5, 6, 7] * 4])
    for drafter in (PromptLookupDrafter(), RandomTreeDrafter(96, None, 0, guide=PromptLookupDrafter())):
        for static in (None, "static"):
            check_greedy_lossless(
                model, prompt, drafter, hybrid_kwargs={"cache_implementation": static}, max_new_tokens=30
            )


class _AdapterConfig:
    def __init__(self, peft_type: str, is_prompt_learning: bool):
        self.peft_type, self.is_prompt_learning = peft_type, is_prompt_learning


class _PeftLike(torch.nn.Module):
    """What hybrid reads of a PEFT `PeftModel`: its active adapter's config and the causal LM inside it."""

    def __init__(self, model, config: _AdapterConfig):
        super().__init__()
        self.model, self.active_peft_config = model, config

    def get_base_model(self):
        return self.model


def test_a_peft_model_with_lora_type_adapters_decodes_through_the_model_they_act_within():
    model = tiny_model("llama", 64, 2, seed=0)
    ids = torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2]])
    expected = model.generate(ids, max_new_tokens=12, **GREEDY)
    peft_like = _PeftLike(model, _AdapterConfig("LORA", is_prompt_learning=False))
    assert torch.equal(
        hybrid.generate(peft_like, ids, drafter=PromptLookupDrafter(), max_new_tokens=12, **GREEDY), expected
    )
    prompt_tuned = _PeftLike(model, _AdapterConfig("PROMPT_TUNING", is_prompt_learning=True))
    with pytest.raises(TypeError, match=r"_PeftLike carries a prompt-learning adapter \(PROMPT_TUNING\).*LoRA"):
        hybrid.generate(prompt_tuned, ids, drafter=None, max_new_tokens=4)


def test_a_lora_attached_with_peft_gives_peft_models_generate_output():
    peft = pytest.importorskip("peft")  # not a dependency: where it is installed, its own model and adapter
    model = tiny_model("llama", 64, 2, seed=0)
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft_model = peft.get_peft_model(model, config).eval()
    ids = torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2]])
    expected = peft_model.generate(input_ids=ids, max_new_tokens=12, **GREEDY)
    assert torch.equal(
        hybrid.generate(peft_model, ids, drafter=PromptLookupDrafter(), max_new_tokens=12, **GREEDY), expected
    )


PROMPT = torch.tensor([[4, 5, 6, 4, 5, 6, 4]])


def test_a_model_that_keeps_state_in_a_cache_of_its_own_is_refused():
    """BLT wraps the cache it is passed in an EncoderDecoderCache of its own each call, whose second half holds its
    local decoder's keys/values: through hybrid's cache they would be lost between forwards. Its sizes live in
    sub-configs, none in the top-level config that the cost table's key and the mask check read."""
    layers = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    local = dict(layers, cross_attn_k=1, hidden_size_global=32)
    config = transformers.BltConfig(
        vocab_size=96,
        num_hidden_layers=2,
        cross_attn_k=1,
        encoder_hash_byte_group_vocab=64,
        patcher_config=layers,
        encoder_config=local,
        decoder_config=local,
        global_config=layers,
    )
    torch.manual_seed(0)
    model = transformers.BltForCausalLM(config).eval()
    assert cost_table.device_key(model) and support.mask_problem(model.config.get_text_config()) is None
    for drafter in (None, PromptLookupDrafter()):
        with pytest.raises(ValueError, match=r"BltForCausalLM.*cache of its own \(EncoderDecoderCache\).*model\.gen"):
            hybrid.generate(model, PROMPT, drafter=drafter, max_new_tokens=8, **GREEDY)


def test_a_model_that_takes_the_whole_sequence_every_step_is_refused():
    """XLM's forward takes the whole sequence each step and slices off what its cache holds (its generate appends a
    mask token to score the next one): fed only the new tokens it fails, so it is refused before any forward of
    hybrid's, the cost measurement's included."""
    config = transformers.XLMConfig(vocab_size=96, emb_dim=32, n_layers=2, n_heads=4, causal=True, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.XLMWithLMHeadModel(config).eval()
    for drafter, said in (
        (None, r"fails when fed 1 token after 2 cached ones \(RuntimeError"),
        (PromptLookupDrafter(), r"fed 3 tokens after 2 cached ones, returns scores for 1 of them"),
    ):
        with pytest.raises(ValueError, match=rf"XLMWithLMHeadModel cannot be a verifier.*{said}.*model\.generate"):
            hybrid.generate(model, PROMPT, drafter=drafter, max_new_tokens=8, **GREEDY)
    with pytest.raises(ValueError, match=r"XLMWithLMHeadModel cannot be a verifier.*fed 3 tokens after 2 cached.*gen"):
        cost_table.measure_verify_costs(model)


def test_a_model_that_takes_one_token_at_a_time_onto_its_cache_decodes_without_drafts():
    """ProphetNet's decoder asserts one token per forward once it has a cache. With a drafter it is refused, naming
    drafter=None, before any verify or cost measurement; without one it decodes as generate."""
    config = transformers.ProphetNetConfig(
        vocab_size=96,
        hidden_size=32,
        num_encoder_layers=2,
        num_decoder_layers=2,
        num_encoder_attention_heads=4,
        num_decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.ProphetNetForCausalLM(config).eval()
    with pytest.raises(ValueError, match=r"cannot verify drafted tokens.*decoder_input_ids. of length 1.*drafter=None"):
        hybrid.generate(model, PROMPT, drafter=PromptLookupDrafter(), max_new_tokens=8, **GREEDY)
    check_greedy_lossless(model, PROMPT, None, max_new_tokens=12, **GREEDY)
    with pytest.raises(ValueError, match=r"cannot verify drafted tokens.*decoder_input_ids. of length 1.*drafter=None"):
        cost_table.measure_verify_costs(model)


def test_a_model_that_counts_positions_from_a_pad_id_it_lacks_is_served():
    """XMOD, as RoBERTa, counts positions from pad_token_id when it is not given them; without one its forward fails
    with a TypeError. hybrid passes position ids wherever it feeds tokens, the cost measurement's context included,
    as generate does."""
    config = transformers.XmodConfig(
        vocab_size=96,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        is_decoder=True,
        default_language="en_XX",
        pad_token_id=None,
    )
    torch.manual_seed(0)
    model = transformers.XmodForCausalLM(config).eval()
    assert cost_table.measure_verify_costs(model, sizes=(1, 3), repeats=1)["torch"].keys() == {1, 3}
    for drafter in (None, PromptLookupDrafter()):
        check_greedy_lossless(model, PROMPT, drafter, max_new_tokens=12, **GREEDY)
