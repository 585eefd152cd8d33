"""The tiny models with state layers (hybrid.testing.STATE_ARCHITECTURES) hold what they are built to test: each
builds, runs a forward and `model.generate`, keeps recurrent / linear-attention / convolution state in at least one
layer, and a hybrid has attention layers beside it. Without these checks a config whose layer pattern fell back to
its defaults (all state layers, or all attention) would make every property test over it vacuous."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers

from hybrid.testing import (
    ARCHITECTURES,
    HYBRID_STATE,
    STATE_ARCHITECTURES,
    attention_layer_count,
    layer_census,
    state_layer_count,
    tiny_model,
)

VOCAB = 64


@pytest.fixture(autouse=True)
def quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        verbosity = transformers.logging.get_verbosity()
        transformers.logging.set_verbosity_error()
        yield
        transformers.logging.set_verbosity(verbosity)


def test_the_properties_draw_each_kind_of_state_layer():
    """A Gated DeltaNet hybrid, a Mamba-attention hybrid and a pure state-space model, among the verifiers every
    property draws."""
    assert set(HYBRID_STATE) <= set(STATE_ARCHITECTURES)
    assert {"qwen3_5", "jamba", "mamba2"} <= set(ARCHITECTURES)


@pytest.mark.parametrize("num_layers", [1, 2])
@pytest.mark.parametrize("arch", sorted(STATE_ARCHITECTURES))
def test_tiny_state_model_has_its_state_layers(arch, num_layers, one_thread):
    model = tiny_model(arch, VOCAB, num_layers, seed=0)
    assert model.config.bos_token_id is None and model.config.initializer_range == 0.3
    ids = torch.randint(0, VOCAB, (1, 11), generator=torch.Generator(torch.get_default_device()).manual_seed(1))
    with torch.inference_mode():
        logits = model(ids).logits
    assert logits.shape == (1, 11, VOCAB) and bool(torch.isfinite(logits).all())

    census = layer_census(model)
    assert census.state >= num_layers, census
    if arch in HYBRID_STATE:
        assert census.attention >= num_layers, census
    else:
        assert census.attention == 0, census

    # Plain greedy `generate` (its default cache), across a Mamba-2 chunk boundary (11 + 8 tokens, chunks of 8)
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert out.shape == (1, 19) and torch.equal(out[:, :11], ids)


def test_census_of_attention_only_models(one_thread):
    for arch in ("llama", "gemma4"):
        model = tiny_model(arch, VOCAB, 2, seed=0)
        assert state_layer_count(model) == 0
        assert attention_layer_count(model) == 2


def test_census_counts_what_the_model_built():
    """A Qwen3.5 config given only full-attention layers builds no Gated DeltaNet layer: the census says so."""
    config, model_cls = STATE_ARCHITECTURES["qwen3_5"](VOCAB, 1, None)
    config.layer_types = ["full_attention", "full_attention"]
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = model_cls(config).eval()
    census = layer_census(model)
    assert census.state == 0 and census.attention == 2, census


# The survey's (experiments.architectures) model types with state layers, each tiny model built from its config's
# defaults and OVERRIDES; the pure state-space / recurrent ones have no attention layer.
SURVEY_STATE_ONLY = ("falcon_mamba", "mamba", "mamba2", "rwkv", "xlstm")
SURVEY_HYBRIDS = (
    "bailing_hybrid",
    "bamba",
    "falcon_h1",
    "granitemoehybrid",
    "inkling2_loop_text",
    "inkling2_text",
    "inkling_text",
    "jamba",
    "kimi_linear",
    "lara_mini",
    "lfm2",
    "lfm2_moe",
    "lfm3",
    "minimax",
    "nemotron_h",
    "olmo_hybrid",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_5_moe_text",
    "qwen3_5_text",
    "qwen3_next",
    "qwen4_exp",
    "qwen4_exp_text",
    "recurrent_gemma",
    "zamba",
    "zamba2",
    "zaya",
)


@pytest.mark.parametrize("model_type", SURVEY_STATE_ONLY + SURVEY_HYBRIDS)
def test_survey_tiny_model_has_its_state_layers(model_type, one_thread):
    """The survey's tiny model of a state-layer type holds a state layer, and a hybrid's an attention layer too (its
    OVERRIDES pick one of each where the defaults' first two layers are of one kind)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from experiments.architectures import tiny_from_defaults

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        pytest.skip(f"{model_type} is not a causal LM type of this transformers")
    census = layer_census(tiny_from_defaults(model_type))
    assert census.state >= 1, census
    assert (census.attention >= 1) == (model_type in SURVEY_HYBRIDS), census
