"""Prompt lookup alone against lookup with an online store of the verifier's earlier answers, on related requests.

    python -m experiments.online_store --model default --dataset dev --max-new-tokens 256

The workload is what a server sees when requests repeat: for each prompt, the question (turn 1), then a follow-up
in the same conversation, whose prompt holds the first answer (turn 2); then every question again, as another user
would ask it (repeat). Both methods decode the same requests in the same order, each with its own drafter kept across
them (the online store starts empty), and the same lookup settings (the embedded verifier's n-gram store in both
where the model is the embedded one). Every output is checked against plain `model.generate`'s (greedy); the table
prints τ and tokens/s per method, per kind of request and overall. `--model tiny` runs it in seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import hybrid
from drafters import PromptLookupDrafter
from drafters.online_store import OnlineStore
from experiments.datasets import load_prompts
from experiments.models import MODEL_HELP, check_model_name, load_model
from hybrid.stats import timed
from schedulers.registry import NAMES_HELP, check_scheduler_name, make_scheduler

FOLLOW_UPS = (
    "Now say the same thing more briefly.",
    "Repeat your answer, then add one more example.",
    "Summarise your answer in a few lines.",
)
KINDS = ("turn 1", "turn 2", "repeat")


def workload(questions: list[str], answer):
    """(kind, messages) of every request in order, 3 per question; `answer(messages)` is the verifier's reply to a
    conversation already asked (the follow-up holds it, as a chat client sends it back)."""
    for i, question in enumerate(questions):
        first = [{"role": "user", "content": question}]
        yield "turn 1", first
        follow_up = {"role": "user", "content": FOLLOW_UPS[i % len(FOLLOW_UPS)]}
        yield "turn 2", first + [{"role": "assistant", "content": answer(first)}, follow_up]
    for question in questions:
        yield "repeat", [{"role": "user", "content": question}]


def encode(tokenizer, messages: list[dict]) -> torch.Tensor:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
        "input_ids"
    ]


def lookup_drafter(model, online: bool) -> PromptLookupDrafter:
    """`hybrid.drafter_for`'s lookup (its settings, the shipped n-gram store for the embedded verifier), with or without
    an online store."""
    lookup = hybrid.drafter_for(model)
    lookup = lookup.sources[0] if hasattr(lookup, "sources") else lookup
    return PromptLookupDrafter(
        max_ngram=lookup.max_ngram,
        min_ngram=lookup.min_ngram,
        max_draft_len=lookup.max_draft_len,
        ngram_store=lookup.ngram_store,
        store_min_n=lookup.store_min_n,
        prefer_store=lookup.prefer_store,
        verifier=model,
        online_store=OnlineStore(verifier=model) if online else None,
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m experiments.online_store", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help=MODEL_HELP)
    parser.add_argument("--dataset", default="dev", help="where the questions come from (dev: ours, for tuning)")
    parser.add_argument("--num-prompts", type=int, default=None, help="the first N questions (default: all)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument(
        "--scheduler", default=None, help=f"{NAMES_HELP} (default: hybrid's default, one per method, kept across calls)"
    )
    parser.add_argument("--out", default=None, help="write the summary as JSON here")
    args = parser.parse_args(argv)
    check_model_name(args.model)
    if args.scheduler is not None:
        try:
            check_scheduler_name(args.scheduler)
        except ValueError as error:
            parser.error(str(error))
    if args.max_new_tokens < 1 or (args.num_prompts is not None and args.num_prompts < 1):
        parser.error("--max-new-tokens and --num-prompts must be >= 1")
    model, tokenizer = load_model(args.model)
    if not getattr(tokenizer, "chat_template", None):
        parser.error(f"--model {args.model}: its tokenizer has no chat template, and the workload is conversations")
    questions = load_prompts(args.dataset)[: args.num_prompts]
    settings = {"max_new_tokens": args.max_new_tokens, "do_sample": False}
    drafters = {"lookup": lookup_drafter(model, online=False), "lookup + online store": lookup_drafter(model, True)}
    schedulers = {
        method: None if args.scheduler is None else make_scheduler(args.scheduler, drafter.node_budget)
        for method, drafter in drafters.items()
    }
    replies = {}

    def answer(messages: list[dict]) -> str:
        return replies[json.dumps(messages)]

    stats = {(method, kind): [] for method in [*drafters, "generate"] for kind in KINDS}
    mismatches = 0
    count = len(KINDS) * len(questions)
    for i, (kind, messages) in enumerate(workload(questions, answer)):
        input_ids = encode(tokenizer, messages)
        settings["attention_mask"] = torch.ones_like(input_ids)
        # Both timed end to end around their call (hybrid.stats.timed), so tokens/s compare like with like.
        reference, seconds = timed(lambda ids=input_ids: model.generate(ids, **settings), model.device)
        new = reference.shape[1] - input_ids.shape[1]
        stats["generate", kind].append((new, new, seconds))  # one forward per token
        replies[json.dumps(messages)] = tokenizer.decode(reference[0, input_ids.shape[1] :], skip_special_tokens=True)
        for method, drafter in drafters.items():
            (out, run), seconds = timed(
                lambda ids=input_ids, d=drafter, s=schedulers[method]: hybrid.generate(
                    model, ids, drafter=d, scheduler=s, return_stats=True, **settings
                ),
                model.device,
            )
            if not torch.equal(out, reference):
                mismatches += 1
                print(f"request {i} ({kind}), {method}: output differs from model.generate", file=sys.stderr)
            stats[method, kind].append((run.new_tokens, run.verifier_forwards, seconds))
        print(f"request {i + 1}/{count} ({kind}) done", file=sys.stderr)
    summary = table(stats, drafters)
    summary.update(
        command=["python", "-m", "experiments.online_store", *(sys.argv[1:] if argv is None else argv)],
        requests=count,
        identical_to_generate=mismatches == 0,
        store=drafters["lookup + online store"].online_store.summary(),
    )
    print(f"every output identical to model.generate: {'yes' if mismatches == 0 else f'NO ({mismatches} differ)'}")
    print(summary["store"])
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def table(stats: dict, drafters: dict) -> dict:
    """Print τ and tokens/s of every method per kind of request and overall, from (new tokens, verifier forwards,
    seconds) per request; return them."""
    rows = {}
    print(f"{'method':<24}{'request':<10}{'tau':>7}{'tok/s':>9}")
    for method in [*drafters, "generate"]:
        for kind in (*KINDS, "all"):
            runs = [r for k in KINDS for r in stats[method, k]] if kind == "all" else stats[method, kind]
            tokens, forwards, seconds = (sum(column) for column in zip(*runs))
            rows[f"{method} / {kind}"] = {"tau": tokens / forwards, "tokens_per_second": tokens / seconds}
            print(f"{method:<24}{kind:<10}{tokens / forwards:>7.2f}{tokens / seconds:>9.1f}")
    return {"rows": rows}


if __name__ == "__main__":
    main()
