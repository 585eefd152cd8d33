"""Rotary embeddings whose frequencies depend on the largest position a forward feeds.

transformers' `dynamic_rope_update` gives every token of a forward the frequencies chosen by that forward's last
position: LongRoPE (Phi-3's long-context models) switches from its short to its long factors once a forward reaches
`original_max_position_embeddings`; dynamic NTK scaling rescales, past `max_position_embeddings`, to the largest
position any forward has reached (module state: `max_seq_len_cached`). `generate` feeds one token per step, so
each token gets the frequencies of its own position. A verify feeds several, and a token fed beside drafts past the
switch would get other frequencies than `generate` gives it: different outputs, at any score gap.

So a forward's positions must all lie on one side of every switch: `positions_room` says how many positions past
the pending token a forward may feed. Past a dynamic NTK model's largest position so far every token rescales the
frequencies, so there it is none, and such a model decodes one token per step, as `generate` does.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RopeSwitch:
    module: torch.nn.Module  # the rotary embedding
    rope_type: str  # "longrope" or a dynamic NTK type
    at: int  # the first `max(position) + 1` that leaves the original frequencies
    layer_type: str | None  # the layer type of a per-layer-type rotary embedding, else None

    def room(self, position: int) -> int | None:
        """How many positions past `position` a forward that feeds it may feed (None: any number)."""
        if position + 1 <= self.at:  # within the original frequencies: stay there
            return self.at - position - 1
        if self.rope_type == "longrope":  # the long factors, from here on whatever the width
            return None
        # Dynamic NTK: up to the largest position a forward has reached, the frequencies are that position's; past
        # it, each token's own.
        name = "max_seq_len_cached" if self.layer_type is None else f"{self.layer_type}_max_seq_len_cached"
        reached = int(getattr(self.module, name, getattr(self.module, "max_seq_len_cached", self.at)))
        return max(reached - position - 1, 0)


def rope_switches(model) -> list[RopeSwitch]:
    """The rotary embeddings of `model` whose frequencies change with a forward's largest position."""
    switches = []
    for module in model.modules():
        rope_types = getattr(module, "rope_type", None)
        if not hasattr(module, "original_inv_freq") and not isinstance(rope_types, dict):
            continue
        items = rope_types.items() if isinstance(rope_types, dict) else [(None, rope_types)]
        for layer_type, rope_type in items:
            if not isinstance(rope_type, str):
                continue
            if rope_type == "longrope":
                parameters = module.config.rope_parameters
                parameters = parameters if layer_type is None else parameters[layer_type]
                at = parameters.get("original_max_position_embeddings") or module.config.max_position_embeddings
                switches.append(RopeSwitch(module, rope_type, int(at), layer_type))
            elif "dynamic" in rope_type:
                switches.append(RopeSwitch(module, rope_type, int(module.original_max_seq_len), layer_type))
    return switches


def positions_room(switches: list[RopeSwitch], position: int) -> int | None:
    """How many positions past `position` (the pending token's) a forward may feed so that every switch sees all of
    them on one side (None: any number)."""
    rooms = [room for room in (switch.room(position) for switch in switches) if room is not None]
    return min(rooms) if rooms else None


def crossing_problem(switches: list[RopeSwitch], positions: int) -> str | None:
    """Why a batch of several rows whose forwards reach `positions` positions cannot give `generate`'s output (None
    if it can): a switch reads the largest position of the whole forward, which in `generate` is the longest row's at
    every step, where hybrid's rows advance unevenly and leave when they finish."""
    for switch in switches:
        if positions > switch.at:
            return (
                f"its rotary embedding ({switch.rope_type}) changes every token's frequencies once a forward reaches "
                f"position {switch.at}, by the batch's longest row, which a batch decoded here reaches at other steps "
                f"than in model.generate: pass one prompt per call, or keep the longest prompt plus max_new_tokens "
                f"within {switch.at} tokens"
            )
    return None


@contextlib.contextmanager
def rotary_state_kept(model):
    """Forwards inside leave `model`'s rotary state as they found it: what dynamic NTK embeddings keep between
    forwards (their frequencies, the largest position reached, the scaling), which decides what the next forward
    computes past `max_position_embeddings`, in `generate` as in a decode here. Probes, cost measurements and a
    reference run are not the decode's own forwards."""
    modules = {id(switch.module): switch.module for switch in rope_switches(model) if switch.rope_type != "longrope"}
    state = [
        (
            module,
            {name: buffer.clone() for name, buffer in module._buffers.items() if name.endswith("inv_freq")},
            {
                name: value
                for name, value in vars(module).items()
                if name.endswith(("max_seq_len_cached", "attention_scaling"))
            },
        )
        for module in modules.values()
    ]
    try:
        yield
    finally:
        for module, buffers, attributes in state:
            for name, buffer in buffers.items():
                module.register_buffer(name, buffer, persistent=False)
            for name, value in attributes.items():
                setattr(module, name, value)
