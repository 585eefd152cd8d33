"""Record every draft `hybrid.load_default()`'s drafter proposes on the first dev prompts, to replay against it.

    python tests/data/record_default_drafts.py     # writes tests/data/default_drafts.json

Greedy, a `FixedScheduler` that verifies every proposed token (the default scheduler's choices follow timings, so
its path would differ from run to run): the drafts alone decide the path, so a drafter that proposes the very same
drafts is asked the very same calls. Each prompt runs alone (`propose` through the base `propose_rows`), then all
of them as one left-padded batch (the block model's batched `propose_rows`).
tests/test_drafters.py's slow replay runs the same and compares draft by draft.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).with_name("default_drafts.json")
PROMPTS, MAX_NEW_TOKENS = 6, 64  # each alone
BATCH_PROMPTS, BATCH_NEW_TOKENS = 3, 32  # the first ones as one batch (kept short: the file stays small)


def record(model, tokenizer, drafter, prompts: list[str]) -> dict:
    """{"single": [per prompt: its calls], "batch": its calls}; a call is one `propose_rows`, a list of rows
    [committed length, tokens asked, drafted tokens, confidences in units of 1e-4 (rounded)]."""
    import hybrid
    from schedulers import FixedScheduler
    from verifiers.prompts import encode_prompt

    calls: list = []
    ask = drafter.propose_rows

    def propose_rows(drafters, ctxs, max_tokens):
        drafts = ask(drafters, ctxs, max_tokens)
        calls.append(
            [
                [
                    ctx.input_ids.shape[1],  # the committed tokens, padding left out
                    k,
                    d.tokens.tolist(),
                    [round(c * 1e4) for c in d.confidence.tolist()] if d.confidence is not None else None,
                ]
                for ctx, k, d in zip(ctxs, max_tokens, drafts)
            ]
        )
        return drafts

    drafter.propose_rows = propose_rows  # the engine asks the drafter it is given for every row's drafts
    settings = dict(do_sample=False, return_stats=True, tokenizer=tokenizer)
    try:
        single = []
        for prompt in prompts:
            calls = []
            hybrid.generate(
                model,
                encode_prompt(tokenizer, prompt),
                drafter=drafter,
                scheduler=FixedScheduler(drafter.max_draft_len),
                max_new_tokens=MAX_NEW_TOKENS,
                **settings,
            )
            single.append(calls)
        rows = [encode_prompt(tokenizer, prompt)[0] for prompt in prompts[:BATCH_PROMPTS]]
        width = max(row.shape[0] for row in rows)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        ids = torch.stack([torch.cat([row.new_full((width - row.shape[0],), pad), row]) for row in rows])
        mask = torch.stack([(torch.arange(width) >= width - row.shape[0]).long() for row in rows])
        calls = []
        hybrid.generate(
            model,
            ids,
            attention_mask=mask,
            pad_token_id=pad,
            drafter=drafter,
            scheduler=FixedScheduler(drafter.max_draft_len),
            max_new_tokens=BATCH_NEW_TOKENS,
            **settings,
        )
        return {"single": single, "batch": calls}
    finally:
        del drafter.propose_rows


def dev_prompts() -> list[str]:
    from experiments.datasets import load_prompts

    return load_prompts("dev")[:PROMPTS]


def main() -> None:
    sys.path.insert(0, str(ROOT))
    import hybrid

    model, tokenizer, drafter = hybrid.load_default()
    drafts = record(model, tokenizer, drafter, dev_prompts())
    meta = {
        "what": "drafts of hybrid.load_default()'s drafter, recorded by tests/data/record_default_drafts.py",
        "single": f"load_prompts('dev')[:{PROMPTS}] each alone, {MAX_NEW_TOKENS} new tokens",
        "batch": f"load_prompts('dev')[:{BATCH_PROMPTS}] as one batch, {BATCH_NEW_TOKENS} new tokens",
        "call": "per row: [committed length, max_tokens, tokens, confidences in units of 1e-4]",
    }
    OUT.write_text(json.dumps({"meta": meta, **drafts}, separators=(",", ":")) + "\n")
    n = sum(len(c) for c in drafts["single"]) + len(drafts["batch"])
    print(f"{n} calls -> {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
