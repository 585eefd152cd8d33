"""Which quantization schemes hybrid serves on the embedded verifier, each judged against its own `model.generate`.

    python -m experiments.quantized --num-prompts 3 --max-new-tokens 48 --out OUT

Each scheme whose library is installed (torch.ao's dynamic quantization; torchao's int8 weight-only and int8
weights with per-token int8 activations; bitsandbytes' LLM.int8 with its default outlier threshold and without
one, and its 4-bit NF4) quantizes a fresh copy of the embedded verifier, and hybrid decodes our first dev prompts
with prompt lookup, greedily: `equal` (every output `generate`'s, up to the near-tie contract of
`hybrid.testing`), `refused` (hybrid raised an error that names why), `differs` (a silent difference: a bug) or
`not installed`. Neither library is a dependency of hybrid: install them to judge their schemes. Prints a table
and writes OUT/table.md.
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import torch
import transformers

SCHEMES = (
    "torch.ao dynamic int8",
    "torchao int8 weights",
    "torchao int8 weights and activations",
    "bitsandbytes LLM.int8",
    "bitsandbytes int8, no outliers",
    "bitsandbytes 4-bit NF4",
)


def quantized_verifier(scheme: str):
    """A fresh copy of the embedded verifier quantized by `scheme` (ImportError where its library is missing)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from verifiers.embedded import MODEL_NAME, cache_dir, load_verifier

    if scheme.startswith("bitsandbytes"):
        import bitsandbytes  # noqa: F401  (missing: not installed)

        settings = {
            "bitsandbytes LLM.int8": dict(load_in_8bit=True),
            "bitsandbytes int8, no outliers": dict(load_in_8bit=True, llm_int8_threshold=0.0),
            "bitsandbytes 4-bit NF4": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4"),
        }[scheme]
        load_verifier()  # converts the GGUF into the cache folder once
        return AutoModelForCausalLM.from_pretrained(
            cache_dir() / MODEL_NAME, quantization_config=BitsAndBytesConfig(**settings), device_map="cpu"
        ).eval()
    model, _ = load_verifier()
    if scheme == "torch.ao dynamic int8":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            model.model = torch.ao.quantization.quantize_dynamic(model.model, {torch.nn.Linear}, dtype=torch.qint8)
        return model
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_

    weights_only = scheme == "torchao int8 weights"
    quantize_(model, Int8WeightOnlyConfig() if weights_only else Int8DynamicActivationInt8WeightConfig())
    return model


def judge(scheme: str, prompts: list[torch.Tensor], max_new_tokens: int) -> dict:
    from drafters import PromptLookupDrafter
    from hybrid.testing import check_greedy_lossless

    try:
        model = quantized_verifier(scheme)
    except ImportError as error:
        return {"verdict": "not installed", "detail": str(error).splitlines()[0]}
    for i, prompt in enumerate(prompts):
        try:
            check_greedy_lossless(model, prompt, PromptLookupDrafter(), max_new_tokens=max_new_tokens)
        except AssertionError as error:
            return {"verdict": "differs", "detail": f"prompt {i}: {str(error).splitlines()[0]}"}
        except (ValueError, TypeError) as error:
            return {"verdict": "refused", "detail": str(error)}
    return {"verdict": "equal", "detail": f"{len(prompts)} prompts, {max_new_tokens} new tokens each"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    from experiments.datasets import load_prompts
    from verifiers.embedded import load_verifier
    from verifiers.prompts import encode_prompt

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    _, tokenizer = load_verifier()
    prompts = [encode_prompt(tokenizer, text) for text in load_prompts("dev")[: args.num_prompts]]
    lines = ["| scheme | verdict | detail |", "|---|---|---|"]
    for scheme in SCHEMES:
        record = judge(scheme, prompts, args.max_new_tokens)
        print(f"{scheme}: {record['verdict']}", flush=True)
        lines.append(f"| {scheme} | {record['verdict']} | {record['detail'][:240].replace('|', '/')} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
