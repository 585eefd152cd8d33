"""Write the scheduler prior shipped beside the default drafter: what the cost-aware scheduler learns on our prompts.

    python -m experiments.scheduler_prior --num-prompts 8 --max-new-tokens 256
    python -m experiments.scheduler_prior --num-prompts 8 --max-new-tokens 256 --temperature 0.7
    python -m experiments.scheduler_prior --num-prompts 8 --max-new-tokens 256 --temperature 1.0

Decodes the dev prompts (experiments/prompts/dev.jsonl: ours, never an evaluation set) one at a time with
`hybrid.load_default()`'s verifier and drafter (`--branch` and `--refill-below` set those of the drafter) and a
`CostAwareScheduler` that starts uninformed and learns across them, as a process that has served those prompts
would; then, with the same scheduler, the dev and dev-chat prompts (both ours) in left-padded batches of each of
`--batch-sizes`, `--batch-tokens` new tokens a row. It decodes greedily, or sampled at `--temperature` from a fixed
seed: a drafted token matches a sampled choice less often, and each decoding has its own entry. It writes what holds
on any machine (the acceptance counts, what each drafting stage adds at each batch size, the steps the batches' calls
saved; `CostAwareScheduler.prior_entry`) to `scheduler_prior.json` in the shipped drafter's checkpoint folder, where
every calibrated scheduler for that drafter, verifier and decoding starts from it (`schedulers.prior`). Rerun it
after retraining the drafter or changing its settings: a prior measured for another fingerprint is not used.
"""

from __future__ import annotations

import argparse

import torch

import hybrid
from schedulers import CostAwareScheduler
from schedulers.prior import PRIOR_FILE, write_prior


def learn_prior(
    model,
    drafter,
    prompts: list[torch.Tensor],
    max_new_tokens: int,
    costs=None,
    batches: list[tuple[torch.Tensor, torch.Tensor]] = (),
    batch_tokens: int = 64,
    pad_token_id: int = 0,
    temperature: float = 0.0,
) -> CostAwareScheduler:
    """A scheduler that started uninformed and decoded each of `prompts` ([1, n] ids) with `drafter`, then each of
    `batches` ((left-padded ids, attention mask) of several rows), `batch_tokens` new tokens a row: greedily, or
    sampled at `temperature` (> 0) from torch's global RNG seeded 0."""
    scheduler = CostAwareScheduler(costs=costs, prior=False)
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {}
    torch.manual_seed(0)
    # Every step drafts with every stage and counts in a plain mean: the prior is what each stage adds over all the
    # prompts, not over the last steps, nor only where this machine's costs made the scheduler run them.
    scheduler.ALL_STAGES, scheduler.MOVING = True, 0.0
    for ids in prompts:
        hybrid.generate(model, ids, drafter=drafter, scheduler=scheduler, max_new_tokens=max_new_tokens, **sampling)
    for ids, mask in batches:
        hybrid.generate(
            model,
            ids,
            attention_mask=mask,
            drafter=drafter,
            scheduler=scheduler,
            max_new_tokens=batch_tokens,
            pad_token_id=pad_token_id,
            **sampling,
        )
    return scheduler


def main(argv=None):
    from experiments.arguments import parse_numbers
    from experiments.datasets import load_prompts
    from experiments.regimes import left_pad
    from hybrid.default import DRAFTER_BRANCH, DRAFTER_DIR, DRAFTER_REFILL_BELOW, default_drafter
    from verifiers.embedded import load_verifier
    from verifiers.prompts import encode_prompt

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--out", default=str(DRAFTER_DIR / PRIOR_FILE))
    parser.add_argument(
        "--branch",
        type=int,
        default=DRAFTER_BRANCH,
        help="the default drafter with this branch (drafters.ChainDrafter; the file keeps one entry per drafter)",
    )
    parser.add_argument(
        "--refill-below",
        type=float,
        default=DRAFTER_REFILL_BELOW,
        help="the default drafter with this refill_below (drafters.ChainDrafter; one entry per drafter)",
    )
    parser.add_argument("--batch-sizes", default="2,4,8", help="batch sizes to learn at too (empty: none)")
    parser.add_argument("--batch-tokens", type=int, default=64, help="new tokens a row in the batches")
    parser.add_argument("--temperature", type=float, default=0.0, help="sample at this temperature (0: greedy)")
    args = parser.parse_args(argv)
    try:
        batch_sizes = parse_numbers(args.batch_sizes, "--batch-sizes", int) if args.batch_sizes else []
    except ValueError as error:
        parser.error(str(error))
    if any(size < 2 for size in batch_sizes):
        parser.error(f"--batch-sizes {args.batch_sizes}: give sizes of 2 rows or more (batch 1 always runs)")
    if args.temperature < 0:
        parser.error(f"--temperature {args.temperature}: give 0 (greedy) or more")
    if args.batch_tokens < 1:
        parser.error(f"--batch-tokens {args.batch_tokens}: give 1 or more")
    if args.branch < 0:
        parser.error(f"--branch {args.branch}: give 0 (no branch) or more")
    if not 0 <= args.refill_below <= 1:
        parser.error(f"--refill-below {args.refill_below}: give a share in [0, 1] (0: never refill)")
    model, tokenizer = load_verifier()
    drafter = default_drafter(model, tokenizer, branch=args.branch, refill_below=args.refill_below)
    dev = [encode_prompt(tokenizer, prompt) for prompt in load_prompts("dev")]
    prompts = dev[: args.num_prompts]
    tuning = dev + [encode_prompt(tokenizer, prompt) for prompt in load_prompts("dev-chat")]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    batches = [left_pad(tuning[i : i + size], pad_id) for size in batch_sizes for i in range(0, len(tuning), size)]
    scheduler = learn_prior(
        model,
        drafter,
        prompts,
        args.max_new_tokens,
        batches=batches,
        batch_tokens=args.batch_tokens,
        pad_token_id=pad_id,
        temperature=args.temperature,
    )
    entry = scheduler.prior_entry()
    write_prior(args.out, entry)
    tried = int(scheduler.acceptance.tried.sum())
    print(f"{len(prompts)} dev prompts, {tried} tried draft nodes; per number of stages run, accepted tokens per step")
    print(f"{entry['stage_tokens']} and verify width {entry['stage_width']} -> {args.out}")
    for rows, batch in entry["batches"].items():
        saved, promised = batch["saved"]
        share = f"{saved / promised:.2f}" if promised else "-"
        print(f"batch {rows}: per row {batch['stage_tokens']}; steps saved / promised by accepted tokens {share}")


if __name__ == "__main__":
    main()
