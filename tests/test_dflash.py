"""The DFlash drafter: it reads z-lab's folder format and drafts what the reference forward drafts, decoding with it
is lossless (greedy, seeded sampling, batches, static shapes), for Qwen3 and Llama targets and for a Qwen3.5 target,
whose Gated DeltaNet layers keep recurrent state that every rollback restores, `--arch dflash` trains and exports a
folder it loads back, and bad folders fail naming the field and the fix."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from strategies import padded_batches, prompts
from transformers import LogitsProcessorList, Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

import hybrid
from drafters import ChainDrafter, DFlashDrafter, Draft, DraftContext, PromptLookupDrafter
from drafters.training.batches import VocabMap, block_batch
from drafters.training.dflash import dflash_forward, dflash_layers
from drafters.training.distill import build_features
from drafters.training.train import parser, train
from hybrid.testing import STATE_ARCHITECTURES, check_greedy_lossless, check_sampled_identical, tiny_model
from schedulers import FixedScheduler
from verifiers.verifier import Verifier

VOCAB, MASK = 64, 7
# Targets of the published drafters' kinds: Qwen3 and Llama (LLaMA3.1-8B-DFlash), and Qwen3.5, whose z-lab drafters read
# their target's layers as for Qwen3 while its Gated DeltaNet layers keep recurrent and convolution state.
TARGETS = ("qwen3", "llama", "qwen3_5")
PROPERTY = settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# Config features of the published drafters: plain full attention (Qwen3-*-DFlash-b16, LLaMA3.1), causal sliding
# window layers (Qwen3.6-27B-DFlash: [S, S, S, S, F]), YaRN RoPE (gpt-oss-*-DFlash).
VARIANTS = {
    "full": {},
    "sliding": {
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 3,
        "use_sliding_window": True,
    },
    "yarn": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}},
}


def tiny_target(arch: str, seed: int = 1):
    """A tiny target of 2 decoder layers; for Qwen3.5 a Gated DeltaNet (linear-attention) layer, then a full-attention
    one."""
    return tiny_model(arch, VOCAB, 1 if arch in STATE_ARCHITECTURES else 2, seed=seed)


def write_dflash_folder(path: Path, verifier, block_size: int = 6, seed: int = 0, variant: str = "full", **overrides):
    """A random DFlash drafter of 2 layers for `verifier`, written as z-lab's published folders are: config.json (a
    transformers 4.x Qwen3 config plus the DFlash fields) and model.safetensors named as the reference names them."""
    text = verifier.config
    h, heads, kv, d, mlp = text.hidden_size, 4, 2, 8, 48
    config = {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "attention_bias": False,
        "block_size": block_size,
        "num_target_layers": text.num_hidden_layers,
        "dflash_config": {"target_layer_ids": [0, text.num_hidden_layers - 1], "mask_token_id": MASK},
        "hidden_size": h,
        "intermediate_size": mlp,
        "num_hidden_layers": 2,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": d,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000,
        "rope_scaling": None,
        "max_position_embeddings": 128,
        "layer_types": ["full_attention", "full_attention"],
        "sliding_window": None,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "vocab_size": text.vocab_size,
        "dtype": "float32",
        **VARIANTS[variant],
        **overrides,
    }
    gen = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=gen) * 0.3  # noqa: E731
    norm = lambda n: 1 + 0.1 * torch.randn(n, generator=gen)  # noqa: E731
    weights = {"fc.weight": randn(h, 2 * h), "hidden_norm.weight": norm(h), "norm.weight": norm(h)}
    for i in range(2):
        p = f"layers.{i}."
        weights |= {
            p + "self_attn.q_proj.weight": randn(heads * d, h),
            p + "self_attn.k_proj.weight": randn(kv * d, h),
            p + "self_attn.v_proj.weight": randn(kv * d, h),
            p + "self_attn.o_proj.weight": randn(h, heads * d),
            p + "self_attn.q_norm.weight": norm(d),
            p + "self_attn.k_norm.weight": norm(d),
            p + "mlp.gate_proj.weight": randn(mlp, h),
            p + "mlp.up_proj.weight": randn(mlp, h),
            p + "mlp.down_proj.weight": randn(h, mlp),
            p + "input_layernorm.weight": norm(h),
            p + "post_attention_layernorm.weight": norm(h),
        }
    path.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def reference_block_logits(folder: Path, verifier, ids: list[int], anchor: int) -> torch.Tensor:
    """Block logits [B - 1, vocab] for `anchor` as z-lab's `DFlashDraftModel` computes them (dflash/model.py, read off
    the public source), from scratch: the verifier run over ids[:anchor], keys/values of [context ; block] per layer,
    no cache of any kind."""
    config = json.loads((folder / "config.json").read_text())
    w, dflash, B = load_file(str(folder / "model.safetensors")), config["dflash_config"], config["block_size"]
    heads, kv, d = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    with torch.no_grad():
        states = verifier(torch.tensor([ids[:anchor]]), output_hidden_states=True).hidden_states
        target = torch.cat([states[i + 1] for i in dflash["target_layer_ids"]], dim=-1)
        block = torch.tensor([[ids[anchor]] + [dflash["mask_token_id"]] * (B - 1)])
        x = F.embedding(block, verifier.get_input_embeddings().weight)
        context = rms(target @ w["fc.weight"].T, w["hidden_norm.weight"])
        cos, sin = Qwen3RotaryEmbedding(Qwen3Config.from_dict(config))(x, torch.arange(anchor + B)[None])
        rotate = lambda t, c, s: t * c + torch.cat([-t[..., d // 2 :], t[..., : d // 2]], -1) * s  # noqa: E731
        query_pos, key_pos = torch.arange(anchor, anchor + B)[:, None], torch.arange(anchor + B)[None]
        for i, kind in enumerate(config["layer_types"]):
            p = f"layers.{i}."
            h = rms(x, w[p + "input_layernorm.weight"])
            q = rms((h @ w[p + "self_attn.q_proj.weight"].T).view(1, B, heads, d), w[p + "self_attn.q_norm.weight"])
            both = torch.cat([context, h], dim=1)
            k = rms((both @ w[p + "self_attn.k_proj.weight"].T).view(1, -1, kv, d), w[p + "self_attn.k_norm.weight"])
            v = (both @ w[p + "self_attn.v_proj.weight"].T).view(1, -1, kv, d)
            q = rotate(q.transpose(1, 2), cos[:, None, -B:], sin[:, None, -B:])
            k = rotate(k.transpose(1, 2), cos[:, None], sin[:, None]).repeat_interleave(heads // kv, dim=1)
            v = v.transpose(1, 2).repeat_interleave(heads // kv, dim=1)
            visible = torch.ones(B, anchor + B, dtype=torch.bool)
            if kind == "sliding_attention":  # causal within the window, as the reference's mask for such layers
                window = config["sliding_window"]
                visible = (key_pos <= query_pos) & (query_pos - key_pos < window)
            scores = (q @ k.transpose(-1, -2) / math.sqrt(d)).masked_fill(~visible, -math.inf)
            x = x + (scores.softmax(-1) @ v).transpose(1, 2).reshape(1, B, -1) @ w[p + "self_attn.o_proj.weight"].T
            h = rms(x, w[p + "post_attention_layernorm.weight"])
            up = F.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)
            x = x + up @ w[p + "mlp.down_proj.weight"].T
        return rms(x, w["norm.weight"])[0, 1:] @ verifier.get_output_embeddings().weight.T


def drafting_logits(verifier, drafter, ids: list[int], anchor: int) -> torch.Tensor:
    """What the drafter computes at draft time for `anchor`: the verifier has run ids[:anchor] only."""
    v = Verifier(verifier, hidden_layers=drafter.hidden_layers)
    v.prefill(torch.tensor([ids[:anchor]]), None, capacity=64)
    ctx = DraftContext(torch.tensor([ids[: anchor + 1]]), False, LogitsProcessorList(), None, v)
    drafter.reset(ctx)
    return drafter.block_logits([ctx], drafter._block(ctx, Draft.empty())[None])[0]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(verifier, folder) per (architecture, variant): random published-format drafters for tiny Qwen3, Llama and
    Qwen3.5 models."""
    root = tmp_path_factory.mktemp("dflash")
    made = {}
    for arch in TARGETS:
        verifier = tiny_target(arch)
        for variant in VARIANTS:
            made[arch, variant] = verifier, write_dflash_folder(root / f"{arch}-{variant}", verifier, variant=variant)
    return made


@pytest.mark.parametrize("arch", TARGETS)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_drafts_are_the_reference_forwards(folders, arch, variant, one_thread):
    """At any anchor, the block logits equal the reference model's, recomputed from scratch."""
    verifier, folder = folders[arch, variant]
    drafter = DFlashDrafter.from_pretrained(folder, verifier)
    ids = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    for anchor in (1, 19):
        expected = reference_block_logits(folder, verifier, ids, anchor)
        torch.testing.assert_close(drafting_logits(verifier, drafter, ids, anchor), expected, atol=2e-4, rtol=1e-4)


def test_it_runs_in_bfloat16_as_published(folders):
    """A bfloat16 verifier gets a bfloat16 drafter (weights, context buffer), whose RoPE frequencies stay float32,
    and greedy decoding with it is `generate`'s (up to bfloat16's near ties)."""
    _, folder = folders["qwen3", "yarn"]
    verifier = tiny_model("qwen3", VOCAB, 2, seed=1).to(torch.bfloat16)
    drafter = DFlashDrafter.from_pretrained(folder, verifier)
    assert drafter.model.dtype == torch.bfloat16 and drafter.model.rotary_emb.inv_freq.dtype == torch.float32
    check_greedy_lossless(verifier, torch.tensor([[3, 4, 5, 6]]), drafter, FixedScheduler(4), max_new_tokens=12)


class CheckedDFlashDrafter(DFlashDrafter):
    """Checks every block it drafts inside `generate` against the reference forward over the committed tokens."""

    folder: Path
    verifier = None
    checked = 0

    def block_logits(self, ctxs, blocks):
        logits = super().block_logits(ctxs, blocks)
        for ctx, row_logits in zip(ctxs, logits):
            ids = ctx.input_ids[0].tolist()
            expected = reference_block_logits(self.folder, self.verifier, ids, len(ids) - 1)
            torch.testing.assert_close(row_logits, expected, atol=2e-4, rtol=1e-4)
            CheckedDFlashDrafter.checked += 1
        return logits


# Qwen3.5's recurrent layers are served on the dynamic path only (a static one is refused by name).
@pytest.mark.parametrize(("arch", "static"), [("qwen3", None), ("qwen3", "static"), ("qwen3_5", None)])
def test_the_context_follows_the_cache_through_generate(folders, arch, static, one_thread):
    """Inside `generate` (rollbacks, uneven batches, the static layout), every drafted block is the reference's for
    the tokens committed so far: the side buffer holds exactly the committed context, and a Qwen3.5 target's states
    after a rollback of its recurrent layers are those of a forward over the committed tokens."""
    verifier, folder = folders[arch, "sliding"]
    drafter = CheckedDFlashDrafter.from_pretrained(folder, verifier)
    drafter.folder, drafter.verifier = folder, verifier
    CheckedDFlashDrafter.checked = 0
    input_ids = torch.tensor([[0, 0, 3, 4, 5], [9, 8, 7, 6, 5]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    check_rows_decode_as_batch_one(verifier, drafter, input_ids, mask, static, max_new_tokens=6)
    assert CheckedDFlashDrafter.checked >= 2 * 2


def check_rows_decode_as_batch_one(verifier, drafter, input_ids, mask, static, max_new_tokens: int) -> None:
    """A left-padded greedy batch through hybrid gives each row the greedy output of its unpadded prompt alone."""
    out = hybrid.generate(
        verifier,
        input_ids,
        attention_mask=mask,
        drafter=drafter,
        scheduler=FixedScheduler(3),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
        cache_implementation=static,
    )
    for row in range(input_ids.shape[0]):
        alone = input_ids[row : row + 1, mask[row].bool()]
        expected = verifier.generate(alone, max_new_tokens=max_new_tokens, do_sample=False)
        assert out[row, -max_new_tokens:].tolist() == expected[0, -max_new_tokens:].tolist()


def with_lookup(data, drafter: DFlashDrafter):
    """The drafter alone, or filling in what a context lookup leaves of its block (its given tokens known)."""
    if not data.draw(st.booleans(), label="after a lookup"):
        return drafter
    return ChainDrafter([PromptLookupDrafter(max_ngram=2, max_draft_len=3), drafter])


@PROPERTY
@given(data=st.data())
def test_greedy_decoding_with_a_dflash_drafter_equals_generate(folders, data):
    arch = data.draw(st.sampled_from(["qwen3", "llama"]), label="verifier")
    variant = data.draw(st.sampled_from(sorted(VARIANTS)), label="variant")
    verifier, folder = folders[arch, variant]
    block_size = data.draw(st.integers(4, 6), label="block_size")  # the folders' block is 6: 4..6 at run time
    max_nodes = data.draw(st.sampled_from([None, 8]), label="max_nodes")  # chains, or trees of up to 8 nodes
    drafter = with_lookup(
        data, DFlashDrafter.from_pretrained(folder, verifier, block_size=block_size, max_nodes=max_nodes)
    )
    input_ids = data.draw(prompts(VOCAB), label="prompt")
    k = data.draw(st.integers(1, drafter.node_budget), label="k")
    kwargs = {"max_new_tokens": data.draw(st.integers(1, 12), label="max_new_tokens")}
    if data.draw(st.booleans(), label="repetition_penalty"):  # the drafter then chooses through the processors
        kwargs["repetition_penalty"] = 1.3
    static = data.draw(st.sampled_from([None, "static"]), label="cache_implementation")
    check_greedy_lossless(
        verifier, input_ids, drafter, FixedScheduler(k), hybrid_kwargs={"cache_implementation": static}, **kwargs
    )


@PROPERTY
@given(data=st.data())
def test_seeded_sampling_with_a_dflash_drafter_equals_generate(folders, data):
    arch = data.draw(st.sampled_from(["qwen3", "llama"]), label="verifier")
    variant = data.draw(st.sampled_from(sorted(VARIANTS)), label="variant")
    verifier, folder = folders[arch, variant]
    max_nodes = data.draw(st.sampled_from([None, 8]), label="max_nodes")
    drafter = with_lookup(
        data,
        DFlashDrafter.from_pretrained(folder, verifier, block_size=data.draw(st.integers(4, 6)), max_nodes=max_nodes),
    )
    input_ids = data.draw(prompts(VOCAB), label="prompt")
    check_sampled_identical(
        verifier,
        input_ids,
        drafter,
        seed=data.draw(st.integers(0, 2**16), label="seed"),
        scheduler=FixedScheduler(data.draw(st.integers(1, 3), label="k")),
        max_new_tokens=data.draw(st.integers(1, 16), label="max_new_tokens"),
        temperature=data.draw(st.sampled_from([0.5, 1.0]), label="temperature"),
        top_k=data.draw(st.sampled_from([None, 8]), label="top_k"),
    )


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_rows_drafted_in_one_forward_decode_as_batch_one(folders, data):
    """A left-padded batch (one forward of the drafter for all rows) gives each row its own greedy output."""
    verifier, folder = folders["llama", data.draw(st.sampled_from(sorted(VARIANTS)), label="variant")]
    drafter = DFlashDrafter.from_pretrained(folder, verifier)
    input_ids, mask, _ = data.draw(padded_batches(VOCAB), label="batch")
    static = data.draw(st.sampled_from([None, "static"]), label="cache_implementation")
    check_rows_decode_as_batch_one(verifier, drafter, input_ids, mask, static, max_new_tokens=8)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize(("block_size", "max_nodes", "lookup"), [(6, None, False), (4, 8, True), (5, None, True)])
def test_greedy_decoding_of_a_qwen3_5_target_with_a_dflash_drafter_equals_generate(
    folders, variant, block_size, max_nodes, lookup, one_thread
):
    """A Qwen3.5 target (a Gated DeltaNet layer, then a full-attention one) and a drafter in the published format:
    chains and trees, alone and after a lookup, through the processors, decode as `generate` does."""
    verifier, folder = folders["qwen3_5", variant]
    drafter = DFlashDrafter.from_pretrained(folder, verifier, block_size=block_size, max_nodes=max_nodes)
    if lookup:
        drafter = ChainDrafter([PromptLookupDrafter(max_ngram=2, max_draft_len=3), drafter])
    kwargs = {"repetition_penalty": 1.3} if lookup else {}
    for prompt in ([[3, 4, 5, 6, 3, 4]], [[9]], [[1, 2, 1, 2, 1, 2, 1, 2, 1]]):
        report = check_greedy_lossless(
            verifier, torch.tensor(prompt), drafter, FixedScheduler(drafter.node_budget), max_new_tokens=16, **kwargs
        )
        assert sum(report.stats.drafted) > 0


@pytest.mark.parametrize(
    ("seed", "variant", "lookup", "temperature", "top_k"),
    [
        (0, "full", False, 1.0, None),
        (1, "sliding", True, 0.5, 8),
        (2, "yarn", False, 1.0, 8),
        (3, "sliding", True, 1.0, None),
    ],
)
def test_seeded_sampling_of_a_qwen3_5_target_with_a_dflash_drafter_equals_generate(
    folders, seed, variant, lookup, temperature, top_k, one_thread
):
    """The same target sampled: after the same seed, `hybrid.generate` draws `generate`'s tokens."""
    verifier, folder = folders["qwen3_5", variant]
    drafter = DFlashDrafter.from_pretrained(folder, verifier, block_size=4 + seed % 3)
    if lookup:
        drafter = ChainDrafter([PromptLookupDrafter(max_ngram=2, max_draft_len=3), drafter])
    check_sampled_identical(
        verifier,
        torch.tensor([[3, 4, 5, 6, 3]]),
        drafter,
        seed=seed,
        scheduler=FixedScheduler(1 + seed % 3),
        max_new_tokens=16,
        temperature=temperature,
        top_k=top_k,
    )


def test_sampled_drafts_report_the_distribution_they_were_drawn_from(folders):
    """Under `acceptance="rejection"` the drafter samples each position from q = the verifier-processed softmax of
    its logits and reports q; the first position's q is that of the block logits."""
    verifier, folder = folders["qwen3", "full"]
    drafter = DFlashDrafter.from_pretrained(folder, verifier)
    ids = [3, 4, 5, 6, 7, 8]
    v = Verifier(verifier, hidden_layers=drafter.hidden_layers)
    v.prefill(torch.tensor([ids[:-1]]), None, capacity=64)
    ctx = DraftContext(torch.tensor([ids]), True, LogitsProcessorList(), torch.Generator().manual_seed(0), v)
    draft = drafter.propose(ctx, 5)
    assert draft.probs.shape == (5, VOCAB)
    torch.testing.assert_close(
        draft.probs[0], drafter.block_logits([ctx], drafter._block(ctx, Draft.empty())[None])[0, 0].softmax(-1)
    )
    assert bool((draft.probs.gather(1, draft.tokens[:, None]) > 0).all())
    given = Draft(torch.tensor([3, 4]), None, torch.tensor([0.9, 0.8]))  # a lookup's deterministic proposal
    filled = drafter.fill(ctx, given, 5)
    assert filled.tokens[:2].tolist() == [3, 4] and filled.probs[:2].argmax(-1).tolist() == [3, 4]
    assert filled.probs.shape == (5, VOCAB) and filled.confidence[:2].tolist() == given.confidence.tolist()
    chained = ChainDrafter([PromptLookupDrafter(max_ngram=2, max_draft_len=3), drafter])
    for each in (drafter, chained):  # the engine validates every draft's probs (rows sum to 1, q(token) > 0)
        out = hybrid.generate(
            verifier,
            torch.tensor([[3, 4, 5, 3, 4, 5]]),
            drafter=each,
            max_new_tokens=12,
            do_sample=True,
            acceptance="rejection",
        )
        assert out.shape == (1, 6 + 12)


BAD_FOLDERS = {
    # mutation of config.json (or the weights file) -> words the error must contain
    "no dflash_config": (lambda c: c.pop("dflash_config"), ["dflash_config", '"dflash_config": {"target_layer_ids"']),
    "no target_layer_ids": (lambda c: c["dflash_config"].pop("target_layer_ids"), ["dflash_config.target_layer_ids"]),
    "a layer out of range": (
        lambda c: c["dflash_config"].update(target_layer_ids=[0, 2]),
        ["target_layer_ids [2] out of range", "verifier of 2 layers", "trained for this verifier"],
    ),
    "another verifier's depth": (lambda c: c.update(num_target_layers=36), ["num_target_layers 36", "2 layers"]),
    "another verifier's width": (lambda c: c.update(hidden_size=48), ["hidden_size 48 != verifier's 32"]),
    "another vocabulary": (lambda c: c.update(vocab_size=151936), ["vocab_size 151936 != verifier's 64"]),
    "a mask outside the vocabulary": (
        lambda c: c["dflash_config"].update(mask_token_id=64),
        ["mask_token_id 64 outside the verifier's vocabulary"],
    ),
    "a DFlash 2 drafter": (
        lambda c: c.update(architectures=["DFlash2DraftModel"]),
        ["DFlash2DraftModel", "plain DFlash"],
    ),
    "an unknown variant field": (
        lambda c: c["dflash_config"].update(projector_type="dspark"),
        ["dflash_config.projector_type", "plain DFlash format"],
    ),
    "a sliding layer without a window": (
        lambda c: c.update(layer_types=["sliding_attention", "full_attention"], sliding_window=None),
        ["sliding_window", "set the window size"],
    ),
    "truncated safetensors": ("truncate", ["model.safetensors is truncated", "download the drafter again"]),
    "weights of another shape": ("wrong shape", ["fc.weight is (32, 96)", "config.json says (32, 64)"]),
}


@pytest.mark.parametrize("case", sorted(BAD_FOLDERS))
def test_a_bad_folder_fails_naming_the_field_and_the_fix(folders, tmp_path, case):
    verifier, good = folders["qwen3", "full"]
    folder = Path(shutil.copytree(good, tmp_path / "bad"))
    mutate, words = BAD_FOLDERS[case]
    weights = folder / "model.safetensors"
    if mutate == "truncate":
        weights.write_bytes(weights.read_bytes()[:-100])
    elif mutate == "wrong shape":
        state = load_file(str(weights))
        state["fc.weight"] = torch.zeros(32, 96)
        save_file(state, str(weights))
    else:
        config = json.loads((folder / "config.json").read_text())
        mutate(config)
        (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as error:
        DFlashDrafter.from_pretrained(folder, verifier)
    for word in words:
        assert word in str(error.value)


@pytest.mark.parametrize(
    "entry", ["../../../etc/passwd", "/etc/passwd", "shards/../../model.safetensors", "..", 7, "sub/model.safetensors"]
)
def test_an_index_naming_a_file_outside_the_folder_is_refused(folders, tmp_path, entry):
    """model.safetensors.index.json is the folder's word on where its shards are: a shard outside the folder (or not a
    plain file name in it) is refused by name, and nothing is opened."""
    verifier, good = folders["qwen3", "full"]
    folder = Path(shutil.copytree(good, tmp_path / "sharded"))
    weights = folder / "model.safetensors"
    weights.rename(folder / "model-00001-of-00001.safetensors")
    index = {"metadata": {}, "weight_map": {"fc.weight": entry, "norm.weight": "model-00001-of-00001.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError) as error:
        DFlashDrafter.from_pretrained(folder, verifier)
    message = str(error.value)
    assert "model.safetensors.index.json" in message and repr(entry) in message and "fc.weight" in message
    assert "a shard's plain file name in the folder" in message


def test_a_sharded_folder_loads_its_shards(folders, tmp_path):
    verifier, good = folders["qwen3", "full"]
    folder = Path(shutil.copytree(good, tmp_path / "sharded"))
    state = load_file(str(folder / "model.safetensors"))
    names = sorted(state)
    (folder / "model.safetensors").unlink()
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in halves.items():
        save_file({k: state[k] for k in keys}, str(folder / shard))
    index = {"weight_map": {k: shard for shard, keys in halves.items() for k in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    sharded = DFlashDrafter.from_pretrained(folder, verifier)
    whole = DFlashDrafter.from_pretrained(good, verifier)
    for (name, a), (_, b) in zip(sharded.model.state_dict().items(), whole.model.state_dict().items()):
        assert torch.equal(a, b), name


def test_dflash_training_round_trips_through_the_published_format(tmp_path):
    """`--arch dflash` trains a few steps and exports a DFlash folder: its config is the format (a Qwen3 config with
    the DFlash fields), `DFlashDrafter.from_pretrained` loads the trained weights (bfloat16, as published) and drafts
    at each anchor exactly what the training forward predicts there, and decoding with it is lossless."""
    verifier = tiny_model("qwen3", VOCAB, 3, seed=1)
    layers = dflash_layers(verifier)  # (1, 2): below the last layer, whose state the servers feed un-normed
    prompts_ = torch.randint(0, VOCAB, (3, 4), generator=torch.Generator().manual_seed(0))
    answers = verifier.generate(prompts_, max_new_tokens=26, do_sample=False)
    sequences = [{"ids": row.tolist(), "prompt_len": 4, "source": "generated"} for row in answers]
    store = build_features(verifier, sequences, tmp_path / "features", layers, top_k=4, log=lambda *a: None)
    argv = ["--arch", "dflash", "--steps", "4", "--seqs-per-step", "2", "--anchors-per-seq", "4", "--block-size", "6"]
    args = parser().parse_args([*argv, "--layers", "2", "--save-every", "2", "--eval-every", "2"])
    summary = train(args, verifier, store, tmp_path / "out", tmp_path / "run")
    assert summary["steps"] == 4 and np.isfinite(summary["tau"])

    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["block_size"] == 6 and config["num_target_layers"] == 3 and config["num_hidden_layers"] == 2
    assert config["dflash_config"]["target_layer_ids"] == [i - 1 for i in layers]
    assert all(t.dtype == torch.bfloat16 for t in load_file(str(tmp_path / "out" / "model.safetensors")).values())

    drafter = DFlashDrafter.from_pretrained(tmp_path / "out", verifier)
    trained = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)["model"]
    for name, weight in drafter.model.state_dict().items():
        torch.testing.assert_close(weight, trained[name].to(torch.bfloat16).float(), msg=name)

    anchors = [5, 12, 20, 27]
    vmap = VocabMap(torch.arange(VOCAB), VOCAB)
    batch = block_batch(store, [0], None, len(anchors), 6, vmap, anchors=[np.array(anchors)])
    embed, head = verifier.get_input_embeddings(), verifier.get_output_embeddings().weight
    with torch.no_grad():
        predicted = dflash_forward(drafter.model, embed, head, batch)[0].argmax(-1)
    ids = store.sequence(0)["ids"].tolist()
    for j, a in enumerate(anchors):
        assert drafting_logits(verifier, drafter, ids, a).argmax(-1).tolist() == predicted[j].tolist()
    check_greedy_lossless(verifier, torch.tensor([[3, 4, 5]]), drafter, max_new_tokens=16)
