"""Head-to-head tokens/s on the same prompts, same process, methods interleaved to cancel machine noise.

    python -m experiments.bench --dataset dev --num-prompts 8 --max-new-tokens 128 --repeats 3

Methods: plain `model.generate`; HF assisted generation with prompt lookup; hybrid with no drafter,
with prompt lookup, with the shipped block-diffusion drafter (alone and with n-gram lookup), with the
1-layer AR baseline drafter (`python -m drafters.train --arch ar`), and with an oracle drafter that proposes the verifier's own greedy continuation
at zero cost (the ceiling of speculative decoding for this verifier on this machine). Greedy only:
every hybrid output is checked against plain `generate`'s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import hybrid
from drafters import OracleDrafter, PromptLookupDrafter
from experiments import trained_drafters
from experiments.datasets import load_prompts
from hybrid.prompts import encode_prompt
from schedulers import FixedScheduler

METHODS = ("plain", "hf-lookup", "hybrid-none", "hybrid-lookup", "hybrid-block", "hybrid-block-lookup", "hybrid-ar",
           "oracle")
DEFAULT_METHODS = ("plain", "hf-lookup", "hybrid-none", "hybrid-lookup", "hybrid-block-lookup", "oracle")


def run_method(method, model, input_ids, reference, max_new_tokens):
    """(new tokens, seconds, tau or None, output) for one method on one prompt."""
    settings = {"max_new_tokens": max_new_tokens, "do_sample": False}
    start = time.perf_counter()
    if method == "plain":
        out, tau = model.generate(input_ids, **settings), None
    elif method == "hf-lookup":
        out, tau = model.generate(input_ids, prompt_lookup_num_tokens=10, **settings), None
    else:
        drafter = {
            "hybrid-none": lambda: None,
            "hybrid-lookup": PromptLookupDrafter,
            "hybrid-block": lambda: trained_drafters.block(model, 15),
            "hybrid-block-lookup": lambda: trained_drafters.block(model, 15, lookup=True),
            "hybrid-ar": lambda: trained_drafters.ar(model, 6),
            "oracle": lambda: OracleDrafter(reference),
        }[method]()
        scheduler = FixedScheduler(16) if method == "oracle" else None
        out, stats = hybrid.generate(model, input_ids, drafter=drafter, scheduler=scheduler, return_stats=True, **settings)
        tau = stats.tau
    return out.shape[1] - input_ids.shape[1], time.perf_counter() - start, tau, out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="dev", help="dev, mt-bench, humaneval or a .jsonl file of prompts")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS), help=f"comma-separated subset of {METHODS}")
    parser.add_argument("--out", default="runs/bench", help="folder for results.json")
    args = parser.parse_args(argv)
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"unknown method(s) {unknown}: choose from {METHODS}")
    prompts = load_prompts(args.dataset)[: args.num_prompts]  # before any model loads: bad names fail fast

    model, tokenizer, _ = hybrid.load_default()
    torch.set_grad_enabled(False)
    inputs = [encode_prompt(tokenizer, p) for p in prompts]
    model(inputs[0][:, :8])  # warm-up
    references = [model.generate(x, max_new_tokens=args.max_new_tokens, do_sample=False) for x in inputs]

    # results[method][repeat] = [tokens, seconds]; taus[method] = per-prompt tau; identical[method] = all equal
    results = {m: [[0, 0.0] for _ in range(args.repeats)] for m in methods}
    taus = {m: [] for m in methods}
    identical = {m: True for m in methods}
    for r in range(args.repeats):
        for i, (x, ref) in enumerate(zip(inputs, references)):
            order = methods[(r + i) % len(methods) :] + methods[: (r + i) % len(methods)]  # rotate: no method always first
            for method in order:
                tokens, seconds, tau, out = run_method(method, model, x, ref, args.max_new_tokens)
                results[method][r][0] += tokens
                results[method][r][1] += seconds
                identical[method] &= torch.equal(out, ref)
                if r == 0 and tau is not None:
                    taus[method].append(tau)
        print(f"repeat {r + 1}/{args.repeats} done", flush=True)

    tps = {m: [tokens / seconds for tokens, seconds in results[m]] for m in methods}
    base = statistics.median(tps["plain"]) if "plain" in tps else None
    ceiling = statistics.median(tps["oracle"]) if "oracle" in tps else None
    print(f"\n{args.dataset}: {len(prompts)} prompts, {args.max_new_tokens} new tokens, {args.repeats} repeats, greedy, "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    print(f"{'method':<14}{'tok/s':>8}{'spread':>14}{'tau':>7}{'speed-up':>10}{'of oracle':>11}  identical")
    rows = {}
    for m in methods:
        med = statistics.median(tps[m])
        tau = statistics.mean(taus[m]) if taus[m] else float("nan")
        speedup = med / base if base else float("nan")
        of_oracle = med / ceiling if ceiling else float("nan")
        rows[m] = {"tokens_per_s": med, "min": min(tps[m]), "max": max(tps[m]), "tau": tau, "speedup": speedup,
                   "fraction_of_oracle": of_oracle, "identical_to_plain": identical[m]}  # fmt: skip
        print(f"{m:<14}{med:>8.1f}{f'{min(tps[m]):.1f}-{max(tps[m]):.1f}':>14}{tau:>7.2f}{speedup:>9.2f}x"
              f"{of_oracle:>11.2f}  {'yes' if identical[m] else 'NO'}")  # fmt: skip
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{args.dataset.replace('/', '_')}.json").write_text(json.dumps({"args": vars(args), "methods": rows}, indent=2))


if __name__ == "__main__":
    main()
