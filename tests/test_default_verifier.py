"""The embedded default (real SmolLM2-135M-Instruct verifier). Slow: the first run fetches and converts the
model (~30 s); select with `-m slow`."""

from __future__ import annotations

import re

import pytest

import hybrid
import schedulers
from drafters import BlockDiffusionDrafter, ChainDrafter, PromptLookupDrafter
from hybrid.cli import main as cli_main
from hybrid.default import DRAFTER_DIR
from hybrid.testing import check_greedy_lossless
from schedulers import FixedScheduler
from schedulers.prior import shipped_prior
from verifiers.prompts import encode_prompt

pytestmark = pytest.mark.slow

# Our own prompts: the evaluation sets (HumanEval, MT-Bench) are never used to build or tune anything.
PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "List three differences between TCP and UDP.",
    "Write a bash one-liner that counts the lines of every .py file in a folder.",
]


@pytest.fixture(scope="module")
def default():
    return hybrid.load_default()


def test_the_embedded_verifier_saves_as_a_plain_folder_the_shipped_drafter_loads_for(default, tmp_path):
    from verifiers.pretrained import load_verifier_folder

    model, tokenizer, _ = default
    model.save_pretrained(tmp_path)  # a float32 checkpoint: nothing of the GGUF's quantisation is left in its config
    tokenizer.save_pretrained(tmp_path)
    folder, _ = load_verifier_folder(tmp_path)
    assert not hasattr(folder.config, "quantization_config")
    BlockDiffusionDrafter.from_pretrained(DRAFTER_DIR, folder)  # the same verifier by fingerprint


def test_load_default_is_smollm2_with_the_shipped_block_drafter(default):
    model, tokenizer, drafter = default
    assert model.config.vocab_size == len(tokenizer) == 49152
    assert model.config.num_hidden_layers == 30
    lookup, block = drafter.sources
    assert isinstance(drafter, ChainDrafter) and isinstance(lookup, PromptLookupDrafter)
    assert isinstance(block, BlockDiffusionDrafter)  # its fingerprint check passed against this verifier
    assert lookup.min_ngram == 1 and lookup.ngram_store is not None


def test_the_default_starts_each_decoding_from_its_own_shipped_prior(default):
    """The prior ships entries for the default drafter measured greedily and sampled at T 0.7 and 1.0: a call starts
    from the one `generate` names for its decoding (T 0.7 with top-p 0.9 from the T 0.7 entry, the nearest)."""
    model, tokenizer, drafter = default
    ids = encode_prompt(tokenizer, PROMPTS[0])
    started = {}
    for settings in (
        {},
        {"do_sample": True, "temperature": 1.0},
        {"do_sample": True, "temperature": 0.7, "top_p": 0.9},
    ):
        scheduler = schedulers.CostAwareScheduler()
        hybrid.generate(model, ids, drafter=drafter, scheduler=scheduler, max_new_tokens=2, **settings)
        assert scheduler.prior is not None
        started[str(settings)] = shipped_prior(scheduler.acceptance.fingerprint)[1]["fingerprint"]["decoding"]
    assert list(started.values()) == [{}, {"temperature": 1.0, "top_k": 50}, {"temperature": 0.7, "top_k": 50}]


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("lookup", [True, False])
def test_real_verifier_greedy_is_lossless(default, prompt, lookup):
    model, tokenizer, drafter = default
    if not lookup:  # the model alone: every draft token comes from the block-diffusion pass
        drafter = drafter.sources[-1]
    scheduler = FixedScheduler(drafter.max_draft_len)
    report = check_greedy_lossless(model, encode_prompt(tokenizer, prompt), drafter, scheduler, max_new_tokens=96)
    assert report.near_tie_at is None, f"near tie at new token {report.near_tie_at}"


def test_real_verifier_static_path_is_lossless(default):
    """The default drafter on the static-shape path (eager here; compiled on a GPU): generate's tokens, with the
    default scheduler's varying draft widths and with every step drafting in full."""
    model, tokenizer, drafter = default
    prompt = encode_prompt(tokenizer, PROMPTS[0])
    static = {"cache_implementation": "static"}
    report = check_greedy_lossless(model, prompt, drafter, max_new_tokens=96, hybrid_kwargs=static)
    assert report.near_tie_at is None, f"near tie at new token {report.near_tie_at}"
    # How much the default scheduler drafts follows this machine's measured verify costs, so acceptance is
    # asserted where every step drafts the whole chain: it depends on the drafter and the verifier alone.
    scheduler = FixedScheduler(drafter.max_draft_len)
    report = check_greedy_lossless(model, prompt, drafter, scheduler, max_new_tokens=96, hybrid_kwargs=static)
    assert report.near_tie_at is None, f"near tie at new token {report.near_tie_at}"
    assert report.stats.tau > 1.5, "the block drafter's drafts are accepted on the static path too"


def test_cli_prints_tau_above_one_and_speedup_on_code_prompt(default, capsys):
    cli_main(
        ["generate", "Write a Python class Matrix with add, multiply and transpose methods.", "--max-new-tokens", "96"]
    )
    printed = capsys.readouterr().out
    line = re.search(r"tau ([\d.]+)\s+speed-up ([\d.]+)x\s+identical to model.generate: (\w+)", printed)
    assert line, printed
    assert float(line[1]) > 1.0
    assert line[3] == "yes"
