"""The sweep's plan: every (prompt, configuration) run, named by the record fields that resume compares.

Every argument is checked here, before any model loads.
"""

from __future__ import annotations

import argparse
import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from drafters import Drafter
from experiments.arguments import parse_numbers, split_list
from experiments.datasets import load_prompts
from experiments.methods import DRAFTERS, check_drafter_names, check_fits_model, make_drafter
from experiments.models import check_model_name
from schedulers import Scheduler
from schedulers.registry import check_scheduler_name, fixed_k, make_scheduler


@dataclass(frozen=True)
class Config:
    """One point of the sweep. scheduler and block_size are None for the `none` drafter."""

    drafter: str
    scheduler: str | None
    block_size: int | None
    temperature: float

    def make_drafter(self, reference: torch.Tensor, model) -> Drafter | None:
        return make_drafter(self.drafter, self.block_size, reference, model)

    def make_scheduler(self) -> Scheduler | None:
        return None if self.scheduler is None else make_scheduler(self.scheduler, self.block_size)


@dataclass(frozen=True)
class Prompt:
    dataset: str
    index: int  # position in the dataset
    text: str

    @property
    def sha1(self) -> str:  # in the run key, so an edited prompts file does not reuse stale runs
        return hashlib.sha1(self.text.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class Plan:
    model: str
    prompts: list[Prompt]
    configs: list[Config]
    max_new_tokens: int
    seed: int


# A run is identified by these record fields; resume compares them.
KEY_FIELDS = (
    "model",
    "dataset",
    "prompt_index",
    "prompt_sha1",
    "drafter",
    "scheduler",
    "block_size",
    "temperature",
    "max_new_tokens",
    "seed",
)
CONFIG_FIELDS = ("dataset", "drafter", "scheduler", "block_size", "temperature")


def run_fields(plan: Plan, prompt: Prompt, config: Config) -> dict:
    return {
        "model": plan.model,
        "dataset": prompt.dataset,
        "prompt_index": prompt.index,
        "prompt_sha1": prompt.sha1,
        "drafter": config.drafter,
        "scheduler": config.scheduler,
        "block_size": config.block_size,
        "temperature": config.temperature,
        "max_new_tokens": plan.max_new_tokens,
        "seed": plan.seed,
    }


def run_key(record: dict) -> tuple:
    return tuple(record[field] for field in KEY_FIELDS)


def in_plan_order(plan: Plan, records: list[dict]) -> list[dict]:
    """The records of this plan (not stale ones from other settings), prompt by prompt, config by config."""
    order = {
        run_key(run_fields(plan, p, c)): i
        for i, (p, c) in enumerate((p, c) for p in plan.prompts for c in plan.configs)
    }
    mine = {run_key(r): r for r in records if run_key(r) in order}
    return sorted(mine.values(), key=lambda r: order[run_key(r)])


def expand_configs(
    drafters: list[str], schedulers: list[str], block_sizes: list[int] | None, temperatures: list[float]
) -> list[Config]:
    """drafters x schedulers x block sizes x temperatures; `none` has neither scheduler nor block size."""
    check_drafter_names(drafters)
    for name in schedulers:
        check_scheduler_name(name)
    for size in block_sizes or []:
        if size < 1:
            raise ValueError(f"block size {size} must be >= 1")
    for t in temperatures:
        if not (math.isfinite(t) and t >= 0):
            raise ValueError(f"temperature {t} must be >= 0 (0 means greedy)")
    configs = []
    for name in drafters:
        entry = DRAFTERS[name]
        if entry is None:
            configs += [Config(name, None, None, t) for t in temperatures]
            continue
        for size in block_sizes or [entry.default_block_size]:
            if entry.max_block_size is not None and size > entry.max_block_size:
                raise ValueError(f"block size {size} is above drafter {name!r}'s maximum of {entry.max_block_size}")
            for scheduler in schedulers:
                k = fixed_k(scheduler, size)
                if k is not None and k > size:
                    raise ValueError(
                        f"scheduler {scheduler} verifies {k} tokens but block size {size} lets the drafter propose "
                        f"at most {size}: use block sizes >= {k}, or `fixed` for k = block size"
                    )
                configs += [Config(name, scheduler, size, t) for t in temperatures]
    return configs


def make_plan(args: argparse.Namespace) -> Plan:
    """Validate every argument and load the prompts; raises ValueError naming the bad value and the fix."""
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts {args.num_prompts}: need at least 1")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens}: need at least 1")
    check_model_name(args.model)
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise ValueError(f"--out {args.out} is a file; it must be a folder")
    block_sizes = parse_numbers(args.block_sizes, "--block-sizes", int) if args.block_sizes else None
    drafters = split_list(args.drafters, "--drafters")
    check_fits_model(args.model, drafters)
    configs = expand_configs(
        drafters,
        split_list(args.schedulers, "--schedulers"),
        block_sizes,
        parse_numbers(args.temperatures, "--temperatures", float),
    )
    prompts = []
    for dataset in split_list(args.datasets, "--datasets"):
        texts = load_prompts(dataset)[: args.num_prompts]
        if not texts:
            raise ValueError(f"dataset {dataset!r} has no prompts")
        prompts += [Prompt(dataset, i, text) for i, text in enumerate(texts)]
    return Plan(args.model, prompts, configs, args.max_new_tokens, args.seed)
