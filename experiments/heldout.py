"""Held-out acceptance of trained drafters on answers they were not trained on, offline (no decoding).

    python -m experiments.heldout --block drafters/checkpoints/smollm2-135m-block --passes 1,2,3 --reveal

`--answers` is the verifier's held-out answers: by default the shipped ones (drafters/checkpoints/
smollm2-135m-heldout, its answers to the templated prompts the GPU recipe holds out of training and of the n-gram
store, rebuilt by `python -m drafters.training.answer_sets heldout`), or a folder the generate stage of
`drafters.training.train` wrote, whose held-out answers are the ones training holds out of it (every 20th
generated answer, `drafters.training.distill.split`); `--exclude-prompts-of` drops those whose prompt also appears
in another answers folder (say, the data a fine-tune saw). Their verifier features are computed once and cached
under `--work-dir`. For `--anchors-per-answer` anchors per answer (8 by default) it prints the estimate training
logs (`drafters.training.estimate`): tau of one greedy block per anchor and the share of anchors whose first i
drafts are all accepted, for prompt lookup, every `--block` checkpoint (with 1, 2, ... denoising passes), every `--dflash` folder (z-lab's
format, e.g. one `--arch dflash` trained) and every `--ar` baseline;
with `--ngram-store`, that store alone and continuing prompt lookup (`drafters.training.ngram_build`; it must be built
from the same folder, so that its held-out answers are these).
`--fill` also scores each block checkpoint in the default's chain: prompt lookup (continued by the store with
`--ngram-store`) proposes the block's first positions, the model fills the rest reading them as known; with
`--branch`, also with the model's own first k tokens verified beside that chain (`drafters.ChainDrafter`'s branch);
with `--refill-below`, also with the model redrafting the lookup's draft from its first token of lower confidence
(the store's share of it), as `drafters.ChainDrafter`'s refill_below does, so the block model fills where the store
is unsure.
`--reveal` also prints each block checkpoint's teacher-forced accuracy by position with the true tokens of the
first 0, 1, 2, 3 positions given, which shows whether the model reads known block tokens.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
from pathlib import Path

import numpy as np
import torch

from drafters import dflash
from drafters.ar_baseline import load_ar_model
from drafters.block_diffusion import MASKED_INPUTS, frozen_verifier_parts, load_model
from drafters.ngram_store import NgramStore
from drafters.prompt_lookup import check_prefer_store
from drafters.training.answer_sets import ANSWERS_NAME, load_answers
from drafters.training.batches import VocabMap
from drafters.training.distill import FeatureStore, build_features, held_out_indices, load_sequences
from drafters.training.estimate import (
    ScoringSettings,
    anchor_block_batches,
    estimate_tau,
    held_out_anchors,
    lookup_fill_tau,
    lookup_tau,
)
from drafters.training.models import block_forward
from drafters.training.train import DEFAULT_WORK_DIR
from experiments.arguments import parse_numbers
from verifiers.embedded import load_verifier

ANCHORS_PER_ANSWER = 8
HELD_OUT_ANSWERS = Path(__file__).resolve().parent.parent / "drafters" / "checkpoints" / "smollm2-135m-heldout"


def prompts_of(answers: Path) -> set[tuple[int, ...]]:
    return {
        tuple(r["ids"][: r["prompt_len"]])
        for f in sorted(answers.glob("gen-*.json"))
        for r in json.loads(f.read_text())
    }


def held_out_store(verifier, tokenizer, answers: Path, exclude: Path | None, work_dir: Path, layers) -> FeatureStore:
    """Features of the held-out answers of `answers` (minus prompts seen in `exclude`), cached: all of a folder
    `answer_sets` wrote, or those training holds out of a generate stage's folder."""
    if (answers / ANSWERS_NAME).is_file():
        held = load_answers(answers)
    else:
        sequences = load_sequences(answers, tokenizer, doc_tokens=0)
        held = [sequences[i] for i in sorted(held_out_indices([s["source"] for s in sequences]))]
    if exclude is not None:
        seen = prompts_of(exclude)
        held = [s for s in held if tuple(s["ids"][: s["prompt_len"]]) not in seen]
    key = hashlib.sha256(
        json.dumps([str(answers.resolve()), str(exclude and exclude.resolve()), list(layers)]).encode()
    )
    root = work_dir / f"heldout-{answers.name}-{key.hexdigest()[:8]}"
    print(f"{len(held)} held-out answers ({sum(len(s['ids']) for s in held)} tokens); features in {root}", flush=True)
    return build_features(verifier, held, root, tuple(layers))


def reveal_accuracy(model, embed, head, store, anchors, vmap, revealed: int) -> np.ndarray:
    """Teacher-forced accuracy per block position when the true tokens of positions 1..`revealed` are given."""
    B, vocab = model.config.block_size, model.draft_vocab
    hits, valid = np.zeros(B - 1), np.zeros(B - 1)
    with torch.no_grad():
        for _, batch in anchor_block_batches(store, anchors, B, vmap):
            batch["known"][..., 1 : 1 + revealed] = True
            predicted = vocab[block_forward(model, embed, head, batch).argmax(-1)]
            hits += ((predicted == batch["full_targets"]) & batch["valid"]).sum((0, 1)).numpy()
            valid += batch["valid"].sum((0, 1)).numpy()
    return hits / np.maximum(valid, 1)


def int_list(parser, option: str, text: str, least: int = 1) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        parser.error(f"{option} {text!r}: give comma-separated integers, e.g. 1,2,3")
    if min(values) < least:
        parser.error(f"{option} {text!r}: every value must be >= {least}")
    return values


def row(name: str, tau: float, by_position) -> str:
    return f"| {name} | {tau:.3f} | {' / '.join(f'{x:.3f}' for x in by_position)} |"


def match(max_ngram: int) -> str:
    return "" if max_ngram == 3 else f" (matches up to {max_ngram} tokens)"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.heldout", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--answers",
        type=Path,
        default=HELD_OUT_ANSWERS,
        help="held-out answers: a folder `drafters.training.answer_sets heldout` wrote (the default: the shipped "
        "one), or a generate stage's folder of gen-*.json answers (drafters.training.train)",
    )
    parser.add_argument(
        "--exclude-prompts-of", type=Path, default=None, help="drop held-out answers prompted in this folder"
    )
    parser.add_argument(
        "--block", type=Path, action="append", default=[], help="a block drafter checkpoint (repeatable)"
    )
    parser.add_argument("--dflash", type=Path, action="append", default=[], help="a DFlash drafter folder (repeatable)")
    parser.add_argument("--ar", type=Path, action="append", default=[], help="an AR baseline checkpoint (repeatable)")
    parser.add_argument("--passes", default="1", help="denoising passes to score the block drafters with, e.g. 1,2,3")
    parser.add_argument("--lookup", default="7,15", help="prompt lookup's draft lengths")
    parser.add_argument(
        "--ngram-store", type=Path, default=None, help="also an NgramStore alone and continuing prompt lookup"
    )
    parser.add_argument(
        "--max-ngrams", default="3", help="longest context matches prompt lookup looks for, e.g. 3,8,32"
    )
    parser.add_argument(
        "--prefer-store",
        type=float,
        default=None,
        help="also lookup + store with the store's continuation preferred over a one-token match at this share",
    )
    parser.add_argument(
        "--masked-input",
        choices=MASKED_INPUTS,
        default=None,
        help="score every --block checkpoint with its masked positions reading this instead of what it was trained "
        "with (BlockDiffusionConfig.masked_input)",
    )
    parser.add_argument(
        "--fill",
        action="store_true",
        help="also each block checkpoint filling what prompt lookup (with --ngram-store, continued by it) leaves of "
        "its block, reading the lookup's tokens as known (the default drafter's chain)",
    )
    parser.add_argument(
        "--branch",
        default="0",
        help="with --fill, also the chain with the block model's own first k tokens verified beside it, for each k "
        "of this list, e.g. 0,1,2 (drafters.ChainDrafter's branch; every node of the tree verified)",
    )
    parser.add_argument(
        "--refill-below",
        default="0",
        help="with --fill, also the chain with the lookup's draft ending before its first token of confidence below "
        "each share of this list, e.g. 0,0.3, the block model filling from there (drafters.ChainDrafter's refill_below)",
    )
    parser.add_argument(
        "--reveal", action="store_true", help="also the teacher-forced accuracy with the first 0-3 true tokens given"
    )
    parser.add_argument(
        "--anchors-per-answer", type=int, default=ANCHORS_PER_ANSWER, help="anchors drawn in each held-out answer"
    )
    parser.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR)
    args = parser.parse_args(argv)
    if args.anchors_per_answer < 1:
        parser.error(f"--anchors-per-answer {args.anchors_per_answer}: give at least 1")
    for folder in [args.answers] + ([args.exclude_prompts_of] if args.exclude_prompts_of else []):
        if not any(folder.glob("gen-*.json")) and not (folder / ANSWERS_NAME).is_file():
            parser.error(
                f"{folder} holds no answers: pass a folder `python -m drafters.training.answer_sets heldout` wrote "
                "(drafters/checkpoints/smollm2-135m-heldout) or the generate stage's folder of "
                "`drafters.training.train`"
            )
    if args.ar and not args.block:
        parser.error(
            "--ar needs a --block checkpoint: the baseline drafts over that drafter's vocabulary, as in training"
        )
    passes, lookups = int_list(parser, "--passes", args.passes), int_list(parser, "--lookup", args.lookup)
    branches = int_list(parser, "--branch", args.branch, least=0)
    try:
        cuts = parse_numbers(args.refill_below, "--refill-below", float)
    except ValueError:
        cuts = []
    if not cuts or not all(0.0 <= c <= 1.0 for c in cuts):
        parser.error(f"--refill-below {args.refill_below!r}: give shares in [0, 1], e.g. 0,0.3")
    max_ngrams = int_list(parser, "--max-ngrams", args.max_ngrams)
    try:
        check_prefer_store(args.prefer_store, args.ngram_store)
    except ValueError:
        parser.error("--prefer-store needs --ngram-store and a share in [0, 1]")
    torch.set_grad_enabled(False)
    verifier, tokenizer = load_verifier("cpu")
    ngrams = args.ngram_store and NgramStore.from_pretrained(args.ngram_store)
    blocks = [(path, load_model(path).float()) for path in args.block]
    for _, model in blocks:
        model.config.masked_input = args.masked_input or model.config.masked_input
    dflashes = [(path, dflash.load_model(path, torch.float32)) for path in args.dflash]
    # Every drafter must read the same verifier states (hidden_states indices).
    read = {tuple(m.config.target_layers) for _, m in blocks} | {m.hidden_layers for _, m in dflashes}
    if len(read) > 1:
        parser.error(f"the drafters read different verifier layers ({sorted(read)}): score them in separate runs")
    layers = next(iter(read), (2, 9, 16, 23, 30))
    store = held_out_store(verifier, tokenizer, args.answers, args.exclude_prompts_of, args.work_dir, layers)
    anchors = held_out_anchors(store, list(range(len(store))), per_seq=args.anchors_per_answer, seed=0)
    print(
        f"{sum(len(a) for _, a in anchors)} anchors\n\n| drafter | held-out tau | accepted at positions 1 / 2 / ... |\n|---|---:|---|"
    )
    for n in lookups:
        for m in max_ngrams:
            print(f"| prompt lookup{match(m)}, {n} tokens | {lookup_tau(store, anchors, n + 1, max_ngram=m):.3f} | |")
    if ngrams is not None:
        for n in lookups:
            print(
                f"| n-gram store alone, {n} tokens | {lookup_tau(store, anchors, n + 1, ngrams, min_ngram=0):.3f} | |"
            )
            for m in max_ngrams:
                tau = lookup_tau(store, anchors, n + 1, ngrams, max_ngram=m)
                print(f"| prompt lookup{match(m)} + n-gram store, {n} tokens | {tau:.3f} | |")
                if args.prefer_store is not None:
                    tau = lookup_tau(store, anchors, n + 1, ngrams, max_ngram=m, prefer_store=args.prefer_store)
                    print(
                        f"| prompt lookup{match(m)} + n-gram store, preferred over a 1-token match at share "
                        f">= {args.prefer_store}, {n} tokens | {tau:.3f} | |"
                    )
    vocab_size = verifier.get_input_embeddings().weight.shape[0]
    for path, model in blocks:
        embed, head = frozen_verifier_parts(verifier, model.draft_vocab)
        vmap = VocabMap(model.draft_vocab, vocab_size)
        scoring = ScoringSettings(model, embed, head, model.draft_vocab, vmap, model.config.block_size, store, anchors)
        for p in passes:
            tau, by_position = estimate_tau(scoring, passes=p)
            print(row(f"{path}, {p} pass{'es' if p > 1 else ''}", tau, by_position), flush=True)
        if args.fill:  # the default's chain: the lookup's tokens first, the block model fills the rest
            for m, p, k, cut in itertools.product(max_ngrams, passes, branches, cuts):
                tau, by_position, share = lookup_fill_tau(
                    scoring, ngrams, m, args.prefer_store, p, branch=k, refill_below=cut
                )
                lookup = f"prompt lookup{match(m)}" + (" + n-gram store" if ngrams is not None else "")
                if args.prefer_store is not None and ngrams is not None:
                    lookup += f" (preferred at share >= {args.prefer_store})"
                if cut:
                    lookup += f", refilled from a token of confidence < {cut}"
                name = f"{lookup}, then {path} fills the block, {p} pass{'es' if p > 1 else ''}"
                if k:
                    name += f", its own first {k} token{'s' if k > 1 else ''} beside"
                print(row(name, tau, by_position) + f" block model drafted at {share:.0%} of anchors", flush=True)
        if args.reveal:
            for revealed in range(min(4, model.config.block_size - 1)):
                accuracy = reveal_accuracy(model, embed, head, store, anchors, vmap, revealed)
                print(
                    f"{path}: teacher-forced accuracy by position, true tokens given at 1..{revealed}: "
                    + " / ".join(f"{x:.3f}" for x in accuracy[revealed:])
                    + f" (positions {revealed + 1}..)"
                )
    if dflashes:  # the whole vocabulary: the verifier's own embedding and head, shared by every folder
        vocab = torch.arange(vocab_size)
        embed, head = frozen_verifier_parts(verifier, vocab)
    for path, model in dflashes:
        scoring = ScoringSettings(
            model, embed, head, vocab, VocabMap(vocab, vocab_size), model.block_size, store, anchors
        )
        tau, by_position = estimate_tau(scoring)
        print(row(f"{path} (DFlash)", tau, by_position), flush=True)
    vocab = blocks[0][1].draft_vocab if blocks else None
    for path in args.ar:
        model = load_ar_model(path, verifier).float()
        embed, head = frozen_verifier_parts(verifier, vocab)
        block_size = blocks[0][1].config.block_size
        scoring = ScoringSettings(
            model, embed, head, vocab, VocabMap(vocab, vocab_size), block_size, store, anchors, arch="ar"
        )
        tau, by_position = estimate_tau(scoring)
        print(row(f"{path} (AR baseline)", tau, by_position), flush=True)


if __name__ == "__main__":
    main()
