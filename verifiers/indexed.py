"""Indexed attention (DeepSeek-V3.2's sparse attention, which GLM-5, HY-V4, AXK2 and Dots3 adopt, and DeepSeek-V4's
over its compressed entries) chooses, in a verify, exactly what `generate`'s one-token steps choose.

A lightning indexer scores every earlier token for each query and the query attends to the top k of them. The
indexer's keys live in the cache's slots beside the keys and values (`cache._IndexedLayer`), and the cache's causal
mask hides later drafts, so each query in a verify scores the same tokens as its one-token step would. What can
differ is the choice among equal scores: the indexer's scores are sums of ReLUs, so many tie at exactly 0, and
`torch.topk` breaks ties by where they sit in the row it is given. `generate` gives a one-token step the row of its
whole sequence as it holds it (left padding and masked prompt tokens included, masked), and its prefill the padded
prompt's row; a verify's row has the other queries' slots besides.

So while a forward of the shared cache runs, each indexer's top-k is taken, for every query, over the row `generate`
would have given it (`select_as_generate`). DeepSeek-V4's indexer scores compressed entries (`verifiers.compressed`):
a one-token step's row is the entries closed so far, a verify's has later ones besides, masked. Where that row is no
longer than k, the query attends to all it sees either way and the indexer's own choice stands: only contexts longer
than the indexer's k (2048 in the released models) pay for the per-query choice.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn
from torch.overrides import TorchFunctionMode


@dataclass
class PromptLayout:
    """The prompts as `generate` holds them: `real[b]` [width] is the position (among unmasked tokens) of row b's
    token at each index of its padded prompt, -1 where masked; `prompt[b]` counts its unmasked tokens."""

    real: list[torch.Tensor]
    prompt: list[int]

    @classmethod
    def of(cls, masks: list[torch.Tensor | None], lengths: list[int]) -> PromptLayout:
        width = max(n if mask is None else mask.shape[0] for mask, n in zip(masks, lengths))
        real = []
        for mask, n in zip(masks, lengths):
            kept = torch.ones(n, dtype=torch.bool) if mask is None else mask.bool().cpu()
            kept = torch.cat([kept.new_zeros(width - kept.shape[0]), kept])  # left-padded, as `generate` takes it
            real.append(torch.where(kept, kept.long().cumsum(0) - 1, -1))
        return cls(real, list(lengths))

    @property
    def width(self) -> int:
        return self.real[0].shape[0]

    def select(self, rows: list[int]) -> PromptLayout:
        return PromptLayout([self.real[r] for r in rows], [self.prompt[r] for r in rows])

    def join(self, other: PromptLayout) -> PromptLayout:
        width = max(self.width, other.width)
        real = [torch.cat([r.new_full((width - r.shape[0],), -1), r]) for r in self.real + other.real]
        return PromptLayout(real, self.prompt + other.prompt)

    def row_length(self, row: int, position: int) -> int:
        """The length of the row `generate` scores the query at `position` of row `row` over: its padded prompt in
        the prefill, the sequence up to the query after it."""
        if position < self.prompt[row]:
            return self.width
        return self.width + position - self.prompt[row] + 1

    def sequence(self, row: int, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions, seen) of that row: each entry's position among the row's tokens (-1: masked) and whether the
        query sees it."""
        prompt = self.real[row]
        length = self.row_length(row, position)
        generated = torch.arange(self.prompt[row], self.prompt[row] + length - self.width)
        positions = torch.cat([prompt, generated])
        return positions, (positions >= 0) & (positions <= position)


def indexers(model: nn.Module) -> list[nn.Module]:
    """The indexers of a model with indexed attention: the modules that pick each query's top `index_topk` tokens
    (DeepSeek-V3.2's, over the cache's slots) or compressed entries (DeepSeek-V4's, with a `compress_rate`)."""
    return [m for m in model.modules() if hasattr(m, "index_topk") and type(m).__name__.endswith("Indexer")]


def select_as_generate(scores: torch.Tensor, k: int, rows_of) -> torch.Tensor:
    """The indices [rows, q, min(k, n)] into `scores` [rows, q, n] (an indexer's) of each query's top k as `generate`
    takes them: `rows_of(b, i)` gives the row `generate` would have scored query i of row b over, as indices into n
    (-1: an entry it masks), as an int m for the first m entries, or None where this forward's own row is that row. A
    query choosing fewer than the others is padded with an index it does not see, which the attention masks as it
    masks every unseen one."""
    rows, q, n = scores.shape
    width = min(k, n)
    chosen = torch.empty(rows, q, width, dtype=torch.long, device=scores.device)
    own = None
    for b in range(rows):
        for i in range(q):
            entries = rows_of(b, i)
            if entries is None:
                own = scores.topk(width, dim=-1).indices if own is None else own
                chosen[b, i] = own[b, i]
                continue
            if isinstance(entries, int):  # a prefix, all seen: the query's own slots, unpadded
                picked = scores[b, i, :entries].topk(min(k, entries)).indices
                chosen[b, i, : picked.shape[0]] = picked
                chosen[b, i, picked.shape[0] :] = entries  # exists: fewer than `width` were picked
                continue
            seen = entries >= 0
            row = torch.full(entries.shape, float("-inf"), dtype=scores.dtype)  # masked: equal, below every score
            row[seen] = scores[b, i, entries[seen].to(scores.device)].cpu()
            picked = entries[row.topk(min(k, row.shape[0])).indices]
            picked = picked[picked >= 0]  # where fewer than k are seen, masked entries are picked too
            if picked.shape[0] < width:
                unseen = torch.ones(n, dtype=torch.bool)
                unseen[entries[seen]] = False
                pad = unseen.nonzero()[:1, 0].expand(width - picked.shape[0])
                picked = torch.cat([picked, pad])
            chosen[b, i] = picked.to(scores.device)
    return chosen


class _TopkAsGenerate(TorchFunctionMode):
    """Within an indexer's forward: its top-k over `n` entries, taken per query as `generate` takes it."""

    def __init__(self, k: int, n: int, rows_of):
        super().__init__()
        self.k, self.n, self.rows_of = k, n, rows_of

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.topk, torch.Tensor.topk):
            scores = args[0]
            dim = kwargs.get("dim", args[2] if len(args) > 2 else -1)
            if scores.dim() == 3 and dim in (-1, 2) and (self.n is None or scores.shape[-1] == self.n):
                indices = select_as_generate(scores, self.k, self.rows_of)
                return torch.return_types.topk((scores.gather(-1, indices), indices))
        return func(*args, **kwargs)


def _slot_rows(layout: PromptLayout, positions: list[list[int]]):
    """Indexed attention over the cache's slots (slot p: position p): `generate` scores a query over its sequence as
    it holds it, padding and masked prompt tokens masked, the prompt's tokens in a prefill as long as the prompt."""

    def rows_of(b: int, i: int) -> torch.Tensor | int:
        position = positions[b][i]
        if plain[b] and position >= layout.prompt[b]:  # a step over the row's own slots: the first position + 1
            return position + 1
        real, seen = layout.sequence(b, position)
        return torch.where(seen, real, -1)

    plain = [layout.width == n for n in layout.prompt]  # rows without padding or masked tokens

    longest = max(layout.row_length(b, row[-1]) for b, row in enumerate(positions))
    return rows_of, longest


def _entry_rows(layout: PromptLayout, positions: list[list[int]], rate: int):
    """DeepSeek-V4's compressed entries: a one-token step scores its query over the entries closed so far (window w
    closes at position (w + 1) * rate - 1); a prompt token is scored in the prefill, which runs here as there."""

    def rows_of(b: int, i: int) -> int | None:
        position = positions[b][i]
        return None if position < layout.prompt[b] else (position + 1) // rate

    steps = [(p + 1) // rate for b, row in enumerate(positions) for p in row if p >= layout.prompt[b]]
    return rows_of, max(steps, default=0)


@contextlib.contextmanager
def choosing_as_generate(modules: list[nn.Module], cache):
    """While a forward of `cache` (a `SharedCache`) runs: each of the indexer `modules` chooses as `generate` would
    where some query's row is longer than its k (module docstring)."""
    layout = cache.prompt_layout
    if not modules or layout is None or cache._write_index is None:
        yield
        return
    # A chain's positions, from the lengths the cache keeps on the host (indexed models verify chains): no device sync
    q = cache._write_index.shape[1]
    positions = [list(range(start, start + q)) for start in cache._forward_start]
    rows = {}  # one plan per kind of row: the slots, or each compress rate's entries
    plans = []
    for module in modules:
        rate = getattr(module, "compress_rate", None)
        if rate not in rows:
            rows[rate] = _slot_rows(layout, positions) if rate is None else _entry_rows(layout, positions, rate)
        rows_of, longest = rows[rate]
        if longest > module.index_topk:  # else every query selects all it sees, in generate's steps and here alike
            plans.append((module, rows_of, None if rate is not None else cache.end))
    if not plans:
        yield
        return
    active: list[_TopkAsGenerate] = []

    def hooks(rows_of, n):
        def enter(module, args):
            active.append(_TopkAsGenerate(module.index_topk, n, rows_of))
            active[-1].__enter__()

        def leave(module, args, output):
            active.pop().__exit__(None, None, None)

        return enter, leave

    handles = []
    for module, rows_of, n in plans:
        enter, leave = hooks(rows_of, n)
        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        while active:  # an indexer that raised left its mode entered
            active.pop().__exit__(None, None, None)
