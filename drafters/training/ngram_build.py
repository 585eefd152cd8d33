"""Build the n-gram store (drafters.ngram_store) from the verifier's training answers, held-out answers excluded.

    python -m drafters.training.ngram_build --answers ~/.cache/hybrid/drafter-gpu/generated-b512-syn8000 \\
        --out drafters/checkpoints/smollm2-135m-ngram

`--answers` is a folder of gen-*.json answers (the generate stage of `python -m drafters.training.train`); the
answers it holds out (drafters.training.distill.held_out_indices) are left out of the store, so that the
held-out estimate (experiments.heldout) scores the store on answers it never saw.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from drafters.block_diffusion import verifier_fingerprint
from drafters.ngram_store import NgramStore
from drafters.training.distill import HELD_OUT_EVERY, held_out_indices, load_sequences
from verifiers.embedded import load_verifier


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m drafters.training.ngram_build",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--answers",
        type=Path,
        required=True,
        help="a folder of gen-*.json answers (the generate stage of drafters.training.train)",
    )
    parser.add_argument("--out", type=Path, required=True, help="where the store goes")
    parser.add_argument("--max-n", type=int, default=4, help="longest n-gram kept (n tokens must pack into 64 bits)")
    parser.add_argument("--min-count", type=int, default=2, help="drop n-grams seen fewer times")
    args = parser.parse_args(argv)
    if not sorted(args.answers.glob("gen-*.json")):
        parser.error(
            f"--answers {args.answers}: no gen-*.json files there; generate them with `python -m drafters.training.train`"
        )

    verifier, tokenizer = load_verifier()
    answers = load_sequences(args.answers, tokenizer, doc_tokens=0)
    held = held_out_indices([s["source"] for s in answers])  # the answers training and experiments.heldout hold out
    train = [(s["ids"], s["prompt_len"]) for i, s in enumerate(answers) if i not in held]
    store = NgramStore.build(
        train,
        verifier.config.vocab_size,
        args.max_n,
        args.min_count,
        verifier_fingerprint(verifier),
        {
            "command": " ".join(
                ["python -m drafters.training.ngram_build", *(argv if argv is not None else sys.argv[1:])]
            ),
            "answers": args.answers.name,
            "sequences": len(train),
            "held_out_every": HELD_OUT_EVERY,
        },
    )
    store.save_pretrained(args.out)
    print(
        f"{len(train)} answers ({store.info['answer_tokens']} tokens) -> {sum(store.info['entries'])} n-grams "
        f"{store.info['entries']} in {args.out}"
    )


if __name__ == "__main__":
    main()
