"""Prompt sets that outlast a training run: held-out verifier answers as compact token ids, and unanswered prompts.

    python -m drafters.training.answer_sets heldout --out drafters/checkpoints/smollm2-135m-heldout
    python -m drafters.training.answer_sets prompts --prompts experiments/prompts/dev-chat.jsonl \
        --out drafters/checkpoints/smollm2-135m-dev-chat
    python -m drafters.training.answer_sets finetune --out ~/.cache/hybrid/drafter/finetune-prompts.jsonl

The GPU recipe (experiments/gpu_train.sh) answers the first RECIPE_ANSWERED of its prompts, the templated ones
(`corpus.chat_prompts`) interleaved with RECIPE_SYNTHETIC user turns sampled from the verifier, and holds every
HELD_OUT_EVERY-th answer out of training and of the n-gram store. The templated prompts among the held-out ones
are the same on every machine (the sampled turns are not: they depend on the device's random numbers), so:

- `heldout` answers those prompts greedily with the verifier and writes their token ids (answers.safetensors,
  uint16, a few hundred kB) and how they were made (answers.json): the answers every drafter variant is scored on
  (`experiments.heldout --answers FOLDER`), without the features cache of a past run;
- `prompts` answers the prompts of any .jsonl of `{"prompt": ...}` lines greedily and writes them the same way:
  `--prompts experiments/prompts/dev-chat.jsonl` gives the answers to our everyday chat questions, novel text where
  a lookup has little to copy, on which a drafter may be tuned (the held-out prompt set stays for the benches);
- `finetune` writes the templated prompts the recipe never answered (neither trained on nor held out), with the
  code tasks it trained on, as a prompt file for `drafters.training.train --prompts`: new data for a fine-tune of
  the shipped drafter (`fine_tune_prompts`);
- `recipe` packs the answers a GPU run of the recipe generated (its --work-dir's `RECIPE_FOLDER`, 1.4 M answer
  tokens that take a 2-core CPU hours to regenerate) and the user turns it sampled into a folder of a few MB, and
  `restore` writes them back into a --work-dir as the generate stage left them, so `drafters.training.train` with
  the recipe's data flags trains on them on any machine, starting at the features stage:

    python -m drafters.training.answer_sets recipe --work-dir ~/.cache/hybrid/drafter-gpu --out FOLDER
    python -m drafters.training.answer_sets restore --answers FOLDER --work-dir ~/.cache/hybrid/drafter-gpu
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from drafters.training.corpus import chat_prompts, prompt_file
from drafters.training.distill import (
    HELD_OUT_EVERY,
    generate_shards,
    interleave,
    shard_path,
    synthetic_answers_name,
    synthetic_turns_name,
)

RECIPE_BATCH = 512  # GEN_BATCH of experiments/gpu_train.sh
RECIPE_ANSWERED = 13 * RECIPE_BATCH  # its GEN_SHARDS x GEN_BATCH
RECIPE_SYNTHETIC = 8000  # its SYNTHETIC
# What its generate stage writes under --work-dir: the answers' folder and the sampled turns' file (seed 0).
RECIPE_FOLDER = synthetic_answers_name(RECIPE_BATCH, RECIPE_SYNTHETIC)
RECIPE_TURNS = synthetic_turns_name(RECIPE_SYNTHETIC, seed=0)
ANSWERS_NAME, INFO_NAME, TURNS_NAME = "answers.safetensors", "answers.json", "synthetic-prompts.json"


def recipe_split(
    answered: int = RECIPE_ANSWERED, synthetic: int = RECIPE_SYNTHETIC, seed: int = 0
) -> tuple[list[str], list[str], list[str]]:
    """(held-out, trained on, never answered) templated prompts of the GPU recipe. `interleave` places each prompt by
    its index and the two lists' lengths only, so the sampled turns' text is not needed to know where each went."""
    templated = chat_prompts(seed)
    merged = interleave([(True, p) for p in templated], [(False, i) for i in range(synthetic)])[:answered]
    held = [p for i, (is_templated, p) in enumerate(merged) if is_templated and i % HELD_OUT_EVERY == 0]
    trained = [p for i, (is_templated, p) in enumerate(merged) if is_templated and i % HELD_OUT_EVERY]
    seen = set(held) | set(trained)
    return held, trained, [p for p in templated if p not in seen]


def fine_tune_prompts() -> list[str]:
    """The prompts of a fine-tune of the shipped drafter: every templated prompt the GPU recipe never answered (all
    chat questions: its code tasks ran out first) interleaved with the code tasks it trained on, so a fine-tune on
    new questions keeps seeing code. None of them is held out."""
    _, trained, fresh = recipe_split()
    code = [p for p in trained if is_code_task(p)]
    return interleave(fresh, code)


def is_code_task(prompt: str) -> bool:
    """Whether a templated prompt is one of `corpus.chat_prompts`' code tasks."""
    return prompt.startswith("def ") or "Python" in prompt.split("\n")[0]


def save_answers(rows: list[dict], out: Path, info: dict) -> None:
    """Answers (`{"ids", "prompt_len"}` rows, as the generate stage writes them) as uint16 token ids + offsets."""
    from safetensors.torch import save_file

    ids = np.concatenate([np.asarray(r["ids"], dtype=np.int64) for r in rows])
    if ids.max() >= 2**16:
        raise ValueError(f"token id {ids.max()} does not fit uint16: this format is for vocabularies up to 65,536")
    offsets = np.concatenate([[0], np.cumsum([len(r["ids"]) for r in rows])])
    out.mkdir(parents=True, exist_ok=True)
    tensors = {
        "ids": torch.from_numpy(ids.astype(np.uint16)),
        "offsets": torch.from_numpy(offsets.astype(np.int64)),
        "prompt_lens": torch.tensor([r["prompt_len"] for r in rows], dtype=torch.int64),
    }
    save_file(tensors, str(out / ANSWERS_NAME))
    answer_tokens = int(offsets[-1] - tensors["prompt_lens"].sum())
    (out / INFO_NAME).write_text(json.dumps({**info, "answers": len(rows), "answer_tokens": answer_tokens}, indent=2))


def load_answers(folder: Path) -> list[dict]:
    """The rows `save_answers` wrote, each a generated sequence as `distill.build_features` takes it."""
    from safetensors.torch import load_file

    path = Path(folder) / ANSWERS_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: write it with `python -m drafters.training.answer_sets heldout`")
    t = load_file(str(path))
    ids, offsets = t["ids"].to(torch.int64).tolist(), t["offsets"].tolist()
    return [
        {"ids": ids[a:b], "prompt_len": int(n), "source": "generated"}
        for a, b, n in zip(offsets[:-1], offsets[1:], t["prompt_lens"].tolist())
    ]


def shard_rows(shards: list[Path]) -> list[dict]:
    """The answers of the generate stage's shard files, in order."""
    return [r for path in shards for r in json.loads(path.read_text())]


def answer(prompts: list[str], gen_dir: Path, out: Path, batch_size: int, max_new_tokens: int, what: str, command: str):
    """The verifier's greedy answers to `prompts` as token ids in `out` (shards in `gen_dir`: an interrupted run
    resumes); `what` and the `command` that wrote them go into its answers.json."""
    from verifiers.embedded import load_verifier

    verifier, tokenizer = load_verifier("cpu")
    generate_shards(
        verifier, tokenizer, prompts, gen_dir, float("inf"), batch_size=batch_size, max_new_tokens=max_new_tokens
    )
    rows = shard_rows(sorted(gen_dir.glob("gen-*.json")))
    command += f" --out {out} --batch-size {batch_size} --max-new-tokens {max_new_tokens}"
    save_answers(rows, out, {"what": what, "command": command, "max_new_tokens": max_new_tokens})
    print(f"{len(rows)} answers in {out / ANSWERS_NAME}")


def answer_held_out(out: Path, work_dir: Path, batch_size: int, max_new_tokens: int) -> None:
    held, _, _ = recipe_split()
    what = "greedy answers of the verifier to the templated prompts the GPU recipe holds out"
    command = "python -m drafters.training.answer_sets heldout"
    answer(held, work_dir / f"heldout-answers-{max_new_tokens}", out, batch_size, max_new_tokens, what, command)


def answer_prompts(prompts: list[str], name: str, out: Path, work_dir: Path, batch_size: int, max_new_tokens: int):
    """Greedy answers to `prompts` (from the prompt file `name`) as token ids in `out`."""
    what = f"greedy answers of the verifier to the prompts of {name}"
    command = f"python -m drafters.training.answer_sets prompts --prompts {name}"
    gen_dir = work_dir / f"answers-{Path(name).stem}-{max_new_tokens}"
    answer(prompts, gen_dir, out, batch_size, max_new_tokens, what, command)


def pack_recipe(work_dir: Path, out: Path) -> None:
    """The recipe's generated answers under `work_dir` as compact token ids, with the user turns it sampled."""
    shards = sorted((work_dir / RECIPE_FOLDER).glob("gen-*.json"))
    turns = work_dir / RECIPE_TURNS
    if not shards or not turns.is_file():
        raise FileNotFoundError(
            f"no {RECIPE_FOLDER}/gen-*.json or {RECIPE_TURNS} under {work_dir}: pass the --work-dir a run of "
            "experiments/gpu_train.sh generated into (its WORK)"
        )
    rows = shard_rows(shards)
    info = {
        "what": f"the verifier's greedy answers of a GPU run of experiments/gpu_train.sh ({len(shards)} shards)",
        "command": f"python -m drafters.training.answer_sets recipe --work-dir {work_dir} --out {out}",
        "shard_size": RECIPE_BATCH,
    }
    save_answers(rows, out, info)
    (out / TURNS_NAME).write_bytes(turns.read_bytes())
    print(f"{len(rows)} answers of {len(shards)} shards and the sampled user turns in {out}")


def restore_recipe(folder: Path, work_dir: Path) -> None:
    """Write `pack_recipe`'s answers back as the generate stage's shards (and the sampled turns) under `work_dir`;
    shards already there are kept."""
    rows = load_answers(folder)
    gen_dir = work_dir / RECIPE_FOLDER
    gen_dir.mkdir(parents=True, exist_ok=True)
    for index, start in enumerate(range(0, len(rows), RECIPE_BATCH)):
        path = shard_path(gen_dir, index)
        if not path.exists():
            shard = [{"ids": r["ids"], "prompt_len": r["prompt_len"]} for r in rows[start : start + RECIPE_BATCH]]
            path.write_text(json.dumps(shard))
    turns = work_dir / RECIPE_TURNS
    if not turns.exists():
        turns.write_bytes((Path(folder) / TURNS_NAME).read_bytes())
    print(
        f"{len(rows)} answers in {gen_dir}: train with --work-dir {work_dir} --gen-batch {RECIPE_BATCH} "
        f"--synthetic-prompts {RECIPE_SYNTHETIC} --gen-shards N (up to {index + 1})"
    )


def main(argv=None) -> None:
    from drafters.training.train import DEFAULT_WORK_DIR

    parser = argparse.ArgumentParser(
        prog="python -m drafters.training.answer_sets",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("set", choices=("heldout", "prompts", "finetune", "recipe", "restore"))
    parser.add_argument("--out", type=Path, help="heldout, prompts, recipe: a folder; finetune: a .jsonl prompt file")
    parser.add_argument("--prompts", type=Path, help='prompts: the .jsonl of {"prompt": ...} lines to answer')
    parser.add_argument("--answers", type=Path, help="restore: the folder `recipe` wrote")
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=DEFAULT_WORK_DIR,
        help="heldout, prompts: where the shards are cached; recipe: read from, restore: written to (the recipe's "
        "WORK)",
    )
    parser.add_argument("--batch-size", type=int, default=52, help="heldout, prompts: prompts answered per batch")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="heldout, prompts: the longest answer")
    args = parser.parse_args(argv)
    if args.prompts is not None and args.set != "prompts":
        parser.error(f"--prompts is for the prompts set; {args.set} answers its own prompts")
    if args.set == "restore":
        if args.answers is None:
            parser.error("restore needs --answers FOLDER (what `recipe` wrote)")
        restore_recipe(args.answers, args.work_dir)
        return
    if args.out is None:
        parser.error(f"{args.set} needs --out")
    if args.set == "recipe":
        pack_recipe(args.work_dir, args.out)
        return
    if args.set == "heldout":
        answer_held_out(args.out, args.work_dir, args.batch_size, args.max_new_tokens)
        return
    if args.set == "prompts":
        if args.prompts is None or not args.prompts.is_file():
            parser.error(f'prompts needs --prompts FILE, a .jsonl of {{"prompt": ...}} lines (got {args.prompts})')
        try:
            prompts = prompt_file(args.prompts)
        except ValueError as error:
            parser.error(str(error))
        answer_prompts(prompts, str(args.prompts), args.out, args.work_dir, args.batch_size, args.max_new_tokens)
        return
    prompts = fine_tune_prompts()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    print(f"{len(prompts)} fine-tune prompts ({sum(map(is_code_task, prompts))} code tasks) in {args.out}")


if __name__ == "__main__":
    main()
