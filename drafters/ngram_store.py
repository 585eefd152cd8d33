"""N-gram store: what the verifier itself said next after each n-gram, over all its training answers.

Prompt lookup copies from the current context. This copies from everything the verifier answered when the
drafter's training data was generated (`drafters.training`'s answers, held-out answers excluded): retrieval-based
drafting (REST, He et al. 2024) whose datastore is the verifier's own greedy output, so what it retrieves is
what this verifier tends to say. Per n-gram it keeps the most frequent next token and that token's share of
the n-gram's continuations, which is the confidence the scheduler calibrates.

Keys are the n tokens packed into one uint64 (exact, no hashing: n * bits(vocabulary) <= 64), one sorted array
per n, so a lookup is a binary search. The longest n-gram that matches the end of the context wins.

    python -m drafters.training.ngram_build --answers ~/.cache/hybrid/drafter-gpu/generated-b512-syn8000 \\
        --out drafters/checkpoints/smollm2-135m-ngram
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from drafters.base import check_same_verifier

CONFIG_NAME = "ngram_config.json"
TABLES_NAME = "ngrams.safetensors"


@dataclass
class NgramStore:
    """Per n in 1..max_n: sorted packed keys, the most frequent next token after each, and its share."""

    vocab_size: int
    keys: list[np.ndarray]  # [n - 1]: uint64, sorted
    next_tokens: list[np.ndarray]  # int64
    shares: list[np.ndarray]  # float32: count(next token) / count(n-gram)
    verifier: dict  # verifier_fingerprint() of the verifier whose answers these are
    info: dict  # how it was built (source, answers, tokens, min_count)

    @property
    def max_n(self) -> int:
        return len(self.keys)

    @property
    def bits(self) -> int:
        return token_bits(self.vocab_size)

    def digest(self) -> str:
        """A short hash of the tables: schedulers keep statistics per drafter, and another store is another drafter."""
        h = hashlib.sha256()
        for table in (*self.keys, *self.next_tokens):
            h.update(table.tobytes())
        return h.hexdigest()[:8]

    # -- building --------------------------------------------------------------------------------

    @classmethod
    def build(
        cls,
        answers: Iterable[tuple[Sequence[int], int]],
        vocab_size: int,
        max_n: int = 4,
        min_count: int = 2,
        verifier: dict | None = None,
        info: dict | None = None,
    ) -> NgramStore:
        """From (token ids, prompt length) pairs: every answer token, keyed by the n tokens before it (which may
        reach back into the prompt). N-grams seen fewer than `min_count` times are dropped: a single sighting
        predicts little and would make most of the table."""
        bits = token_bits(vocab_size)
        if not 1 <= max_n <= 64 // bits:
            raise ValueError(f"max_n must be in 1..{64 // bits} (n tokens of {bits} bits pack into 64), got {max_n}")
        if min_count < 1:
            raise ValueError(f"min_count must be >= 1, got {min_count}")
        windows = [[] for _ in range(max_n)]
        targets = [[] for _ in range(max_n)]
        tokens = 0
        for ids, prompt_len in answers:
            ids = np.asarray(ids, dtype=np.uint64)
            if ids.size and int(ids.max()) >= vocab_size:
                raise ValueError(
                    f"token id {int(ids.max())} >= vocab_size {vocab_size}: answers from another tokenizer"
                )
            tokens += max(0, ids.size - prompt_len)
            for n in range(1, max_n + 1):
                first = max(prompt_len, n)  # answer positions with n tokens before them
                if first >= ids.size:
                    continue
                windows[n - 1].append(np.lib.stride_tricks.sliding_window_view(ids[first - n : -1], n))
                targets[n - 1].append(ids[first:].astype(np.int64))
        keys, next_tokens, shares = [], [], []
        for n in range(1, max_n + 1):
            w = np.concatenate(windows[n - 1]) if windows[n - 1] else np.zeros((0, n), np.uint64)
            t = np.concatenate(targets[n - 1]) if targets[n - 1] else np.zeros(0, np.int64)
            k, nxt, share = most_frequent_next(pack(w, bits), t, min_count)
            keys.append(k)
            next_tokens.append(nxt)
            shares.append(share)
        info = dict(info or {}, answer_tokens=tokens, min_count=min_count, entries=[int(k.size) for k in keys])
        return cls(vocab_size, keys, next_tokens, shares, verifier or {}, info)

    # -- lookup ----------------------------------------------------------------------------------

    def next_token(self, context: Sequence[int], min_n: int = 1) -> tuple[int, float, int] | None:
        """(token, share, n) for the longest n-gram (n >= min_n) ending `context` that the store knows; else None."""
        for n in range(min(self.max_n, len(context)), min_n - 1, -1):
            key = pack(np.asarray(context[-n:], dtype=np.uint64)[None], self.bits)[0]
            keys = self.keys[n - 1]
            i = int(np.searchsorted(keys, key))
            if i < keys.size and keys[i] == key:
                return int(self.next_tokens[n - 1][i]), float(self.shares[n - 1][i]), n
        return None

    def continuation(self, context: Sequence[int], max_tokens: int, min_n: int = 1) -> tuple[list[int], list[float]]:
        """Up to `max_tokens` tokens chained greedily (each looked up after the ones before it) and their shares;
        stops where no n-gram of length >= min_n matches."""
        context = list(context[-self.max_n :])
        tokens, shares = [], []
        while len(tokens) < max_tokens:
            hit = self.next_token(context, min_n)
            if hit is None:
                break
            token, share, _ = hit
            tokens.append(token)
            shares.append(share)
            context = context[1:] + [token] if len(context) == self.max_n else context + [token]
        return tokens, shares

    # -- persistence -----------------------------------------------------------------------------

    def save_pretrained(self, path: str | Path) -> None:
        from safetensors.numpy import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        tables = {}
        for n in range(1, self.max_n + 1):
            tables[f"keys.{n}"] = self.keys[n - 1]
            tables[f"next.{n}"] = self.next_tokens[n - 1].astype(np.int32)
            tables[f"share.{n}"] = self.shares[n - 1].astype(np.float16)  # a confidence: 3 digits are plenty
        save_file(tables, str(path / TABLES_NAME))
        config = {"vocab_size": self.vocab_size, "max_n": self.max_n, "verifier": self.verifier, "info": self.info}
        (path / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")

    @classmethod
    def load(cls, store: NgramStore | str | Path | None, min_n: int = 1) -> NgramStore | None:
        """What a drafter's `ngram_store=` argument names (a store, its folder or None), checked against `min_n`."""
        if isinstance(store, (str, Path)):
            store = cls.from_pretrained(store)
        if store is not None and not 1 <= min_n <= store.max_n:
            raise ValueError(f"store_min_n must be in 1..{store.max_n} (the store's longest n-gram), got {min_n}")
        return store

    @classmethod
    def from_pretrained(cls, path: str | Path) -> NgramStore:
        from safetensors import SafetensorError
        from safetensors.numpy import load_file

        path = Path(path)
        config_file, tables_file = path / CONFIG_NAME, path / TABLES_NAME
        for file in (config_file, tables_file):
            if not file.is_file():
                raise FileNotFoundError(
                    f"{file} not found: an NgramStore is a folder with {CONFIG_NAME} and {TABLES_NAME} "
                    "(written by `python -m drafters.training.ngram_build`)"
                )
        try:
            config = json.loads(config_file.read_text())
            tables = load_file(str(tables_file))
            ns = range(1, config["max_n"] + 1)
            return cls(
                config["vocab_size"],
                [tables[f"keys.{n}"] for n in ns],
                [tables[f"next.{n}"].astype(np.int64) for n in ns],
                [tables[f"share.{n}"].astype(np.float32) for n in ns],
                config["verifier"],
                config["info"],
            )
        except (json.JSONDecodeError, KeyError, TypeError, SafetensorError, OSError) as e:
            raise ValueError(
                f"{path} is not a valid NgramStore ({type(e).__name__}: {e}): rebuild it with "
                "`python -m drafters.training.ngram_build`"
            ) from None


def token_bits(vocab_size: int) -> int:
    return max(1, (vocab_size - 1).bit_length())


def pack(windows: np.ndarray, bits: int) -> np.ndarray:
    """[rows, n] token ids -> [rows] uint64 keys, first token in the highest bits."""
    keys = np.zeros(windows.shape[0], dtype=np.uint64)
    for column in range(windows.shape[1]):
        keys = (keys << np.uint64(bits)) | windows[:, column].astype(np.uint64)
    return keys


def most_frequent_next(keys: np.ndarray, targets: np.ndarray, min_count: int):
    """(sorted unique keys seen >= min_count times, their most frequent target, its share); ties go to the
    smaller token id, so a build is deterministic."""
    pairs, counts = np.unique(np.stack([keys, targets.astype(np.uint64)], axis=1), axis=0, return_counts=True)
    pair_keys, pair_targets = pairs[:, 0], pairs[:, 1].astype(np.int64)
    order = np.lexsort((pair_targets, -counts, pair_keys))  # per key: most frequent first, then smaller token
    pair_keys, pair_targets, counts = pair_keys[order], pair_targets[order], counts[order]
    first = np.flatnonzero(np.r_[True, pair_keys[1:] != pair_keys[:-1]]) if pair_keys.size else np.zeros(0, np.int64)
    totals = np.add.reduceat(counts, first) if first.size else np.zeros(0, np.int64)
    keep = totals >= min_count
    return (
        pair_keys[first][keep],
        pair_targets[first][keep],
        (counts[first] / np.maximum(totals, 1)).astype(np.float32)[keep],
    )


def check_store_fits(store: NgramStore, fingerprint: dict) -> None:
    """The store's tokens are the verifier's: another verifier (tokenizer) gets a clear error."""
    check_same_verifier(
        store.verifier,
        fingerprint,
        "this n-gram store was built from another verifier's answers",
        "build one for this verifier with `python -m drafters.training.ngram_build`",
    )
