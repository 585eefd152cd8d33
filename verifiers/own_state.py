"""Recurrent state that a model keeps in a structure of its own, not in transformers' Cache layers (RWKV's `state`
list, xLSTM's `xLSTMCache`): kept per row and rolled back to any accepted prefix by snapshot and replay.

Such a forward takes the state, folds its tokens in (in place: RWKV and xLSTM write into the tensors they are
given) and hands back the state after its last token only; none of them hands out the state after each token of a
forward of several, as transformers' state layers can (`verifiers.state_layers`). So before a forward that a
rollback may undo (a verify of drafted tokens, or any of a drafter's forwards) `OwnStates` keeps a copy of every
row's state, the snapshot, and then the tokens fed after it. Once each row's kept count n is known (`settle`, run
lazily where the state is next needed, as `SharedCache.settle_states` runs): a row that kept every fed token keeps
the final state; any other row restores its snapshot and runs its n kept tokens again, rows of one n in one forward
whose outputs are discarded. A verifier's forward of one token (no drafts) is always kept and snapshots nothing: it
is `generate`'s own step.

`StateFormat` knows one model type's structure: how its forward takes and returns it, and the tensors it is made of
(every one [rows, ...]), from which cloning, selecting, joining and overwriting rows follow.
"""

from __future__ import annotations

import copy

import torch


class StateFormat:
    """How one model type's forward takes, returns and holds its recurrent state."""

    def inputs(self, state) -> dict:
        """The forward's keyword arguments that pass `state` (None: the forward starts a fresh one)."""
        raise NotImplementedError

    def returned(self, out):
        """The state a forward's output holds, after its last token."""
        raise NotImplementedError

    def tensors(self, state) -> list[torch.Tensor]:
        """Every tensor of `state`, each [rows, ...]."""
        raise NotImplementedError

    def rebuilt(self, state, tensors: list[torch.Tensor]):
        """A structure like `state` made of `tensors` (in the order `tensors` gives them)."""
        raise NotImplementedError

    def exported(self, state, length: int):
        """One row's `state` as `generate` returns it as `out.cache`, after `length` tokens."""
        return state

    # Derived from the tensors: the same for every format.

    def clone(self, state):
        return self.rebuilt(state, [t.clone() for t in self.tensors(state)])

    def select(self, state, index: torch.Tensor):
        """The rows `index` of `state` (new tensors)."""
        return self.rebuilt(state, [t[index.to(t.device)] for t in self.tensors(state)])

    def joined(self, first, second):
        """The rows of `first`, then those of `second`."""
        return self.rebuilt(first, [torch.cat([a, b]) for a, b in zip(self.tensors(first), self.tensors(second))])

    def overwrite_rows(self, state, index: torch.Tensor, rows) -> None:
        """Write `rows` (a state of len(index) rows) over the rows `index` of `state`, in place."""
        for mine, theirs in zip(self.tensors(state), self.tensors(rows)):
            mine[index.to(mine.device)] = theirs.to(mine.device)


class RwkvState(StateFormat):
    """RWKV's `state`: five tensors [rows, hidden, layers] (the time-mix and channel-mix shifts, the numerator,
    denominator and maximum of its linear attention), passed as `state=` and returned as `out.state`, the same list;
    `generate` returns it as `out.cache`."""

    def inputs(self, state) -> dict:
        return {"state": state}

    def returned(self, out):
        return out.state

    def tensors(self, state) -> list[torch.Tensor]:
        return list(state)

    def rebuilt(self, state, tensors: list[torch.Tensor]):
        return list(tensors)


class XlstmState(StateFormat):
    """xLSTM's `xLSTMCache`: per layer a tuple of its mLSTM cell, normalizer and max states [rows, heads, ...],
    passed as `cache=` and returned as `out.cache`. Its `seqlen_offset` counts the tokens fed, read by nothing in its
    forward; an exported row's counts the row's tokens, as `generate`'s does."""

    def inputs(self, state) -> dict:
        return {"cache": state}

    def returned(self, out):
        return out.cache

    def tensors(self, state) -> list[torch.Tensor]:
        return [t for layer in sorted(state.rnn_state) for t in state.rnn_state[layer]]

    def rebuilt(self, state, tensors: list[torch.Tensor]):
        new = copy.copy(state)  # its config, dtype and flags; the tensors below are the new structure's own
        new.seqlen_offset = state.seqlen_offset.clone()
        rest = iter(tensors)
        new.rnn_state = {layer: tuple(next(rest) for _ in state.rnn_state[layer]) for layer in sorted(state.rnn_state)}
        return new

    def exported(self, state, length: int):
        state.seqlen_offset = torch.full_like(state.seqlen_offset, length)
        return state


# model_type -> its format: the models hybrid serves whose state lives outside transformers' Cache layers.
STATE_FORMATS = {"rwkv": RwkvState(), "xlstm": XlstmState()}


def state_format(model) -> StateFormat | None:
    """The format of `model`'s own state structure, or None where it keeps none (its state, if any, lives in
    transformers' Cache layers)."""
    return STATE_FORMATS.get(model.config.get_text_config().model_type)


class OwnStates:
    """Every row's state for one `SharedCache`, and what rolling it back needs: each row's snapshot from before the
    forwards since the last settling, and the tokens they fed."""

    def __init__(self, model, format: StateFormat):
        self.model = model
        self.format = format
        self.state = None  # after each row's cached tokens (None before the prefill: the forward starts one)
        self.snapshot = None  # each row's state when the recording began (None: not recording)
        self.fed: list[torch.Tensor] = []  # [rows, q] of each forward since the snapshot

    def record(self) -> None:
        """Before a forward a rollback may undo: keep each row's state, once per recording (a drafter's forwards
        record one after another from the first one's snapshot)."""
        if self.snapshot is None:
            self.snapshot = self.format.clone(self.state)  # a copy: the forward writes into the state it is given

    def inputs(self, input_ids: torch.Tensor) -> dict:
        """The forward's inputs that feed `input_ids` [rows, q] after each row's state; kept while recording."""
        if self.snapshot is not None:
            self.fed.append(input_ids)
        return {"input_ids": input_ids, **self.format.inputs(self.state)}

    def took(self, out) -> None:
        """After the forward: its state is each row's, after every token it fed."""
        self.state = self.format.returned(out)

    def settle(self, kept: list[int]) -> None:
        """Row b keeps the first kept[b] tokens fed since the snapshot: a row that kept them all keeps the state it
        holds; any other restores its snapshot and runs its kept tokens again, the rows of one count in one forward."""
        if not self.fed:  # the recorded forward never ran (it failed): the state is the snapshot's
            self.snapshot = None
            return
        fed = torch.cat(self.fed, dim=1)
        snapshot, self.snapshot, self.fed = self.snapshot, None, []
        by_count: dict[int, list[int]] = {}
        for b, n in enumerate(kept):
            if n < fed.shape[1]:
                by_count.setdefault(n, []).append(b)
        for n, rows in by_count.items():
            index = torch.tensor(rows, device=fed.device)
            restored = self.format.select(snapshot, index)
            if n:
                restored = self._replayed(fed[index, :n], restored)
            self.format.overwrite_rows(self.state, index, restored)

    def _replayed(self, input_ids: torch.Tensor, state):
        """`state` after `input_ids` (one forward; only the state is read)."""
        keep_one = {"logits_to_keep": 1} if self.model._supports_logits_to_keep() else {}
        out = self.model(**self.format.inputs(state), input_ids=input_ids, use_cache=True, **keep_one)
        return self.format.returned(out)

    def select(self, index: torch.Tensor) -> None:
        """Keep the rows `index` (settled states only)."""
        if self.state is not None:
            self.state = self.format.select(self.state, index)

    def append_rows(self, other: OwnStates) -> None:
        """Append the settled states of `other`'s rows after these."""
        self.state = self.format.joined(self.state, other.state)

    def exported(self, row: int, length: int):
        """Row `row`'s settled state as `generate` returns it as `out.cache`, after its `length` tokens."""
        index = torch.tensor([row])
        return self.format.exported(self.format.select(self.state, index), length)


class StateForwards:
    """Forwards of one row's tokens one after another through `model`'s own state, as hybrid feeds a verifier (a
    probe's, a cost measurement's): calling it with input_ids [1, q] runs them after those fed before."""

    def __init__(self, model):
        self.model = model
        self.format = state_format(model)
        self.state = None
        self._mark = None

    def __call__(self, input_ids: torch.Tensor, **kwargs):
        out = self.model(input_ids=input_ids, **self.format.inputs(self.state), use_cache=True, **kwargs)
        self.state = self.format.returned(out)
        return out

    def mark(self) -> None:
        """Remember the state now, for `back`."""
        self._mark = self.format.clone(self.state)

    def back(self) -> None:
        """Return to the state `mark` remembered."""
        self.state = self.format.clone(self._mark)
