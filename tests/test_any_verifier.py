"""Training and stores for any verifier: `python -m drafters.training.train --verifier DIR` and `python -m
drafters.training.ngram_build --verifier DIR` on tiny random verifiers of four architectures (Llama, Qwen3, GPT-2,
whose config has no key/value heads, MLP width or RoPE, and whose final norm is `transformer.ln_f`, and Qwen3.5, whose
linear-attention layers keep recurrent and convolution state instead of keys and values), saved as plain
folders with a byte tokenizer (with a chat template, and without one for GPT-2): each trains from the command line,
loads for its verifier and decodes losslessly, a DFlash export loads through its own model code, a drafter or store is
refused for another verifier, and the embedded default given as a folder is trained exactly as the built-in path
trains it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from test_dflash_export import hybrid_forward
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

import hybrid
from drafters import BlockDiffusionDrafter, DFlashDrafter, PromptLookupDrafter
from drafters.block_diffusion import BlockDiffusionConfig, verifier_fingerprint
from drafters.ngram_store import NgramStore
from drafters.training import ngram_build, train
from drafters.training.dflash import dflash_config, dflash_layers
from drafters.training.distill import synthetic_user_turns
from drafters.training.models import final_norm
from hybrid.drafter_choice import shipped_fingerprint
from hybrid.testing import STATE_ARCHITECTURES, byte_tokenizer, check_greedy_lossless, tiny_model
from schedulers import FixedScheduler
from verifiers.prompts import encode_prompt

# Architecture: whether its tokenizer has a chat template. Qwen3.5: a Gated DeltaNet (linear-attention) layer, then a
# full-attention one.
VERIFIERS = {"llama": True, "qwen3": True, "gpt2": False, "qwen3_5": True}
PROMPTS = [f"Explain {topic} in one line." for topic in ("tides", "bread", "rust", "chess", "rain", "jazz", "glue")]
GENERATION = ["--gen-shards", "2", "--gen-batch", "4", "--max-new-tokens", "24"]
TRAINING = ["--doc-tokens", "0", "--steps", "2", "--seqs-per-step", "2", "--anchors-per-seq", "4"]
TRAINING += ["--block-size", "4", "--draft-vocab", "64", "--save-every", "1", "--eval-every", "2"]


def save_verifier(folder: Path, arch: str, seed: int = 1) -> Path:
    """A tiny random verifier and its byte tokenizer, written as any transformers checkpoint folder is."""
    tokenizer = byte_tokenizer(chat_template=VERIFIERS[arch])
    # Two decoder layers each: a state architecture's tiny model has a state layer and an attention layer per unit.
    units = 1 if arch in STATE_ARCHITECTURES else 2
    model = tiny_model(arch, len(tokenizer), units, seed=seed, max_position_embeddings=256)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def load(folder: Path):
    return AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The verifiers' folders, a prompt file, and one work folder every run of this module shares (a rerun reuses
    what an earlier one cached, per verifier)."""
    root = tmp_path_factory.mktemp("any-verifier")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    folders = {arch: save_verifier(root / arch, arch) for arch in VERIFIERS}
    return {"folders": folders, "prompts": prompts, "work": root / "work"}


def train_for(world, arch: str, drafter_arch: str, *extra: str) -> Path:
    """Train `drafter_arch` for verifier `arch` through the command line; the folder the drafter went to."""
    argv = ["--verifier", str(world["folders"][arch]), "--prompts", str(world["prompts"])]
    argv += ["--work-dir", str(world["work"]), "--arch", drafter_arch, *GENERATION, *TRAINING, *extra]
    train.main(argv)
    model, _ = load(world["folders"][arch])
    return train.verifier_work_dir(world["work"], verifier_fingerprint(model)) / f"{drafter_arch}-drafter"


@pytest.mark.parametrize("arch", sorted(VERIFIERS))
def test_a_block_drafter_trained_for_any_verifier_decodes_losslessly_with_it(world, arch, one_thread):
    out = train_for(world, arch, "block")
    model, tokenizer = load(world["folders"][arch])
    prompt = encode_prompt(tokenizer, "Explain tides in one line.")
    assert prompt.shape[1] > 0 and (tokenizer.chat_template is None) == (arch == "gpt2")
    drafter = BlockDiffusionDrafter.from_pretrained(out, model, tokenizer=tokenizer)
    assert drafter.model.config.verifier == verifier_fingerprint(model)
    report = check_greedy_lossless(model, prompt, drafter, FixedScheduler(drafter.node_budget), max_new_tokens=20)
    assert sum(report.stats.drafted) > 0  # every step drafts: whether that pays is the cost model's call
    check_greedy_lossless(model, prompt, hybrid.drafter_for(model, out, tokenizer=tokenizer), max_new_tokens=20)


@pytest.mark.parametrize("arch", sorted(VERIFIERS))
def test_a_dflash_drafter_trained_for_any_verifier_is_a_folder_its_own_code_and_hybrid_run(world, arch, one_thread):
    """`--arch dflash` writes a DFlash folder: it reads layers below the verifier's last (hidden_states[L] is
    final-normed in transformers, not in vLLM or SGLang), names its verifier, loads through `AutoModel` with the weight
    names and forward of hybrid's drafter, and decodes losslessly under hybrid and through its own `spec_generate`."""
    out = train_for(world, arch, "dflash")
    model, tokenizer = load(world["folders"][arch])
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["num_target_layers"] == 2
    assert config["dflash_config"]["target_layer_ids"] == [0]  # layer 0 of 2: never the last one
    assert config["verifier_fingerprint"] == verifier_fingerprint(model)
    drafter = DFlashDrafter.from_pretrained(out, model, tokenizer=tokenizer)
    check_greedy_lossless(model, encode_prompt(tokenizer, "Explain rain in one line."), drafter, max_new_tokens=20)

    sys.modules.pop("transformers_modules", None)  # this folder's own code, not an earlier folder's
    loaded = AutoModel.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    mine = drafter.model.state_dict()
    assert {k: tuple(v.shape) for k, v in loaded.state_dict().items()} == {k: tuple(v.shape) for k, v in mine.items()}
    for name, weight in mine.items():
        torch.testing.assert_close(loaded.state_dict()[name], weight, rtol=0, atol=0, msg=name)
    gen = torch.Generator().manual_seed(0)
    n, h = 7, model.config.hidden_size
    target_hidden, noise = torch.randn(1, n, h, generator=gen), torch.randn(1, drafter.block_size, h, generator=gen)
    positions = torch.arange(n + drafter.block_size)[None]
    with torch.no_grad():
        expected = hybrid_forward(drafter, target_hidden, noise, positions)
        got = loaded(positions, noise_embedding=noise, target_hidden=target_hidden)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    prompt = encode_prompt(tokenizer, "Explain jazz in one line.")  # and its own spec_generate decodes losslessly
    reference = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16, do_sample=False)
    decoded = loaded.spec_generate(target=model, input_ids=prompt, max_new_tokens=16)
    assert decoded.tolist() == reference.tolist()  # no end-of-sequence token: 16 new tokens each


@pytest.mark.parametrize("dtype, loads_in", [("bfloat16", ("bfloat16", "float32")), ("float16", ("float16",))])
def test_a_verifier_in_half_precision_trains_a_float32_drafter_for_it(world, dtype, loads_in, tmp_path, one_thread):
    """`--dtype`: the verifier answers and gives its features in `dtype`, cached apart from its float32 ones; the
    drafter trains in float32 and decodes losslessly for the verifier loaded in `dtype`, and, trained in bfloat16, in
    float32 too. (Float32 weights rounded to float16 can round to other bfloat16 values than their own, so their
    fingerprint, hashed in bfloat16, is another verifier's: a float16 drafter is for the verifier loaded in float16.)"""
    out = tmp_path / "drafter"
    train_for(world, "llama", "block", "--dtype", dtype, "--out", str(out))
    model, tokenizer = load(world["folders"]["llama"])
    work = train.verifier_work_dir(world["work"], verifier_fingerprint(model.to(getattr(torch, dtype))))
    assert [p.name for p in work.glob(f"generated-*-{dtype}")] and [p.name for p in work.glob(f"features-*-{dtype}-*")]
    assert json.loads((out / "training.json").read_text())["verifier_dtype"] == dtype
    (run,) = [p for p in work.glob(f"train-block-features-*-{dtype}-*") if (p / "checkpoint.pt").exists()]
    weights = torch.load(run / "checkpoint.pt", weights_only=False)["model"]
    assert {w.dtype for w in weights.values() if w.is_floating_point()} == {torch.float32}
    prompt = encode_prompt(tokenizer, "Explain glue in one line.")
    for name in loads_in:
        verifier = load(world["folders"]["llama"])[0].to(getattr(torch, name))
        drafter = BlockDiffusionDrafter.from_pretrained(out, verifier, tokenizer=tokenizer)
        check_greedy_lossless(verifier, prompt, drafter, max_new_tokens=20)


def test_features_in_bfloat16_come_from_the_float32_answers_and_train_a_float32_drafter(world, tmp_path, one_thread):
    """`--feature-dtype bfloat16`: the features stage alone runs a bfloat16 copy of the verifier, over the answers
    the float32 verifier gave (the same folder a float32 run reads), into a feature folder of its own; the verifier
    the drafter trains and decodes with stays float32."""
    out, own = tmp_path / "drafter", ["--work-dir", str(tmp_path / "work")]  # a work folder no other test writes
    train_for(world, "llama", "block", *own, "--out", str(out))  # the float32 answers and features
    train_for(world, "llama", "block", *own, "--feature-dtype", "bfloat16", "--out", str(out))
    model, tokenizer = load(world["folders"]["llama"])
    work = train.verifier_work_dir(tmp_path / "work", verifier_fingerprint(model))
    assert not list(work.glob("generated-*-bfloat16"))
    (half,) = work.glob("features-*-bfloat16")
    (full,) = [p for p in work.glob("features-*") if p.name == half.name.removesuffix("-bfloat16")]
    ids = [np.fromfile(folder / "ids.bin", dtype=np.int32) for folder in (full, half)]
    hidden = [np.fromfile(folder / "hidden.bin", dtype=np.float16) for folder in (full, half)]
    np.testing.assert_array_equal(*ids)
    assert not np.array_equal(*hidden)  # rounded differently: recorded by another precision
    summary = json.loads((out / "training.json").read_text())
    assert (summary["verifier_dtype"], summary["feature_dtype"]) == ("float32", "bfloat16")
    drafter = BlockDiffusionDrafter.from_pretrained(out, model, tokenizer=tokenizer)
    check_greedy_lossless(model, encode_prompt(tokenizer, "Explain glue in one line."), drafter, max_new_tokens=20)


def test_float32_features_of_a_bfloat16_verifier_are_recorded_in_float32(world, tmp_path, one_thread):
    """`--dtype bfloat16 --feature-dtype float32`: the answers are the bfloat16 verifier's, the features a float32
    copy's, in a folder named for them (not the bfloat16 features' folder, which a --dtype bfloat16 run reads)."""
    out, own = tmp_path / "drafter", ["--work-dir", str(tmp_path / "work")]
    train_for(world, "llama", "block", *own, "--dtype", "bfloat16", "--feature-dtype", "float32", "--out", str(out))
    model, _ = load(world["folders"]["llama"])
    work = train.verifier_work_dir(tmp_path / "work", verifier_fingerprint(model.to(torch.bfloat16)))
    assert [p.name for p in work.glob("generated-*-bfloat16")]
    assert [p.name for p in work.glob("features-*-bfloat16-*-float32")]
    summary = json.loads((out / "training.json").read_text())
    assert (summary["verifier_dtype"], summary["feature_dtype"]) == ("bfloat16", "float32")


def test_the_ar_baseline_trains_for_a_verifier_without_llama_fields(world, one_thread):
    from drafters.ar_baseline import load_ar_model

    out = train_for(world, "gpt2", "ar")
    model, _ = load(world["folders"]["gpt2"])
    drafted = load_ar_model(out, model)
    assert drafted.config.num_key_value_heads == drafted.config.num_attention_heads == 4
    assert final_norm(model) is model.transformer.ln_f


def test_a_drafter_trained_for_one_verifier_is_refused_for_another_naming_which(world, tmp_path, one_thread):
    block, dflash = train_for(world, "llama", "block"), train_for(world, "qwen3", "dflash")
    qwen3, _ = load(world["folders"]["qwen3"])
    llama, _ = load(world["folders"]["llama"])
    with pytest.raises(ValueError, match=r"trained for another verifier \(architecture 'LlamaForCausalLM' != "):
        BlockDiffusionDrafter.from_pretrained(block, qwen3)
    with pytest.raises(ValueError, match=r"trained for LlamaForCausalLM \(.*\), but the verifier given is Qwen3"):
        hybrid.drafter_for(qwen3, block)
    # The same shape, other weights: the fingerprint a folder hybrid trained records tells them apart.
    twin, _ = load(save_verifier(tmp_path / "twin", "qwen3", seed=2))
    assert twin.config.to_diff_dict() | {"_name_or_path": ""} == qwen3.config.to_diff_dict() | {"_name_or_path": ""}
    with pytest.raises(ValueError, match=r"trained for another verifier \(embedding_sha256 "):
        DFlashDrafter.from_pretrained(dflash, twin)
    with pytest.raises(ValueError, match=r"trained for Qwen3ForCausalLM \(.*\), but the verifier given is Qwen3"):
        hybrid.drafter_for(twin, dflash)
    with pytest.raises(ValueError, match=r"trained for another verifier \(architecture 'Qwen3ForCausalLM' != "):
        DFlashDrafter.from_pretrained(dflash, llama)  # same shape, another architecture


def test_an_ngram_store_built_for_any_verifier_drafts_for_it_and_only_for_it(world, one_thread):
    folder = world["folders"]["gpt2"]
    argv = ["--verifier", str(folder), "--prompts", str(world["prompts"]), "--work-dir", str(world["work"])]
    ngram_build.main([*argv, *GENERATION, "--min-count", "1"])
    model, tokenizer = load(folder)
    work = train.verifier_work_dir(world["work"], verifier_fingerprint(model))
    store = NgramStore.from_pretrained(work / "ngram-store")
    assert store.verifier == verifier_fingerprint(model) and store.info["answers"].startswith("generated-prompts-")
    assert (work / store.info["answers"]).is_dir()  # the answers the generate stage of train writes and reads
    answer = json.loads(sorted((work / store.info["answers"]).glob("gen-*.json"))[0].read_text())[1]
    prompt = torch.tensor([answer["ids"][: answer["prompt_len"] + 4]])
    drafter = PromptLookupDrafter(ngram_store=store, store_min_n=1, min_ngram=0, verifier=model)
    report = check_greedy_lossless(model, prompt, drafter, max_new_tokens=16)
    assert sum(report.stats.accepted) > 0  # it drafts the verifier's own answer

    other, _ = load(world["folders"]["llama"])
    with pytest.raises(ValueError, match="built from another verifier's answers"):
        PromptLookupDrafter(ngram_store=store, verifier=other)
    with pytest.raises(ValueError, match="built from another verifier's answers"):  # checked at the call too
        hybrid.generate(other, prompt, drafter=PromptLookupDrafter(ngram_store=store), max_new_tokens=4)


def test_the_embedded_verifier_given_as_a_folder_trains_as_the_built_in_path(world, tmp_path, monkeypatch, one_thread):
    """The built-in path (`load_verifier`, here handing out a tiny verifier built in memory) and `--verifier DIR` of
    the same weights saved to a folder have one fingerprint, so the same work folders, and give the same weights after
    one step."""
    built_in = tiny_model("llama", 256, 2, seed=5, max_position_embeddings=256), byte_tokenizer()
    folder = tmp_path / "saved"
    built_in[0].save_pretrained(folder)
    built_in[1].save_pretrained(folder)
    monkeypatch.setattr(train, "load_verifier", lambda device, dtype: built_in)
    common = ["--prompts", str(world["prompts"]), *GENERATION, "--doc-tokens", "0", "--steps", "1", "--eval-every", "1"]
    common += ["--seqs-per-step", "2", "--anchors-per-seq", "4", "--block-size", "4", "--draft-vocab", "64"]
    train.main(["--work-dir", str(tmp_path / "a"), *common])
    train.main(["--work-dir", str(tmp_path / "b"), "--verifier", str(folder), *common])
    assert verifier_fingerprint(load(folder)[0]) == verifier_fingerprint(built_in[0])

    def folders(root: Path) -> set[str]:
        return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_dir()}

    assert folders(tmp_path / "a") == folders(tmp_path / "b") and any("verifiers" in f for f in folders(tmp_path / "a"))
    (run,) = [f for f in folders(tmp_path / "a") if Path(f).name.startswith("train-block-")]
    (answers,) = [f for f in folders(tmp_path / "a") if Path(f).name.startswith("generated-")]
    for shard in (tmp_path / "a" / answers).glob("gen-*.json"):  # the same answers, so the same batches
        assert shard.read_text() == (tmp_path / "b" / answers / shard.name).read_text()
    a = torch.load(tmp_path / "a" / run / "checkpoint.pt", weights_only=False)
    b = torch.load(tmp_path / "b" / run / "checkpoint.pt", weights_only=False)
    assert a["step"] == b["step"] == 1
    for name in a["model"]:
        torch.testing.assert_close(a["model"][name], b["model"][name], rtol=0, atol=0, msg=name)
    # The embedded verifier itself keeps the folders its recipes and experiments.heldout have always read.
    assert train.verifier_work_dir(tmp_path, shipped_fingerprint()) == tmp_path


def test_layer_choices_follow_any_config(world):
    gpt2, _ = load(world["folders"]["gpt2"])
    config = BlockDiffusionConfig.for_verifier(gpt2)
    assert (config.num_kv_heads, config.head_dim, config.intermediate_size) == (4, 8, 128)
    assert config.target_layers == (1, 2)  # the block drafter, served by hybrid only, keeps the last layer
    deep = tiny_model("qwen3", 64, 30, seed=0)
    assert BlockDiffusionConfig.for_verifier(deep).target_layers == (2, 9, 16, 23, 30)  # as the shipped checkpoint
    assert dflash_layers(deep) == (2, 9, 16, 23, 29)
    with pytest.raises(ValueError, match=r"before the last \(hidden_states 1\.\.29\), not \[2, 30\]"):
        dflash_config(deep, (2, 30), 1, 4, 0)
    with pytest.raises(ValueError, match="has 1: train the block drafter"):
        dflash_layers(tiny_model("qwen3", 64, 1, seed=0))


def test_synthetic_prompts_without_a_chat_template_are_refused_naming_the_fix(world, tmp_path):
    model, tokenizer = load(world["folders"]["gpt2"])
    with pytest.raises(ValueError, match=r"no chat template.*--prompts FILE\.jsonl"):
        synthetic_user_turns(model, tokenizer, 4, tmp_path / "turns.json")
    llama, templated = load(world["folders"]["llama"])
    with pytest.raises(ValueError, match=r"names no end-of-turn token.*--prompts"):
        synthetic_user_turns(llama, templated, 4, tmp_path / "turns.json")
    with pytest.raises(SystemExit, match="--verifier .*nowhere: no config.json there.*save_pretrained"):
        train.main(["--verifier", str(tmp_path / "nowhere")])
