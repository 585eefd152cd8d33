"""Batched decoding: tokens/s of `hybrid.generate` on left-padded batches against plain `model.generate`.

    python -m experiments.batching --dataset mt-bench --num-prompts 4 --batch-sizes 1,2,4 --max-new-tokens 64
    python -m experiments.batching --model tiny --num-prompts 4 --batch-sizes 1,2 --max-new-tokens 8   # CI size

The same prompts (chat template, left-padded) are decoded in batches of each size by: plain `generate`;
hybrid with the default drafter; hybrid with no drafter (the engine's own overhead). Every row decodes
exactly --max-new-tokens tokens (min_new_tokens), so every method emits the same number of tokens.
"identical" says whether each row of hybrid's batched output equals hybrid's batch-1 output on that
prompt (which the property tests tie to `generate`'s batch-1 greedy output). Plain `generate` on a
padded batch is not compared: its rows can differ from its own batch-1 output in the last bits.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import hybrid
from experiments.arguments import parse_numbers
from experiments.datasets import load_prompts
from experiments.models import load_with_drafter
from verifiers.prompts import encode_prompt

METHODS = ("plain", "hybrid", "hybrid-none")


def left_pad(rows: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [1, n_b] as one left-padded batch and its attention mask."""
    width = max(row.shape[1] for row in rows)
    ids = torch.cat([torch.cat([row.new_full((1, width - row.shape[1]), pad_id), row], dim=1) for row in rows])
    mask = torch.cat(
        [torch.cat([row.new_zeros(1, width - row.shape[1]), row.new_ones(1, row.shape[1])], dim=1) for row in rows]
    )
    return ids, mask


def run(
    method: str, model, drafter, ids: torch.Tensor, mask: torch.Tensor, settings: dict
) -> tuple[torch.Tensor, float]:
    start = time.perf_counter()
    if method == "plain":
        out = model.generate(ids, attention_mask=mask, **settings)
    else:
        out = hybrid.generate(
            model, ids, attention_mask=mask, drafter=drafter if method == "hybrid" else None, **settings
        )
    return out, time.perf_counter() - start


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.batching", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default="default", help="default (verifier + shipped drafter), tiny, or a checkpoint folder"
    )
    parser.add_argument("--dataset", default="mt-bench", help="dev, mt-bench, humaneval or a .jsonl file of prompts")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--batch-sizes", default="1,2,4")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    parser.add_argument("--out", default="runs/batching", help="folder for batching.json")
    args = parser.parse_args(argv)
    sizes = parse_numbers(args.batch_sizes, "--batch-sizes", int)
    if args.num_prompts < 1 or args.max_new_tokens < 1 or min(sizes) < 1:
        parser.error("--num-prompts, --max-new-tokens and every batch size must be >= 1")
    if any(args.num_prompts % size for size in sizes):
        parser.error(f"--num-prompts {args.num_prompts} must be a multiple of every batch size {sizes}")

    with torch.inference_mode():
        results = measure(args, sizes)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "batching.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return results


def measure(args, sizes: list[int]) -> dict[str, dict]:
    model, tokenizer, drafter = load_with_drafter(args.model, args.device)
    pad_id = next((i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id) if i is not None), 0)
    prompts = [
        encode_prompt(tokenizer, text).to(model.device) for text in load_prompts(args.dataset)[: args.num_prompts]
    ]
    settings = {
        "max_new_tokens": args.max_new_tokens,
        "min_new_tokens": args.max_new_tokens,
        "do_sample": False,
        "pad_token_id": pad_id,
    }

    alone = [hybrid.generate(model, p, drafter=drafter, **settings)[0, p.shape[1] :] for p in prompts]  # also warms up
    tokens = args.num_prompts * args.max_new_tokens
    results = {}
    for size in sizes:
        for method in METHODS:
            seconds, identical = 0.0, True
            for start in range(0, len(prompts), size):
                ids, mask = left_pad(prompts[start : start + size], pad_id)
                out, took = run(method, model, drafter, ids, mask, settings)
                seconds += took
                if method != "plain":
                    identical &= all(torch.equal(out[r, ids.shape[1] :], alone[start + r]) for r in range(out.shape[0]))
            results[f"{method}@{size}"] = {
                "method": method,
                "batch_size": size,
                "tok_s": tokens / seconds,
                "identical": None if method == "plain" else identical,
            }
            print(
                f"batch {size}  {method:<12} {tokens / seconds:6.1f} tok/s"
                + ("" if method == "plain" else f"   rows identical to batch 1: {'yes' if identical else 'NO'}"),
                flush=True,
            )

    print(
        f"\n{args.dataset}: {args.num_prompts} prompts, {args.max_new_tokens} new tokens each, greedy, "
        f"{torch.get_num_threads()} threads"
    )
    print(
        f"{'batch':>5}  {'plain tok/s':>11}  {'hybrid tok/s':>12}  {'speed-up':>8}  {'no-draft tok/s':>14}  {'vs plain':>8}  identical"
    )
    for size in sizes:
        plain, ours, none = (results[f"{m}@{size}"] for m in METHODS)
        print(
            f"{size:>5}  {plain['tok_s']:>11.1f}  {ours['tok_s']:>12.1f}  {ours['tok_s'] / plain['tok_s']:>7.2f}x  "
            f"{none['tok_s']:>14.1f}  {none['tok_s'] / plain['tok_s']:>7.2f}x  "
            f"{'yes' if ours['identical'] and none['identical'] else 'NO'}"
        )
    return results


if __name__ == "__main__":
    main()
