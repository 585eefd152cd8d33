"""A one-shot user's speed-up against a warmed process's: each prompt decoded in a fresh process.

    python -m experiments.first_call --dataset mt-bench --num-prompts 4 --max-new-tokens 256 --out runs/first-call

The default scheduler learns across calls within a process (its calibration, its measured costs), so a script
that decodes once gets what a fresh scheduler does. For each prompt a new process loads the verifier, warms
PyTorch with one 2-token `generate` (the same for both methods), then times plain `model.generate` and
`hybrid.generate` with `--method` (default: the default drafter): the **first call**. It then runs it on `--warm-prompts` of
our dev prompts (untimed, none of them the prompt measured) and times both methods again on the same prompt:
the **warmed call**. Every output is checked against plain `generate`'s. Records go to OUT/first_call.jsonl as
each process finishes; rerunning the same command resumes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from experiments.bench import prompt_sha, run_method
from experiments.datasets import load_prompts
from experiments.methods import METHODS, check_fits_model, method_drafter
from experiments.models import MODEL_HELP, load_model
from experiments.runs import append_record
from verifiers.prompts import encode_prompt

RECORDS_FILE = "first_call.jsonl"


def greedy(input_ids, max_new_tokens: int) -> dict:
    return {"max_new_tokens": max_new_tokens, "attention_mask": torch.ones_like(input_ids), "do_sample": False}


def measure_one(model_name: str, method: str, text: str, max_new_tokens: int, warm_texts: list[str]) -> dict:
    """In this (fresh) process: plain and `method` on `text`, first call and after warming on `warm_texts`."""
    model, tokenizer = load_model(model_name)
    input_ids = encode_prompt(tokenizer, text)
    with torch.inference_mode():
        model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=2, do_sample=False)
        record = {}
        for phase in ("first", "warmed"):
            if phase == "warmed":
                for warm in warm_texts:
                    warm_ids = encode_prompt(tokenizer, warm)
                    run_method(method, model, warm_ids, None, greedy(warm_ids, max_new_tokens))
            plain, plain_s, _ = run_method("plain", model, input_ids, None, greedy(input_ids, max_new_tokens))
            out, hybrid_s, stats = run_method(method, model, input_ids, plain, greedy(input_ids, max_new_tokens))
            record[phase] = {
                "new_tokens": plain.shape[1] - input_ids.shape[1],
                "plain_s": plain_s,
                "hybrid_s": hybrid_s,
                "tau": stats.tau,
                "identical": bool(torch.equal(out, plain)),
            }
    return record


def speedup(records: list[dict], phase: str) -> float:
    """Plain's seconds over hybrid's, summed over the prompts (tokens are the same: outputs are identical)."""
    return sum(r[phase]["plain_s"] for r in records) / sum(r[phase]["hybrid_s"] for r in records)


def print_table(args, records: list[dict]) -> dict:
    print(f"\n{args.dataset}: {len(records)} prompts, {args.max_new_tokens} new tokens, one fresh process each")
    print(f"{'call':<10}{'plain tok/s':>13}{'hybrid tok/s':>14}{'tau':>7}{'speed-up':>10}  identical")
    summary = {}
    for phase in ("first", "warmed"):
        rows = [r[phase] for r in records]
        tokens = sum(r["new_tokens"] for r in rows)
        row = {
            "plain_tokens_per_s": tokens / sum(r["plain_s"] for r in rows),
            "hybrid_tokens_per_s": tokens / sum(r["hybrid_s"] for r in rows),
            "tau": statistics.mean(r["tau"] for r in rows),
            "speedup": speedup(records, phase),
            "identical": all(r["identical"] for r in rows),
        }
        summary[phase] = row
        print(
            f"{phase:<10}{row['plain_tokens_per_s']:>13.1f}{row['hybrid_tokens_per_s']:>14.1f}{row['tau']:>7.2f}"
            f"{row['speedup']:>9.2f}x  {'yes' if row['identical'] else 'NO'}"
        )
    summary["first_over_warmed"] = summary["first"]["speedup"] / summary["warmed"]["speedup"]
    print(f"first-call speed-up / warmed speed-up: {summary['first_over_warmed']:.2f}")
    return summary


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m experiments.first_call",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--dataset", default="dev", help="dev, dev-chat, mt-bench, humaneval, heldout or a .jsonl file of prompts"
    )
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--warm-prompts", type=int, default=4, help="dev prompts the warmed call runs after")
    parser.add_argument("--model", default="default", help=MODEL_HELP)
    parser.add_argument("--method", default="hybrid-default", help="the hybrid method of experiments.bench to time")
    parser.add_argument("--out", default="runs/first-call", help="folder for first_call.jsonl and summary.json")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)  # the prompt a child measures
    args = parser.parse_args(argv)
    for name in ("num_prompts", "max_new_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if not args.method.startswith("hybrid-") or args.method not in METHODS:
        parser.error(f"--method {args.method!r}: choose a hybrid method of {', '.join(METHODS)}")
    try:
        check_fits_model(args.model, [args.method], method_drafter)
    except ValueError as error:
        parser.error(str(error))
    if args.warm_prompts < 0:
        parser.error("--warm-prompts must be >= 0")
    return parser, args


def warm_texts(args, text: str) -> list[str]:
    return [t for t in load_prompts("dev") if t != text][: args.warm_prompts]


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    parser, args = parse_args(argv)
    try:
        prompts = load_prompts(args.dataset)[: args.num_prompts]
    except (ValueError, RuntimeError) as e:
        parser.error(str(e))
    if args.worker is not None:  # a child: one prompt, one JSON line on stdout
        text = prompts[args.worker]
        print(json.dumps(measure_one(args.model, args.method, text, args.max_new_tokens, warm_texts(args, text))))
        return {}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / RECORDS_FILE
    key = (args.model, args.method, args.dataset, args.max_new_tokens, args.warm_prompts)
    done = {}
    if path.exists():
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if tuple(rec["key"]) == key:
                done[rec["prompt_sha"]] = rec
    records = []
    for i, text in enumerate(tqdm(prompts, desc="first-call", unit="process", dynamic_ncols=True)):
        sha = prompt_sha(text)
        if sha not in done:
            child = [sys.executable, "-m", "experiments.first_call", *argv, "--worker", str(i)]
            result = subprocess.run(child, capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"prompt {i}'s process failed:\n{result.stderr[-2000:]}")
            done[sha] = {"key": list(key), "prompt_sha": sha, **json.loads(result.stdout.splitlines()[-1])}
            append_record(path, done[sha])
        records.append(done[sha])
    summary = {"command": ["python", "-m", "experiments.first_call", *argv], **print_table(args, records)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


if __name__ == "__main__":
    main()
