"""Indexed attention (DeepSeek-V3.2's sparse attention, which GLM-5, HY-V4, AXK2 and Dots3 adopt) chooses, in a verify,
exactly what `generate`'s one-token steps choose.

A lightning indexer scores every earlier token for each query and the query attends to the top k of them. The
indexer's keys live in the cache's slots beside the keys and values (`cache._IndexedLayer`), and the cache's causal
mask hides later drafts, so each query in a verify scores the same tokens as its one-token step would. What can
differ is the choice among equal scores: the indexer's scores are sums of ReLUs, so many tie at exactly 0, and
`torch.topk` breaks ties by where they sit in the row it is given. `generate` gives a one-token step the row of its
whole sequence as it holds it (left padding and masked prompt tokens included, masked), and its prefill the padded
prompt's row; a verify's row has the other queries' slots besides.

So while a forward of the shared cache runs, each indexer's top-k is taken, for every query, over the row `generate`
would have given it (`select_as_generate`). Where that row is no longer than k, the query attends to all it sees
either way and the indexer's own choice stands: only contexts longer than the indexer's k (2048 in the released
models) pay for the per-query choice.
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
    """The indexers of a model with indexed attention: the modules that pick each query's top `index_topk` tokens."""
    return [m for m in model.modules() if hasattr(m, "index_topk") and type(m).__name__.endswith("Indexer")]


def select_as_generate(scores: torch.Tensor, k: int, positions: torch.Tensor, layout: PromptLayout) -> torch.Tensor:
    """The slots [rows, q, min(k, slots)] each query of a forward attends to: its top k of `scores` [rows, q, slots]
    (the indexer's, slot p holding position p) as `generate` takes them. A query choosing fewer repeats its first."""
    rows, q, slots = scores.shape
    chosen = torch.empty(rows, q, min(k, slots), dtype=torch.long)
    for b in range(rows):
        for i in range(q):
            position = int(positions[b, i])
            real, seen = layout.sequence(b, position)
            row = torch.full(real.shape, float("-inf"), dtype=scores.dtype)  # masked: equal, below every score
            row[seen] = scores[b, i, real[seen].to(scores.device)].cpu()
            top = row.topk(min(k, row.shape[0])).indices
            picked = real[top[seen[top]]]  # masked entries picked where fewer than k are seen point at no slot
            chosen[b, i] = torch.cat([picked, picked[:1].expand(chosen.shape[-1] - picked.shape[0])])
    return chosen.to(scores.device)


class _TopkAsGenerate(TorchFunctionMode):
    """Within an indexer's forward: its top-k over the cache's slots, taken per query as `generate` takes it."""

    def __init__(self, k: int, positions: torch.Tensor, layout: PromptLayout, slots: int):
        super().__init__()
        self.k, self.positions, self.layout, self.slots = k, positions, layout, slots

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.topk, torch.Tensor.topk):
            scores = args[0]
            dim = kwargs.get("dim", args[2] if len(args) > 2 else -1)
            if scores.dim() == 3 and dim in (-1, 2) and scores.shape[-1] == self.slots:
                indices = select_as_generate(scores, self.k, self.positions, self.layout)
                return torch.return_types.topk((scores.gather(-1, indices), indices))
        return func(*args, **kwargs)


@contextlib.contextmanager
def choosing_as_generate(modules: list[nn.Module], cache):
    """While a forward of `cache` (a `SharedCache`) runs: each of the indexer `modules` chooses as `generate` would
    where some query's row is longer than its k (module docstring)."""
    layout = cache.prompt_layout
    positions = cache._write_index
    if not modules or layout is None or positions is None:
        yield
        return
    k = min(module.index_topk for module in modules)
    longest = max(layout.row_length(b, int(positions[b].max())) for b in range(len(layout.prompt)))
    if longest <= k:  # every query selects all it sees, in generate's steps and here alike
        yield
        return
    positions = positions.cpu()
    active: list[_TopkAsGenerate] = []

    def enter(module, args):
        active.append(_TopkAsGenerate(module.index_topk, positions, layout, cache.end))
        active[-1].__enter__()

    def leave(module, args, output):
        active.pop().__exit__(None, None, None)

    handles = [h for m in modules for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        while active:  # an indexer that raised left its mode entered
            active.pop().__exit__(None, None, None)
