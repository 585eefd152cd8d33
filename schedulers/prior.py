"""Priors shipped beside a drafter's checkpoint: what the default scheduler knows before its first step.

A one-shot call (`python -m hybrid generate`, a script that decodes once, a server's first request) has no history
to learn from. `python -m experiments.scheduler_prior` decodes our own tuning prompts (never an evaluation set) with
the shipped drafter, one at a time and in batches of several rows, greedily or sampled (`--temperature`), and writes
what the cost-aware scheduler learned there to `scheduler_prior.json` in the drafter's checkpoint folder: the
acceptance counts, what each drafting stage adds at each batch size and how many steps the batches' calls saved. A
scheduler starts from the entry for its (drafter, verifier, decoding) fingerprint (a sampled decoding without one:
the nearest temperature's, `shipped_prior`), worth at most `PRIOR_OBSERVATIONS` observations per cell so the user's
own text soon outweighs it; without one (another drafter, a retrained checkpoint) it starts uninformed and learns
from its first step. Seconds are not in it: they belong to the machine, where verify costs are measured once and
cached on disk (`VerifyCostModel.for_model`) and draft costs are timed as the run goes.
"""

from __future__ import annotations

import json
from pathlib import Path

import drafters

CHECKPOINTS = Path(drafters.__file__).resolve().parent / "checkpoints"
PRIOR_FILE = "scheduler_prior.json"
PRIOR_OBSERVATIONS = 32
COMMAND = "python -m experiments.scheduler_prior"
FIELDS = ("fingerprint", "tried", "accepted", "stage_tokens", "stage_width", "batches")


def shipped_prior(fingerprint: dict, root: Path | None = None) -> tuple[Path, dict] | None:
    """(file, entry) of the prior measured for `fingerprint` among the checkpoints under `root` (default:
    `CHECKPOINTS`); None when no shipped file holds one for its drafter and verifier. A sampled decoding with no
    entry of its own takes the entry sampled at the nearest temperature, else the greedy one: the hotter the sampling,
    the less a drafted token matches, so the nearest temperature predicts it best."""
    found = [
        (path, entry)
        for path in sorted((root or CHECKPOINTS).glob(f"*/{PRIOR_FILE}"))
        for entry in read_priors(path)
        if _pair(entry["fingerprint"]) == _pair(fingerprint)
    ]
    if not found:
        return None
    decoding = fingerprint.get("decoding", {})
    return min(found, key=lambda item: _distance(decoding, item[1]["fingerprint"].get("decoding", {})))


def _pair(fingerprint: dict) -> dict:
    """The drafter and verifier of a fingerprint, without its decoding."""
    return {key: value for key, value in fingerprint.items() if key != "decoding"}


def _distance(decoding: dict, measured: dict) -> tuple:
    """How far an entry measured under `measured` decoding stands from `decoding` ({}: greedy), least first: the same
    decoding; a sampled one under the same acceptance rule, by temperature; the greedy one; any other."""
    if measured == decoding:
        return (0, 0.0)
    if decoding and measured and measured.get("acceptance") == decoding.get("acceptance"):
        return (1, abs(measured["temperature"] - decoding["temperature"]))
    return (2, 0.0) if not measured else (3, 0.0)


def read_priors(path: str | Path) -> list[dict]:
    try:
        entries = json.loads(Path(path).read_text())["priors"]
        missing = [(i, field) for i, entry in enumerate(entries) for field in FIELDS if field not in entry]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"cannot read scheduler prior {path}: {e!r}: rebuild it with `{COMMAND}`") from None
    if missing:
        raise ValueError(
            f"scheduler prior {path}: entry {missing[0][0]} lacks {missing[0][1]!r}: rebuild it with `{COMMAND}`"
        )
    return entries


def write_prior(path: str | Path, entry: dict) -> None:
    """Add `entry` to the prior file at `path`, replacing the one for the same fingerprint."""
    path = Path(path)
    kept = [e for e in read_priors(path) if e["fingerprint"] != entry["fingerprint"]] if path.exists() else []
    data = {"what": f"scheduler priors measured on the dev prompts, written by `{COMMAND}`", "priors": [*kept, entry]}
    path.write_text(json.dumps(data) + "\n")
