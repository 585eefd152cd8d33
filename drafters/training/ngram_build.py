"""Build the n-gram store (drafters.ngram_store) from the verifier's training answers, held-out answers excluded.

    python -m drafters.training.ngram_build --answers ~/.cache/hybrid/drafter-gpu/generated-b512-syn8000 \\
        --out drafters/checkpoints/smollm2-135m-ngram
    python -m drafters.training.ngram_build --verifier DIR --prompts FILE.jsonl   # any causal LM

`--answers` is a folder of gen-*.json answers (the generate stage of `python -m drafters.training.train`). Without it
the answers are those of the generate stage `python -m drafters.training.train` runs with the same verifier and
generation options (--verifier, --work-dir, --prompts, --gen-shards, ...): read from its folder, generated there first
if it holds none yet. The store records the verifier's fingerprint, and a drafter given it for another verifier refuses
it. The answers it holds out (drafters.training.distill.held_out_indices) are left out of the store, so that the
held-out estimate (experiments.heldout) scores the store on answers it never saw.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from drafters.block_diffusion import verifier_fingerprint
from drafters.ngram_store import NgramStore
from drafters.training.distill import HELD_OUT_EVERY, held_out_indices, load_sequences
from drafters.training.train import (
    add_generation_arguments,
    check_generation_arguments,
    generate_stage,
    load_training_verifier,
)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m drafters.training.ngram_build",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--answers",
        type=Path,
        default=None,
        help="a folder of gen-*.json answers (default: the generate stage's folder for --verifier, filled if empty)",
    )
    p.add_argument("--out", type=Path, default=None, help="where the store goes (default: WORK/ngram-store)")
    p.add_argument("--max-n", type=int, default=4, help="longest n-gram kept (n tokens must pack into 64 bits)")
    p.add_argument("--min-count", type=int, default=2, help="drop n-grams seen fewer times")
    add_generation_arguments(p)
    return p


def main(argv=None) -> None:
    p = parser()
    args = p.parse_args(argv)
    check_generation_arguments(p, args)
    if args.answers is not None and not sorted(args.answers.glob("gen-*.json")):
        p.error(
            f"--answers {args.answers}: no gen-*.json files there; generate them with `python -m drafters.training.train`"
        )
    verifier, tokenizer, work = load_training_verifier(args)
    answers_dir, shards = (
        (args.answers, None) if args.answers is not None else generate_stage(args, verifier, tokenizer, work)
    )
    out = args.out or work / "ngram-store"
    answers = load_sequences(answers_dir, tokenizer, doc_tokens=0, max_shards=shards)
    held = held_out_indices([s["source"] for s in answers])  # the answers training and experiments.heldout hold out
    train = [(s["ids"], s["prompt_len"]) for i, s in enumerate(answers) if i not in held]
    store = NgramStore.build(
        train,
        verifier.get_input_embeddings().weight.shape[0],
        args.max_n,
        args.min_count,
        verifier_fingerprint(verifier),
        {
            "command": " ".join(
                ["python -m drafters.training.ngram_build", *(argv if argv is not None else sys.argv[1:])]
            ),
            "answers": answers_dir.name,
            "sequences": len(train),
            "held_out_every": HELD_OUT_EVERY,
        },
    )
    store.save_pretrained(out)
    print(
        f"{len(train)} answers ({store.info['answer_tokens']} tokens) -> {sum(store.info['entries'])} n-grams "
        f"{store.info['entries']} in {out}"
    )


if __name__ == "__main__":
    main()
