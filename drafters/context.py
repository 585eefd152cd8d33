"""The context a block drafter attends to: per-token keys/values projected from the verifier's hidden states.

They depend only on a token's states and position, so each is computed once, when the token is committed, into a
side buffer of the verifier's cache ([rows, capacity, layers, 2, kv_heads, head_dim]) that rolls back with it. A
draft then costs one forward over the block, reading the buffer's first n slots of its row.
"""

from __future__ import annotations

from typing import Callable

import torch

from drafters.base import DraftContext

# project(states [1, m, width], positions [1, m]) -> per layer (keys, values), each [1, kv_heads, m, head_dim]
Projection = Callable[[torch.Tensor, torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]


def sync_context(ctx: DraftContext, name: str, buffer: torch.Tensor, project: Projection, who: str):
    """Bring row `ctx.row` of side buffer `name` (`buffer`) up to the verifier's states of the committed tokens but
    the last (the anchor), projecting only the tokens it does not hold yet. Returns (n, the states [1, n, width])."""
    states = ctx.hidden_states()
    if states is None:
        raise ValueError(f"the verifier keeps no hidden states: run {who} through hybrid.generate")
    n = ctx.input_ids.shape[1] - 1
    if states.shape[1] != n:
        raise ValueError(f"verifier has states for {states.shape[1]} tokens, expected {n} (committed minus the anchor)")
    done = ctx.side_length(name)
    if done < n:
        positions = torch.arange(done, n, device=buffer.device)[None]
        context = project(states[:, done:n].to(buffer.device), positions)
        rows = torch.stack([torch.stack([k[0], v[0]]) for k, v in context])  # [layers, 2, kv_heads, n - done, d]
        buffer[ctx.row, done:n] = rows.permute(3, 0, 1, 2, 4)
        ctx.mark_computed(name, n)
    return n, states


def gather_context(ctxs: list[DraftContext], buffer: torch.Tensor, lengths: list[int]):
    """(per layer (keys, values) [R, kv_heads, slots, d] of rows `ctxs`, slots): every slot on the static path (one
    shape at every step), else up to the longest row; a row's slots past its length must be masked."""
    slots = buffer.shape[1] if ctxs[0].static else max(lengths)
    rows = [ctx.row for ctx in ctxs]
    # One row (always at batch 1) is a view, no copy; several are gathered.
    pick = slice(rows[0], rows[0] + 1) if len(rows) == 1 else torch.tensor(rows, device=buffer.device)
    picked = buffer[pick, :slots]  # [R, slots, layers, 2, kv_heads, d]
    layers = [(picked[:, :, i, 0].transpose(1, 2), picked[:, :, i, 1].transpose(1, 2)) for i in range(picked.shape[2])]
    return layers, slots
