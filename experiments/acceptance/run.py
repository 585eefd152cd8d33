"""Running the plan: one prompt at a time, every pending configuration on it, plain generate once as reference."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch
from tqdm import tqdm

import hybrid
from experiments import metrics
from experiments.acceptance.plan import Config, Plan, Prompt, run_fields, run_key
from experiments.models import load_model
from experiments.runs import append_record
from hybrid.stats import timed
from verifiers.prompts import encode_prompt


def decoding_settings(temperature: float, max_new_tokens: int) -> dict:
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    return {"max_new_tokens": max_new_tokens} | sampling


def seed_for(*parts) -> int:
    """A seed from the run's identity, not from its place in a shard: sharded and unsharded runs agree."""
    return zlib.crc32(json.dumps(parts).encode())


def plain_generate(model, input_ids: torch.Tensor, temperature: float, plan: Plan, prompt: Prompt):
    """(output, seconds) of plain `model.generate`: the baseline, and for greedy the reference output."""
    # generate samples from the global RNG.
    torch.manual_seed(seed_for(plan.seed, prompt.dataset, prompt.index, temperature))
    settings = decoding_settings(temperature, plan.max_new_tokens) | {"attention_mask": torch.ones_like(input_ids)}
    return timed(lambda: model.generate(input_ids, **settings), model.device)


def run_one(model, input_ids, config: Config, fields: dict, reference, baseline, scheduler=None) -> dict:
    """Decode one prompt under one configuration; the record that goes to runs.jsonl."""
    generator = torch.Generator(device=model.device).manual_seed(seed_for(*run_key(fields)))
    drafter, scheduler = config.make_drafter(reference, model), scheduler or config.make_scheduler()
    settings = decoding_settings(config.temperature, fields["max_new_tokens"])
    (out, stats), seconds = timed(  # end to end, as plain generate is timed
        lambda: hybrid.generate(
            model, input_ids, drafter=drafter, scheduler=scheduler, generator=generator, return_stats=True, **settings
        ),
        model.device,
    )
    baseline_out, baseline_time = baseline
    baseline_new_tokens = baseline_out.shape[1] - input_ids.shape[1]
    baseline_tokens_per_s = baseline_new_tokens / baseline_time
    return fields | {
        "prompt_tokens": input_ids.shape[1],
        "new_tokens": stats.new_tokens,
        "output_ids": out[0, input_ids.shape[1] :].tolist(),
        "tau": stats.tau,
        "verifier_forwards": stats.verifier_forwards,
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "emitted": stats.emitted,
        "acceptance_by_position": metrics.acceptance_by_position(stats.drafted, stats.accepted),
        "prefill_time": stats.prefill_time,
        "draft_time": stats.draft_time,
        "verify_time": stats.verify_time,
        "engine_time": stats.total_time,  # inside the engine's loop: what the draft and verify times add up to
        "total_time": seconds,
        "tokens_per_s": stats.new_tokens / seconds,
        "baseline_new_tokens": baseline_new_tokens,
        "baseline_time": baseline_time,
        "baseline_tokens_per_s": baseline_tokens_per_s,
        "speedup": stats.new_tokens / seconds / baseline_tokens_per_s,
        # Greedy: always compared with plain generate. Sampled outputs differ by design (other random draws).
        "matches_generate": bool(torch.equal(out, reference)) if config.temperature == 0 else None,
    }


def run_shard(
    plan: Plan, prompts: list[Prompt], done: set[tuple], runs_path: Path, load=load_model, show_progress: bool = True
) -> list[dict]:
    """Run every configuration not in `done` on `prompts`, appending each record to runs_path as it finishes.

    The model loads only if something is pending, so a finished sweep reruns in a second.
    """
    pending = []
    for prompt in prompts:
        todo = [(c, f) for c in plan.configs if run_key(f := run_fields(plan, prompt, c)) not in done]
        if todo:
            pending.append((prompt, todo))
    total = sum(len(todo) for _, todo in pending)
    if not total:
        return []
    model, tokenizer = load(plan.model)
    warm_up = encode_prompt(tokenizer, pending[0][0].text)  # first-call costs stay out of the timed runs
    model.generate(warm_up, attention_mask=torch.ones_like(warm_up), max_new_tokens=2, do_sample=False)

    records = []
    # One scheduler per configuration for the whole shard: adaptive ones learn from every prompt so far.
    schedulers = {config: config.make_scheduler() for config in plan.configs}
    bar = tqdm(total=total, desc="acceptance", unit="run", disable=not show_progress, dynamic_ncols=True)
    for prompt, todo in pending:
        input_ids = encode_prompt(tokenizer, prompt.text).to(model.device)
        # Plain generate once per prompt and temperature; the greedy one is also the reference output.
        baselines = {0.0: plain_generate(model, input_ids, 0.0, plan, prompt)}
        reference = baselines[0.0][0]
        for config, fields in todo:
            if config.temperature not in baselines:
                baselines[config.temperature] = plain_generate(model, input_ids, config.temperature, plan, prompt)
            record = run_one(
                model, input_ids, config, fields, reference, baselines[config.temperature], schedulers[config]
            )
            append_record(runs_path, record)
            records.append(record)
            bar.update()
            tokens, seconds = sum(r["new_tokens"] for r in records), sum(r["total_time"] for r in records)
            bar.set_postfix(tau=f"{sum(r['tau'] for r in records) / len(records):.2f}", tok_s=f"{tokens / seconds:.1f}")
    bar.close()
    return records
