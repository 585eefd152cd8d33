"""Prompt sets that outlast a training run: held-out verifier answers as compact token ids, and unanswered prompts.

    python -m drafters.training.answer_sets heldout --out drafters/checkpoints/smollm2-135m-heldout
    python -m drafters.training.answer_sets finetune --out ~/.cache/hybrid/drafter/finetune-prompts.jsonl

The GPU recipe (experiments/gpu_train.sh) answers the first RECIPE_ANSWERED of its prompts, the templated ones
(`corpus.chat_prompts`) interleaved with RECIPE_SYNTHETIC user turns sampled from the verifier, and holds every
HELD_OUT_EVERY-th answer out of training and of the n-gram store. The templated prompts among the held-out ones
are the same on every machine (the sampled turns are not: they depend on the device's random numbers), so:

- `heldout` answers those prompts greedily with the verifier and writes their token ids (answers.safetensors,
  uint16, a few hundred kB) and how they were made (answers.json): the answers every drafter variant is scored on
  (`experiments.heldout --answers FOLDER`), without the features cache of a past run;
- `finetune` writes the templated prompts the recipe never answered (neither trained on nor held out), with the
  code tasks it trained on, as a prompt file for `drafters.training.train --prompts`: new data for a fine-tune of
  the shipped drafter (`fine_tune_prompts`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from drafters.training.corpus import chat_prompts
from drafters.training.distill import HELD_OUT_EVERY, generate_shards, interleave

RECIPE_ANSWERED = 13 * 512  # GEN_SHARDS x GEN_BATCH of experiments/gpu_train.sh
RECIPE_SYNTHETIC = 8000  # its SYNTHETIC
ANSWERS_NAME, INFO_NAME = "answers.safetensors", "answers.json"


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


def answer_held_out(out: Path, work_dir: Path, batch_size: int, max_new_tokens: int) -> None:
    from verifiers.embedded import load_verifier

    held, _, _ = recipe_split()
    verifier, tokenizer = load_verifier("cpu")
    gen_dir = work_dir / f"heldout-answers-{max_new_tokens}"  # shards: an interrupted run resumes
    generate_shards(
        verifier, tokenizer, held, gen_dir, float("inf"), batch_size=batch_size, max_new_tokens=max_new_tokens
    )
    rows = [r for path in sorted(gen_dir.glob("gen-*.json")) for r in json.loads(path.read_text())]
    info = {
        "what": "greedy answers of the verifier to the templated prompts the GPU recipe holds out",
        "command": f"python -m drafters.training.answer_sets heldout --out {out} --batch-size {batch_size} "
        f"--max-new-tokens {max_new_tokens}",
        "max_new_tokens": max_new_tokens,
    }
    save_answers(rows, out, info)
    print(f"{len(rows)} held-out answers in {out / ANSWERS_NAME}")


def main(argv=None) -> None:
    from drafters.training.train import DEFAULT_WORK_DIR

    parser = argparse.ArgumentParser(
        prog="python -m drafters.training.answer_sets",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("set", choices=("heldout", "finetune"))
    parser.add_argument("--out", type=Path, required=True, help="heldout: a folder; finetune: a .jsonl prompt file")
    parser.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR, help="where heldout's shards are cached")
    parser.add_argument("--batch-size", type=int, default=52, help="heldout: prompts answered per batch")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="heldout: the longest answer")
    args = parser.parse_args(argv)
    if args.set == "heldout":
        answer_held_out(args.out, args.work_dir, args.batch_size, args.max_new_tokens)
        return
    prompts = fine_tune_prompts()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    print(f"{len(prompts)} fine-tune prompts ({sum(map(is_code_task, prompts))} code tasks) in {args.out}")


if __name__ == "__main__":
    main()
