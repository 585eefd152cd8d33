"""Which of the installed transformers' causal LMs hybrid serves, each judged against its own `model.generate`.

    python -m experiments.architectures --out OUT                # every model type AutoModelForCausalLM maps
    python -m experiments.architectures --types llama,bart --out OUT

Each model type is built as a tiny random model from its config's defaults (shrunk: 2 layers, width 32, 96
tokens) and decoded by `model.generate` and by `hybrid.generate`: greedy with prompt lookup, a perturbed copy of
the verifier's own continuation, a token tree around it and an adversarial drafter; sampled under one seed; a
left-padded batch of two prompts; the static path where the model takes per-row masks; and a prompt grown across
each of the model's position switches (`position_switches`), with no drafter and with prompt lookup. The verdict is
`equal` (every check gave `generate`'s tokens, up to the near-tie and boundary-draw contracts of
`hybrid.testing`), `refused` (hybrid raised an error that names why; a refused batch or static path is noted
beside an `equal`), `differs` (a silent difference: a bug), `hybrid error` (hybrid failed inside a check, an
assert inside the model included) or `not built` (the tiny config, or `generate` itself, failed: no verdict on
hybrid).

Each type runs in a process of its own under a time and memory limit; OUT/records.jsonl keeps each verdict as it
comes, so a rerun with the same OUT skips the types it has. It prints a table and writes OUT/table.md.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
import traceback
from pathlib import Path

VOCAB = 96
# Fields a tiny config overrides wherever its config class has them.
SHRINK = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    d_model=32,
    n_embd=32,
    num_hidden_layers=2,
    n_layer=2,
    n_layers=2,
    num_layers=2,
    decoder_layers=2,
    encoder_layers=2,
    num_attention_heads=4,
    n_head=4,
    n_heads=4,
    decoder_attention_heads=4,
    encoder_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=64,
    ffn_dim=64,
    decoder_ffn_dim=64,
    encoder_ffn_dim=64,
    n_inner=64,
    head_dim=8,
    max_position_embeddings=256,
    n_positions=256,
    initializer_range=0.3,  # logits spread out, so near ties are as rare as in real models
    init_std=0.3,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    num_experts=4,
    n_routed_experts=4,
    num_local_experts=4,
    num_experts_per_tok=2,
    kv_lora_rank=16,
    q_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=8,
    sliding_window=6,
    rotary_dim=4,
    partial_rotary_factor=0.5,
    # State-space and recurrent layers (Mamba's, RG-LRU's): their widths follow hidden_size only in part
    mamba_d_state=8,
    mamba_n_heads=8,
    mamba_num_heads=8,
    mamba_d_head=8,
    mamba_head_dim=8,
    mamba_headdim=8,
    mamba_d_ssm=64,
    mamba_dt_rank=8,
    time_step_rank=8,
    ssm_state_size=8,
    lru_width=32,
)
# Dots3 Note: its indexer sparse enough to select, and its sliding layer with heads and ranks of its own.
_DOTS3_TEXT = {
    "per_layer_config": {1: dict(num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=8, qk_nope_head_dim=16)},
    "index_topk": 4,
    "index_head_dim": 16,
    "index_n_heads": 4,
    "shared_experts_intermediate_size": 32,
}
# Inkling 2: its sliding-window heads and relative-position bias at SHRINK's widths.
_INKLING2_TEXT = dict(
    unpadded_vocab_size=VOCAB,
    swa_num_attention_heads=4,
    swa_num_key_value_heads=2,
    swa_head_dim=8,
    sliding_window_size=6,
    rel_extent=16,
    d_rel=4,
)
# Qwen4 Exp: its indexer (unset by default) and linear-attention heads at SHRINK's widths.
_QWEN4_EXP_TEXT = dict(
    indexer_n_heads=4,
    indexer_kv_heads=1,
    indexer_head_dim=8,
    indexer_budget=8,
    indexer_compress_ratio=2,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    hc_lowrank=8,
)
# What some types need beyond SHRINK for their tiny config to build ("text_config.x": a sub-config's field). A
# hybrid model (bamba, jamba, nemotron_h, zamba...) gets one recurrent and one attention layer: the defaults' first
# two are both recurrent.
_LONGROPE = dict(
    rope_type="longrope",
    rope_theta=10000.0,
    original_max_position_embeddings=64,
    short_factor=[1.0, 1.2, 1.5, 2.0],
    long_factor=[3.0, 5.0, 8.0, 13.0],
)
OVERRIDES = {
    "axk1": dict(n_group=1, topk_group=1),  # expert groups that divide the 4 experts
    "bamba": dict(attn_layer_indices=[1]),
    "blt": {
        "num_hidden_layers": 2,  # what its cache is built for
        "encoder_hash_byte_group_vocab": 64,
        # One patch state per hidden_size: the global transformer's width, without a projection
        "cross_attn_k": 1,
        "encoder_config.cross_attn_k": 1,
        "decoder_config.cross_attn_k": 1,
        "encoder_config.hidden_size_global": 32,
        "decoder_config.hidden_size_global": 32,
    },
    # Per-layer-type rope (multimodal sections that fit head_dim 8); its full-attention layers without rope
    "cohere_compass_text": dict(
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 1, 1]),
            "full_attention": None,
        },
    ),
    # rope_theta is read but unused; clip_qkv=None reaches clamp(None, None), so the released 8
    # Compressed windows that close within the survey's 29 tokens, and an indexer that chooses among them
    "deepseek_v4": dict(
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}, index_topk=2
    ),
    "dbrx": {"attn_config.rope_theta": 10000.0, "attn_config.clip_qkv": 8, "ffn_config.ffn_hidden_size": 64},
    # One input, one looped (twice, each loop with cache layers of its own) and one output layer
    "dory": dict(
        num_hidden_layers=3,
        n_input_layers=1,
        n_recurrent_layers=1,
        n_output_layers=1,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    ),
    "dots1": dict(n_shared_experts=1, layer_types=["full_attention", "full_attention"]),
    "dots3_note": {f"text_config.{name}": value for name, value in _DOTS3_TEXT.items()},
    "dots3_note_text": _DOTS3_TEXT,
    # Its third layer reuses the cache of the last earlier layer of its kind; per-layer widths, one per layer
    "gemma3n_text": dict(
        num_hidden_layers=3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        num_kv_shared_layers=1,
        intermediate_size=[64] * 3,
        activation_sparsity_pattern=[0.95, 0.0, 0.0],
        vocab_size_per_layer_input=VOCAB,
        hidden_size_per_layer_input=8,
        laurel_rank=8,
    ),
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"], shared_intermediate_size=32),
    "hrm_text": dict(num_layers_per_stack=1, H_cycles=1, L_cycles=1, L_bp_cycles=[1]),
    # Its middle layer looped twice, each pass with cache layers of its own
    "inkling2_loop_text": dict(
        _INKLING2_TEXT,
        num_hidden_layers=3,
        layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding"],
        n_layers_per_attn_res_block=1,
        loop_layer_index_start=1,
        loop_layer_index_end=2,
        loop_num_passes=2,
        loop_gate_rank=8,
    ),
    "inkling2_text": _INKLING2_TEXT,
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1),
    # LongRoPE, as the long-context checkpoints have it (Phi-3-mini-128k, Phi-3.5): their generate re-reads the
    # sequence with the long factors once it grows past original_max_position_embeddings
    "phi3": dict(original_max_position_embeddings=64, rope_parameters=_LONGROPE),
    "phi4_multimodal": dict(original_max_position_embeddings=64, rope_parameters=_LONGROPE),
    "phimoe": dict(
        original_max_position_embeddings=64, rope_parameters=dict(_LONGROPE, short_mscale=1.0, long_mscale=1.2)
    ),
    # One short-conv layer (a conv state) and one attention layer: lfm2's defaults are all attention (full_attn_idxs
    # every layer), lfm2_moe's have no layer_types at all
    "lfm2": dict(layer_types=["conv", "full_attention"], full_attn_idxs=[1]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    "longcat_flash": dict(
        qk_head_dim=16, ffn_hidden_size=64, expert_ffn_hidden_size=32, zero_expert_num=2, moe_topk=2, num_layers=1
    ),
    "mamba2": dict(num_heads=8, state_size=16),  # num_heads * head_dim = expand * hidden_size
    "modernbert-decoder": dict(pad_token_id=0),
    "nemotron_h": dict(layers_block_type=["linear_attention", "full_attention"]),
    # Its positions count from pad_token_id (None: none to count from)
    "prophetnet": dict(pad_token_id=0, num_decoder_layers=2, num_encoder_layers=2, num_decoder_attention_heads=4),
    "qwen4_exp": {f"text_config.{name}": value for name, value in _QWEN4_EXP_TEXT.items()},
    "qwen4_exp_text": _QWEN4_EXP_TEXT,
    "recurrent_gemma": dict(block_types=["recurrent", "attention"]),
    # Its hash rotations seeded (else drawn afresh each forward); axial position shapes that fit 256 positions
    "reformer": dict(
        attn_layers=["local", "lsh"],
        hash_seed=0,
        attention_head_size=8,
        axial_pos_embds_dim=(16, 16),
        axial_pos_shape=(16, 16),
        feed_forward_size=64,
    ),
    "rwkv": dict(attention_hidden_size=32),
    # Causal, as its CLM checkpoints are; the pad id marks the row lengths it reads from input_ids
    "xlm": dict(causal=True, pad_token_id=0),
    # Its query, key and value widths are rounded up to multiples of 64 (in its cache, not in its layers)
    "xlstm": dict(hidden_size=64, embedding_dim=64, num_blocks=2, num_heads=4, qk_dim_factor=1.0),
    # Its adapters are per language; its positions count from pad_token_id, as RoBERTa's do
    "xmod": dict(default_language="en_XX", pad_token_id=0),
    "zamba": dict(layers_block_type=["linear_attention", "hybrid"], attention_hidden_size=64, attention_head_dim=16),
    "zamba2": dict(
        layers_block_type=["linear_attention", "hybrid"],
        hybrid_layer_ids=[1],
        attention_hidden_size=64,
        attention_head_dim=16,
        kv_channels=8,
        num_query_groups=4,
        adapter_rank=8,
    ),
}
SWITCH_LIMIT = 4200  # the longest prompt grown across a switch (Phi-3's default 4096 original positions included)
TIME_LIMIT_S = 240
MEMORY_LIMIT_BYTES = 12 * 2**30


def _shrink(config) -> None:
    """Set SHRINK's fields wherever `config` has them, and in each of its sub-configs (a multimodal model's text,
    vision and audio configs)."""
    for name, value in SHRINK.items():
        try:
            if name in config.to_dict() or hasattr(config, name):
                setattr(config, name, value)
        except Exception:  # a derived or per-layer property, or a value its validator refuses: keep the default
            pass
    for name in getattr(config, "sub_configs", {}):
        sub = getattr(config, name, None)
        if sub is not None and sub is not config and hasattr(sub, "to_dict"):
            _shrink(sub)


def tiny_from_defaults(model_type: str):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type)
    _shrink(config)
    text = config.get_text_config()
    for part in [config] if text is config else [config, text]:  # a multimodal model's own and its text config
        if getattr(part, "layer_types", None) is not None:  # two layers, of both kinds where there are two
            kinds = list(dict.fromkeys(part.layer_types))
            try:
                part.layer_types = (kinds * 2)[:2]
            except AttributeError:  # derived from other fields (Mamba's, Jamba's): those set it
                pass
        if part.to_dict().get("kv_lora_rank"):
            # As released latent-attention checkpoints have (read from to_dict: a per-layer field's global value)
            part.num_key_value_heads = part.to_dict()["num_attention_heads"]
        if hasattr(part, "is_decoder"):
            part.is_decoder = True  # a BERT-like head is a causal LM only as a decoder (without: refused)
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            try:
                # A multimodal model writes its text config's pad id over its media tokens (Gemma 4): the batch's.
                setattr(part, name, 0 if name == "pad_token_id" and part is not config else None)
            except Exception:
                pass
        part.tie_word_embeddings = False
    for name, value in OVERRIDES.get(model_type, {}).items():
        part = config
        *path, name = name.split(".")  # "text_config.x": a sub-config's field
        for sub in path:
            part = getattr(part, sub)
        setattr(part, name, value)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        # As from_pretrained builds it: for a multimodal config some types give the text model alone (Llama 4,
        # Qwen3.5), others the whole model (Gemma 3).
        return AutoModelForCausalLM.from_config(config).eval()


def judge(model_type: str) -> dict:
    """The verdict on one model type (run in a process of its own)."""
    import warnings

    import torch
    import transformers

    import hybrid
    from drafters import PromptLookupDrafter
    from drafters.oracle import OracleDrafter
    from hybrid.testing import AdversarialDrafter, RandomTreeDrafter, check_greedy_lossless, check_sampled_identical
    from verifiers.support import row_mask_problem

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(2, VOCAB, (1, 9), generator=generator)
    prompt[0, 5:] = prompt[0, 1:5]  # something for prompt lookup to copy
    rows = torch.randint(2, VOCAB, (2, 8), generator=generator)
    mask = torch.ones_like(rows)
    rows[1, :3], mask[1, :3] = 0, 0
    settings = dict(max_new_tokens=20, pad_token_id=0)
    try:
        model = tiny_from_defaults(model_type)
        reference = model.generate(prompt, do_sample=False, **settings)
        batch_reference = model.generate(rows, attention_mask=mask, do_sample=False, **settings)
    except Exception as error:
        return {"verdict": "not built", "detail": f"{type(error).__name__}: {error}"}

    perturbed = reference.clone()
    wrong = torch.rand(perturbed.shape, generator=generator) < 0.15
    perturbed[wrong] = torch.randint(0, VOCAB, (int(wrong.sum()),), generator=generator)
    checks = {
        "greedy, lookup": lambda: check_greedy_lossless(model, prompt, PromptLookupDrafter(), **settings),
        "greedy, perturbed": lambda: check_greedy_lossless(model, prompt, OracleDrafter(perturbed), **settings),
        "greedy, tree": lambda: check_greedy_lossless(
            model, prompt, RandomTreeDrafter(VOCAB, None, 3, guide=OracleDrafter(reference)), **settings
        ),
        "greedy, adversarial": lambda: check_greedy_lossless(
            model, prompt, AdversarialDrafter(VOCAB, None, 5), **settings
        ),
        "sampled": lambda: check_sampled_identical(model, prompt, PromptLookupDrafter(), 0, **settings),
        "padded batch": lambda: _check_equal(
            hybrid.generate(model, rows, attention_mask=mask, drafter=PromptLookupDrafter(), **settings),
            batch_reference,
        ),
    }
    notes, differs = [], []
    for name, check in checks.items():
        try:
            check()
        except AssertionError as error:
            if not _a_checks_finding(error):  # an assert inside the model or hybrid: it failed, no verdict on output
                return {"verdict": "hybrid error", "detail": f"{name}: AssertionError: {error}"}
            differs.append(f"{name}: {str(error).splitlines()[0]}")
        except (ValueError, TypeError) as error:
            if name == next(iter(checks)):  # the first check refused: the model is refused
                return {"verdict": "refused", "detail": str(error)}
            notes.append(f"{name} refused: {error}")
        except Exception as error:
            return {"verdict": "hybrid error", "detail": f"{name}: {type(error).__name__}: {error}"}
    for switch in position_switches(model):
        try:
            finding = _check_across(model, switch, generator)
        except Exception as error:
            return {"verdict": "hybrid error", "detail": f"across {switch}: {type(error).__name__}: {error}"}
        if finding and finding.startswith("differs"):
            differs.append(finding.removeprefix("differs "))
        elif finding:
            notes.append(finding)
    no_static = row_mask_problem(model)
    if no_static is None:
        try:
            check_greedy_lossless(
                model, prompt, OracleDrafter(perturbed), hybrid_kwargs={"cache_implementation": "static"}, **settings
            )
        except AssertionError as error:
            if not _a_checks_finding(error):
                return {"verdict": "hybrid error", "detail": f"static: AssertionError: {error}"}
            differs.append(f"static: {str(error).splitlines()[0]}")
        except (ValueError, TypeError) as error:
            notes.append(f"static refused: {error}")
    else:
        notes.append(f"no static path: {no_static}")
    if differs:
        return {"verdict": "differs", "detail": "; ".join(differs)}
    return {"verdict": "equal", "detail": "; ".join(notes)}


def position_switches(model) -> list[int]:
    """The positions at which a model's decoding may change what it computes, up to SWITCH_LIMIT: its rotary
    embeddings' switches and the position limits, windows and chunks its text config names (where a model's own
    `generate` re-reads the sequence, as Phi-3's does at original_max_position_embeddings)."""
    from verifiers.positions import rope_switches

    text = model.config.get_text_config()
    found = {switch.at for switch in rope_switches(model)}
    rope = getattr(text, "rope_parameters", None) or {}
    names = ("original_max_position_embeddings", "max_position_embeddings", "sliding_window", "attention_chunk_size")
    for part in [text.to_dict(), rope, *(value for value in rope.values() if isinstance(value, dict))]:
        for name in names:
            value = part.get(name)
            if isinstance(value, int) and 2 < value <= SWITCH_LIMIT:
                found.add(value)
    return sorted(found)


def _check_across(model, switch: int, generator) -> str | None:
    """Grow a prompt across `switch`, greedy with no drafter and with prompt lookup: None where both equal
    `generate`'s tokens; else what differs ("differs ...") or what was refused."""
    from drafters import PromptLookupDrafter
    from hybrid.testing import check_greedy_lossless

    prompt = grown_prompt(switch, generator)
    settings = dict(max_new_tokens=8, pad_token_id=0)
    try:
        model.generate(prompt, do_sample=False, **settings)
    except Exception as error:
        return f"across {switch}: generate fails ({type(error).__name__})"
    for drafter in (None, PromptLookupDrafter()):
        try:
            check_greedy_lossless(model, prompt, drafter, **settings)
        except AssertionError as error:
            if not _a_checks_finding(error):
                raise
            return f"differs across {switch}: {str(error).splitlines()[0]}"
        except (ValueError, TypeError) as error:
            return f"across {switch} refused: {error}"
    return None


def grown_prompt(switch: int, generator):
    """A prompt that ends 3 tokens before `switch`, with a repeat for prompt lookup to copy."""
    import torch

    length = max(1, switch - 3)
    prompt = torch.randint(2, VOCAB, (1, length), generator=generator)
    if length >= 8:
        prompt[0, -4:] = prompt[0, :4]
    return prompt


def _a_checks_finding(error: AssertionError) -> bool:
    """Whether `error` was raised by a check of this survey or of `hybrid.testing` (outputs that differ), not by an
    assert inside the model or the engine."""
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and Path(frames[-1].filename).name in ("testing.py", "architectures.py")


def _check_equal(output, reference) -> None:
    assert output.shape == reference.shape and bool((output == reference).all()), "the batch's tokens differ"


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))


def judge_in_own_process(model_type: str) -> dict:
    command = [sys.executable, "-m", "experiments.architectures", "--one", model_type]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=TIME_LIMIT_S, preexec_fn=_limit_memory)
    except subprocess.TimeoutExpired:
        return {"verdict": "not built", "detail": f"no verdict within {TIME_LIMIT_S} s"}
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"verdict": "not built", "detail": f"its process ended with {done.returncode}: {tail}"}
    return json.loads(lines[-1])


def table(records: list[dict]) -> str:
    order = ("differs", "hybrid error", "equal", "refused", "not built")
    counts = {verdict: sum(r["verdict"] == verdict for r in records) for verdict in order}
    lines = [", ".join(f"{verdict} {n}" for verdict, n in counts.items()), "", "| model type | verdict | detail |"]
    lines.append("|---|---|---|")
    for record in sorted(records, key=lambda r: (order.index(r["verdict"]), r["type"])):
        detail = record["detail"].replace("|", "/").replace("\n", " ")
        lines.append(f"| {record['type']} | {record['verdict']} | {detail[:240]} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", help="comma-separated model types (default: every causal LM type)")
    parser.add_argument("--out", help="folder for records.jsonl and table.md (rerun with it to resume)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # judge one type here and print its verdict as JSON
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(judge(args.one)))
        return
    if not args.out:
        parser.error("--out is required (records.jsonl and table.md go there)")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from experiments.runs import append_record, read_records

    known = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    types = known if args.types is None else [t.strip() for t in args.types.split(",") if t.strip()]
    unknown = [t for t in types if t not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES]
    if unknown:
        parser.error(f"--types {unknown} are not causal LM types of this transformers (e.g. {known[:3]})")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "records.jsonl"
    done = {r["type"]: r for r in read_records(path, key=lambda r: (r["type"],))}
    for i, model_type in enumerate(types, 1):
        if model_type in done:
            continue
        start = time.perf_counter()
        record = {"type": model_type, **judge_in_own_process(model_type)}
        append_record(path, record)
        done[model_type] = record
        print(f"[{i}/{len(types)}] {model_type}: {record['verdict']} ({time.perf_counter() - start:.0f} s)", flush=True)
    text = table([done[t] for t in types])
    (out / "table.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
