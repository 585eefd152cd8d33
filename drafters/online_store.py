"""Online store: what the verifier said earlier in this process, for drafting what it will say again.

The offline n-gram store (`drafters.ngram_store`) is built from one verifier's training answers. This one fills
itself while the process runs: every sequence the engine commits (a server's requests, a script's calls) is
written into a ring buffer of at most `max_tokens` tokens, the oldest overwritten first, and a later lookup copies
what followed the longest earlier match of the context's end, as suffix decoding does in serving engines (Oliaro
et al. 2024, vLLM's `suffix` method). A repeated or related request then drafts the earlier answer.

Only the verifier's own tokens are ever drafted: a sequence is written as the tail of its prompt (matched, never
copied) and the tokens the engine committed after it. Losslessness does not depend on it (the verifier checks every
draft), but another user's prompt text is never proposed. The store is keyed to one verifier's weights (`weights_fingerprint`:
its architecture and sizes, and a sample of every parameter), checked on every call: a store filled by one model never
drafts for another (a fine-tune sharing the embedding included), and a model whose weights changed in place since the
store last saw it is a new model whose earlier answers the store forgets. Who may draft from whose answers is the
caller's choice: one store per client (`OnlineStores`) keeps one client's answers from drafting for another.

The index is a hash chain over token pairs, as LZ77 compressors find matches in a window: `head[h]` is the most
recent position whose pair (the token before it and its own) hashes to h, `prev[p]` the position before p with the
same hash. Chains run from newest to oldest, so a walk stops at the first position the ring has overwritten, and
at `max_chain` candidates; of those, the longest match wins, the most recent among equals.
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch

from drafters.base import check_same_verifier

SEPARATOR = -1  # between segments: never a token, so no match or copy runs across it
HASH_MULTIPLIER = 0x9E3779B97F4A7C15  # Fibonacci hashing: 2**64 / golden ratio
MASK_64 = (1 << 64) - 1
SAMPLES_PER_TENSOR = 16  # elements of each parameter in `weights_fingerprint`: a fine-tune moves nearly all of them


class OnlineStore:
    """A bounded store of the verifier's committed sequences, shared by every call that drafts with it.

    Args:
        max_tokens: the ring buffer's size in tokens (a power of two is not needed); memory is about 21 bytes a
            token (`nbytes`), allocated once, touched as it fills.
        verifier: the verifier model whose outputs it holds; None binds it to the first verifier that drafts with it
            (`bind`).
        max_match: the longest context suffix compared (also how much of a prompt's tail is kept before its answer).
        max_chain: candidate positions tried per lookup, newest first.
    """

    def __init__(self, max_tokens: int = 1 << 20, verifier=None, max_match: int = 32, max_chain: int = 16):
        check_sizes(max_tokens, max_match, max_chain)
        self.max_tokens, self.max_match, self.max_chain = max_tokens, max_match, max_chain
        self.hash_bits = max(1, (max_tokens - 1).bit_length())
        # Positions are absolute (0, 1, ... over the store's life); slot p % max_tokens holds position p. Zeros are
        # allocated lazily by the OS, so an unfilled store costs little resident memory.
        self.tokens = np.full(max_tokens, SEPARATOR, dtype=np.int32)
        self.draftable = np.zeros(max_tokens, dtype=bool)  # a committed token (True) or a prompt's (False)
        self.prev = np.zeros(max_tokens, dtype=np.int64)  # position + 1 of the previous one in the chain; 0: none
        self.head = np.zeros(1 << self.hash_bits, dtype=np.int64)  # position + 1 of the newest per hash; 0: none
        self.written = 0  # positions written so far; the store holds [max(0, written - max_tokens), written)
        self.sequences = 0  # sequences begun
        self._writer = None  # the sequence whose tokens end the buffer (it continues without a separator)
        self._lock = threading.Lock()  # calls on several threads (a server's requests) share one store
        self.verifier: dict | None = None  # weights_fingerprint() of the model whose answers it holds
        self._bound: weakref.ref | None = None  # that model object, and its weights_state() when last checked
        self._state: tuple | None = None
        if verifier is not None:
            self.bind(verifier)

    # -- what it holds ------------------------------------------------------------------------------

    @property
    def oldest(self) -> int:
        return max(0, self.written - self.max_tokens)

    @property
    def num_tokens(self) -> int:
        """Tokens held (prompt tails and separators included): at most `max_tokens`."""
        return self.written - self.oldest

    @property
    def nbytes(self) -> int:
        """Bytes of its arrays, allocated at construction: the bound on what it ever holds."""
        return self.tokens.nbytes + self.draftable.nbytes + self.prev.nbytes + self.head.nbytes

    def summary(self) -> str:
        return (
            f"online store: {self.num_tokens}/{self.max_tokens} tokens, {self.sequences} sequences seen, "
            f"{self.nbytes / 2**20:.1f} MiB"
        )

    # -- keyed to one verifier ------------------------------------------------------------------------

    def bind(self, model) -> None:
        """Check that `model` is the verifier whose outputs this store holds (the first model binds an unbound store);
        another one raises ValueError naming what differs. The model it holds answers of, its weights changed in place
        since the last check, is another model that keeps the name: the store forgets what it holds and binds to it
        (the old answers are no longer this model's, and a fresh store is what a new model gets)."""
        state = weights_state(model)
        with self._lock:
            same_object = self._bound is not None and self._bound() is model
            if same_object and state == self._state:
                return
        fingerprint = weights_fingerprint(model, state)
        with self._lock:
            if self.verifier is None or same_object:
                if self.verifier is not None:
                    self._clear()
                self.verifier = fingerprint
            check_same_verifier(
                self.verifier,
                fingerprint,
                "this online store holds another verifier's outputs",
                "give each verifier its own OnlineStore (hybrid.drafter_for(model) makes one)",
            )
            self._bound, self._state = weakref.ref(model), state

    def _clear(self) -> None:
        self.tokens.fill(SEPARATOR)
        self.head.fill(0)
        self.written = self.sequences = 0
        self._writer = None

    # -- writing ----------------------------------------------------------------------------------------

    def new_sequence(self) -> object:
        """A handle for one sequence's `add` calls."""
        with self._lock:
            self.sequences += 1
        return object()

    def add(self, sequence: object, ids: Sequence[int], start: int, answer_start: int) -> None:
        """Record `ids[start:]`, the tokens committed since the last `add` of `sequence` (ids is the whole sequence
        so far; tokens from `answer_start` on are the verifier's, the ones before it its prompt). A sequence written
        right after its own last tokens continues in place; otherwise it starts a segment with the `max_match` tokens
        before `start` again, so a match can reach back into them."""
        if start >= len(ids):
            return
        with self._lock:
            if self._writer is not sequence:
                start = max(0, start - self.max_match)
                self._write([SEPARATOR], [False])
                self._writer = sequence
            new = np.asarray(ids[start:], dtype=np.int64)
            self._write(new, np.arange(start, len(ids)) >= answer_start)

    def _write(self, tokens, draftable) -> None:
        for token, own in zip(tokens, draftable):
            p, slot = self.written, self.written % self.max_tokens
            self.tokens[slot], self.draftable[slot], self.prev[slot] = token, own, 0
            before = int(self.tokens[(p - 1) % self.max_tokens]) if p > self.oldest else SEPARATOR
            self.written += 1
            if token != SEPARATOR and before != SEPARATOR:
                h = self._hash(before, int(token))
                self.prev[slot], self.head[h] = self.head[h], p + 1

    def _hash(self, first: int, second: int) -> int:
        return (((first << 32 | second) * HASH_MULTIPLIER) & MASK_64) >> (64 - self.hash_bits)

    # -- drafting ---------------------------------------------------------------------------------------

    def lookup(self, context: Sequence[int], max_tokens: int) -> tuple[list[int], int]:
        """(up to `max_tokens` committed tokens that followed the longest earlier match of the end of `context`, and
        the match's length n, 2 <= n <= max_match); no match gives ([], 0)."""
        if len(context) < 2 or max_tokens < 1:
            return [], 0
        tail = np.asarray(context[-self.max_match :], dtype=np.int64)[::-1]  # newest first
        with self._lock:
            best, best_n = None, 1  # a real match has at least the pair; fewer is a hash collision
            p = int(self.head[self._hash(int(tail[1]), int(tail[0]))]) - 1
            for _ in range(self.max_chain):
                if p < self.oldest:
                    break
                n = self._match_length(p, tail)
                if n > best_n and self._copyable(p + 1):
                    best, best_n = p, n
                p = int(self.prev[p % self.max_tokens]) - 1
            if best is None:
                return [], 0
            return self._copy(best + 1, max_tokens), best_n

    def _match_length(self, p: int, tail: np.ndarray) -> int:
        """How many tokens ending at position p equal the context's last ones (a hash collision: fewer than 2)."""
        back = np.arange(min(tail.size, p - self.oldest + 1))
        agree = self.tokens[(p - back) % self.max_tokens] == tail[: back.size]
        return int(agree.cumprod().sum())

    def _copyable(self, p: int) -> bool:
        return p < self.written and bool(self.draftable[p % self.max_tokens])

    def _copy(self, p: int, max_tokens: int) -> list[int]:
        """The committed tokens from position p on, up to the next separator, prompt token or the buffer's end."""
        at = np.arange(p, min(p + max_tokens, self.written)) % self.max_tokens
        run = np.cumprod(self.draftable[at]).sum()
        return self.tokens[at[:run]].tolist()


class OnlineStores:
    """Online stores by key (a served client), made on first use: at most `max_stores`, the least recently used dropped
    first, each of `max_tokens` tokens, so all of them together hold at most `max_stores * max_tokens` tokens (about 21
    bytes each, `OnlineStore.nbytes`)."""

    def __init__(self, max_stores: int, max_tokens: int):
        if max_stores < 1:
            raise ValueError(f"max_stores={max_stores}: keep at least one store")
        check_sizes(max_tokens)  # before any request
        self.max_stores, self.max_tokens = max_stores, max_tokens
        self._stores: OrderedDict[str, OnlineStore] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._stores)

    def get(self, key: str) -> OnlineStore:
        with self._lock:
            store = self._stores.pop(key, None) or OnlineStore(self.max_tokens)
            self._stores[key] = store  # the most recent last
            while len(self._stores) > self.max_stores:
                self._stores.popitem(last=False)
            return store


def check_sizes(max_tokens: int, max_match: int = 32, max_chain: int = 16) -> None:
    if max_tokens < 2 * (max_match + 1):
        raise ValueError(
            f"max_tokens={max_tokens} cannot hold one prompt tail of max_match={max_match} tokens and an answer: "
            f"give at least {2 * (max_match + 1)}"
        )
    if max_match < 2 or max_chain < 1:
        raise ValueError(f"need max_match >= 2 (a token pair) and max_chain >= 1, got {max_match}, {max_chain}")


def weights_state(model) -> tuple:
    """What moves when a weight changes, checked on every call (about 5 ms on the 135M verifier on CPU, its 272
    tensors walked once): each parameter's address and autograd version counter, which every in-place op bumps (under
    no_grad too, as optimizers and load_state_dict write), then `sample`, a sha256 of each parameter's name, shape,
    dtype and `SAMPLES_PER_TENSOR` elements spread over it, which sees what a fine-tune, a merged LoRA or another
    checkpoint of the architecture changes, and a write through `.data`, which bypasses the counter."""
    versions, digest, samples = [], hashlib.sha256(), []
    for name, p in model.named_parameters():
        versions.append((p.data_ptr(), p._version))
        digest.update(f"{name}{tuple(p.shape)}{p.dtype};".encode())
        n, t = p.numel(), p.detach()
        step = max(1, n // SAMPLES_PER_TENSOR)
        if n and t.is_contiguous():
            samples.append(t.as_strided((min(n, SAMPLES_PER_TENSOR),), (step,), t.storage_offset()))
        elif n:
            samples.append(t.reshape(-1)[::step][:SAMPLES_PER_TENSOR])
    if samples:  # to the CPU in one copy
        digest.update(torch.cat(samples).float().cpu().numpy().tobytes())
    return (*versions, digest.hexdigest()[:16])


def weights_fingerprint(model, state: tuple | None = None) -> dict:
    """`verifier_fingerprint` (architecture, sizes, embedding) and `weights_state`'s sample of every weight: equal for
    the same weights in the same dtype, different for a fine-tune that shares the embedding. Kept per model while its
    `state` (computed when not given) stays: the embedding's hash takes about 0.25 s on the 135M verifier."""
    from drafters.block_diffusion import verifier_fingerprint

    state = weights_state(model) if state is None else state
    known = _FINGERPRINTS.get(model)
    if known is None or known[0] != state:
        fingerprint = verifier_fingerprint(model) | {"dtype": str(model.dtype), "weights_sha256": state[-1]}
        _FINGERPRINTS[model] = known = (state, fingerprint)
    return dict(known[1])


_FINGERPRINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (weights_state, fingerprint)
