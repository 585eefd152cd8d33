"""The recurrent and convolution states of linear-attention, state-space and short-convolution layers, per row, rolled
back to any accepted prefix of a verify without running a token twice.

Such a layer keeps no per-token slots: after n tokens it holds one convolution window (the last K inputs of its causal
convolution) and one recurrent state (Gated DeltaNet's [heads, k, v] matrix, Mamba's SSM state). Moving a length back
cannot undo a token that was folded in, so a verify of q tokens records instead:

- transformers' own recording (`activate_past_recording`, the path its assisted decoding takes) with
  `recurrent_states_to_keep = q`: the model then runs all q tokens through its one-token kernel, the one `generate`
  decodes with, and hands the cache the state after each of them;
- the convolution window grows to K + q columns, so the window after any prefix is a slice of it.

Forwards recorded one after another append to both (a drafter's one-token forwards). Once a row's kept count n is
known, `settle` keeps the state after n tokens and the window's columns n .. n + K - 1.
transformers' own `crop` is not used: it restores one count for every row, and its history misses the state after the
first token when a whole draft is rejected. A verifier's forward of one token records nothing, so it is `generate`'s
own step, bit for bit; it cannot be rolled back, and the engine always keeps the token it feeds alone.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import LinearAttentionLayer, get_layer_types_and_kwargs

STATE_LAYER_TYPES = ("linear_attention", "conv", "hybrid", "hybrid_sliding")


class RowStates(LinearAttentionLayer):
    """One layer's convolution windows and recurrent states, `number_of_states` of each, every tensor [rows, ...]."""

    def __init__(self, number_of_states: int = 1):
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)

    @property
    def holds_states(self) -> bool:
        """Whether a forward has stored a state here (a layer the model never reached holds none)."""
        return any(self.has_previous_state.values())

    def record(self, q: int) -> None:
        """Before a forward of q tokens: keep the state after each of them, after those of the forwards recorded
        since the last `settle` (transformers appends a forward's states to the history and its inputs to the
        convolution window)."""
        if not self.record_past:
            # One list per state (transformers' dict.fromkeys shares one list between them)
            self.recurrent_states_history = {i: [] for i in range(self.number_of_states)}
        self.record_past = True
        self.recurrent_states_to_keep = q

    def settle(self, kept: list[int]) -> None:
        """Row b keeps the first kept[b] tokens fed since the recording began: the states after them stay."""
        index = torch.tensor(kept)
        for i in range(self.number_of_states):
            if self.is_conv_states_initialized[i]:
                window = self.conv_states[i]  # [rows, channels, K + q]
                size = self.conv_kernel_size[i]
                columns = (index[:, None] + torch.arange(size)).to(window.device)  # [rows, K]
                self.conv_states[i] = window.gather(2, columns[:, None, :].expand(-1, window.shape[1], -1))
            if self.is_recurrent_states_initialized[i]:
                after = self.recurrent_states_history[i] + [self.recurrent_states[i]]  # after 0 .. q tokens
                if len(after) <= max(kept):
                    raise RuntimeError(
                        f"the layer recorded {len(after) - 1} states of the tokens fed since it last settled, fewer "
                        f"than the {max(kept)} a row keeps: its model ignores recurrent_states_to_keep"
                    )
                rows = torch.arange(len(kept))
                chosen = torch.stack([after[n][b] for b, n in zip(rows.tolist(), kept)])
                self.recurrent_states[i].copy_(chosen)
        self.record_past = False
        self.recurrent_states_to_keep = 0
        self.recurrent_states_history = {}

    def select(self, index: torch.Tensor) -> None:
        """Keep the rows `index` (settled states only)."""
        for i in range(self.number_of_states):
            if self.is_conv_states_initialized[i]:
                self.conv_states[i] = self.conv_states[i][index.to(self.conv_states[i].device)]
            if self.is_recurrent_states_initialized[i]:
                self.recurrent_states[i] = self.recurrent_states[i][index.to(self.recurrent_states[i].device)]

    def append_rows(self, other: RowStates) -> None:
        """Append the settled states of `other`'s rows after this layer's."""
        for i in range(self.number_of_states):
            if self.is_conv_states_initialized[i]:
                self.conv_states[i] = torch.cat([self.conv_states[i], other.conv_states[i]])
            if self.is_recurrent_states_initialized[i]:
                self.recurrent_states[i] = torch.cat([self.recurrent_states[i], other.recurrent_states[i]])

    def copy_row_into(self, layer: LinearAttentionLayer, row: int) -> None:
        """Fill a transformers linear-attention cache layer (a `DynamicCache`'s) with row `row`'s states."""
        for i in range(self.number_of_states):
            if self.is_conv_states_initialized[i]:
                conv = self.conv_states[i][row : row + 1].clone()
                layer.lazy_initialization(conv_states=conv, state_idx=i, conv_kernel_size=conv.shape[-1])
                layer.conv_states[i].copy_(conv)
            if self.is_recurrent_states_initialized[i]:
                state = self.recurrent_states[i][row : row + 1].clone()
                layer.lazy_initialization(recurrent_states=state, state_idx=i)
                layer.recurrent_states[i].copy_(state)
            layer.has_previous_state[i] = self.has_previous_state[i]


def layer_states(text_config) -> list[tuple[int, bool]]:
    """Per cache layer, as transformers builds its own caches for the config: how many conv/recurrent state pairs it
    keeps (0: none), and whether it also keeps attention keys/values (a hybrid layer, or an attention layer)."""
    types, kwargs = get_layer_types_and_kwargs(text_config)
    return [
        (kw.get("number_of_states", 1), kind.startswith("hybrid")) if kind in STATE_LAYER_TYPES else (0, True)
        for kind, kw in zip(types, kwargs)
    ]


def attention_free(text_config) -> bool:
    """Whether every layer keeps recurrent or convolution state and none attends (Mamba's): no token is placed by
    its position."""
    layers = layer_states(text_config)
    return bool(layers) and all(states and not attention for states, attention in layers)
